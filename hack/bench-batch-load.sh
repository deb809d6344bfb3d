#!/usr/bin/env bash
# bench-batch-load: uproxy bench with its load generators and backend process at
# SCHED_BATCH and every proxy at SCHED_OTHER. A batch task that wakes does not
# preempt the task running on its CPU, so the proxy under test is not preempted by
# the clients and backends its own writes wake
# (docs/decisions/2026-11-24-loop-waits-for-cpu.md). A diagnostic: the bench's
# default leaves every process at SCHED_OTHER.
# Usage: hack/bench-batch-load.sh [path/to/uproxy] [uproxy bench flags...]
#   e.g. hack/bench-batch-load.sh bin/uproxy --paths lo-userspace,lo-nginx --workloads connections
# Needs root (as uproxy bench does) and chrt (util-linux).
set -euo pipefail

UPROXY=bin/uproxy
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
	UPROXY=$1
	shift
fi
UPROXY=$(realpath "$UPROXY")
[ -x "$UPROXY" ] || { echo "bench-batch-load: no uproxy binary at $UPROXY (make build)" >&2; exit 1; }
command -v chrt >/dev/null || { echo "bench-batch-load: chrt not found (util-linux)" >&2; exit 1; }

WRAP=$(mktemp -d /tmp/bench-batch-load.XXXXXX)
trap 'rm -rf "$WRAP"' EXIT

# The bench starts each proxy as a child, which would inherit SCHED_BATCH: each
# starts through a script that puts it back to SCHED_OTHER. The peers are found on
# PATH, so their scripts go first on it.
wrap() { # wrap NAME TARGET
	printf '#!/bin/sh\nexec chrt --other 0 %s "$@"\n' "$2" >"$WRAP/$1"
	chmod +x "$WRAP/$1"
}
wrap uproxy "$UPROXY"
for peer in nginx haproxy; do
	if target=$(command -v "$peer"); then
		wrap "$peer" "$target"
	fi
done

PATH="$WRAP:$PATH" chrt --batch 0 "$UPROXY" bench --uproxy "$WRAP/uproxy" "$@"
