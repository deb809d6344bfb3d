#!/usr/bin/env bash
# Builds the kube-apiserver and etcd binaries that testbed/kubeapi starts for tests, and
# the kube-proxy that integration tests run beside uproxy.
#
# Usage: hack/build-kube.sh [BINDIR]    (BINDIR defaults to bin/ at the repository root)
#
# Versions are pinned by the modules tools/kube-apiserver (k8s.io/kubernetes, for both
# kube-apiserver and kube-proxy: its go.mod lists both as tools) and tools/etcd (go.mod
# and go.sum are committed), so every machine builds the same sources. A binary that
# already exists in BINDIR is kept and its version printed when it is up to date: etcd
# whenever it exists, kube-apiserver and kube-proxy when their --version names the pinned
# Kubernetes version (otherwise they are rebuilt). Delete a binary to force a rebuild. Each binary is written
# to a temporary name and renamed when complete, so an interrupted build never leaves a
# truncated binary that a later run would take for a finished one.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bindir="${1:-$root/bin}"
mkdir -p "$bindir"
bindir="$(cd "$bindir" && pwd)"

# A go.work elsewhere on the machine must not pull the tool modules into a workspace.
export GOWORK=off

log() { printf 'build-kube: %s\n' "$*"; }

# build NAME MODULE_DIR PACKAGE [EXTRA_LDFLAGS [WANT_VERSION]]
# An existing binary is kept when WANT_VERSION is empty or its --version output names it.
build() {
	local name="$1" moddir="$2" pkg="$3" extra="${4:-}" want="${5:-}"
	local out="$bindir/$name"
	if [[ -x "$out" ]]; then
		local have
		have="$("$out" --version 2>&1 | head -n 1 || true)"
		if [[ -z "$want" || " $have " == *" $want "* ]]; then
			log "$name exists at $out, up to date, skipping: $have"
			return 0
		fi
		log "$name at $out reports '$have', not $want: rebuilding"
	fi
	log "building $name from $pkg (module $moddir) into $out"
	local start=$SECONDS
	go -C "$root/$moddir" build -trimpath -ldflags="-s -w $extra" -o "$out.tmp" "$pkg"
	mv -f "$out.tmp" "$out"
	log "built $name in $((SECONDS - start))s, $(du -h "$out" | cut -f1): $("$out" --version 2>&1 | head -n 1)"
}

# kube-apiserver reports its version from variables that Kubernetes release builds set
# with -X; without them it calls itself v0.0.0-master. Take the version from go.mod so the
# two cannot disagree.
kube_version="$(go -C "$root/tools/kube-apiserver" list -m -f '{{.Version}}' k8s.io/kubernetes)"
if [[ ! "$kube_version" =~ ^v([0-9]+)\.([0-9]+)\.[0-9]+$ ]]; then
	log "unexpected k8s.io/kubernetes version '$kube_version' in tools/kube-apiserver/go.mod" >&2
	exit 1
fi
vpkg=k8s.io/component-base/version
kube_ldflags="-X $vpkg.gitVersion=$kube_version -X $vpkg.gitMajor=${BASH_REMATCH[1]}"
kube_ldflags+=" -X $vpkg.gitMinor=${BASH_REMATCH[2]} -X $vpkg.gitTreeState=clean"

build etcd tools/etcd go.etcd.io/etcd/server/v3
build kube-apiserver tools/kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$kube_ldflags" "$kube_version"
build kube-proxy tools/kube-apiserver k8s.io/kubernetes/cmd/kube-proxy "$kube_ldflags" "$kube_version"
log "done: binaries in $bindir"
