#!/usr/bin/env bash
# wrk-close: short HTTP connections that the server closes first, measured from
# outside uproxy bench. wrk (one thread, C, HTTP/1.1 with "Connection: close")
# keeps CONNECTIONS connections in flight through each proxy in turn - uproxy
# (--rules none, dialed on its proxy port), HAProxy (tcp mode, splice) and nginx
# (stream) - to one nginx HTTP backend, all on 127.0.0.1 in a network namespace
# of the script's own. Rounds interleave the proxies. Each line gives wrk's
# connections per second, the proxy's CPU per connection (its processes'
# utime+stime from /proc) and the busy CPUs of the proxy and of the machine; each
# round ends with uproxy's figures divided by the better peer's.
#
# The load generator is not uproxy's own, so this is a check on what uproxy bench
# says for its connections-server-close workload
# (docs/decisions/2026-11-29-outside-measurement.md).
#
# Usage: hack/wrk-close.sh [path/to/uproxy (default: the checkout's bin/uproxy)] [-r ROUNDS] [-d SECONDS] [-c CONNECTIONS] [-- uproxy flags...]
#   e.g. hack/wrk-close.sh bin/uproxy -r 3 -d 5 -c 50
# Needs root, ip (iproute2), nginx with its stream module, haproxy and wrk.
set -euo pipefail

UPROXY=$(dirname "$0")/../bin/uproxy
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
	UPROXY=$1
	shift
fi
ROUNDS=3 SECONDS_PER_ROUND=5 CONNECTIONS=50
while [ $# -gt 0 ]; do
	case $1 in
	-r) ROUNDS=$2; shift 2 ;;
	-d) SECONDS_PER_ROUND=$2; shift 2 ;;
	-c) CONNECTIONS=$2; shift 2 ;;
	--) shift; break ;;
	*) echo "wrk-close: unknown argument $1 (usage: see the head of $0)" >&2; exit 2 ;;
	esac
done
for n in "$ROUNDS" "$SECONDS_PER_ROUND" "$CONNECTIONS"; do
	case $n in '' | *[!0-9]* | 0) echo "wrk-close: -r, -d and -c take a positive whole number, not '$n'" >&2; exit 2 ;; esac
done
if [ ! -f "$UPROXY" ] || [ ! -x "$UPROXY" ]; then
	echo "wrk-close: no uproxy binary at $UPROXY (make build)" >&2
	exit 1
fi
UPROXY=$(realpath "$UPROXY")
[ "$(id -u)" = 0 ] || { echo "wrk-close: needs root (a network namespace of its own)" >&2; exit 1; }
for c in ip nginx haproxy wrk; do
	command -v $c >/dev/null || { echo "wrk-close: $c not found (apt-get install iproute2 nginx libnginx-mod-stream haproxy wrk)" >&2; exit 1; }
done
STREAM=/usr/lib/nginx/modules/ngx_stream_module.so
[ -f $STREAM ] || { echo "wrk-close: no nginx stream module at $STREAM (apt-get install libnginx-mod-stream)" >&2; exit 1; }

NS=wrk-close-$$
DIR=$(mktemp -d /tmp/wrk-close.XXXXXX)
cleanup() {
	local pids
	pids=$(ip netns pids "$NS" 2>/dev/null || true)
	# shellcheck disable=SC2086 # one word per process
	[ -z "$pids" ] || kill $pids 2>/dev/null || true
	sleep 0.5
	ip netns del "$NS" 2>/dev/null || true
	rm -rf "$DIR"
}
trap cleanup EXIT
ip netns add "$NS"
ip -n "$NS" link set lo up
in_ns() { ip netns exec "$NS" "$@"; }

BACKEND=127.0.0.1:8080 UPROXY_PORT=20080 HAPROXY_PORT=18080 NGINX_PORT=19080
mkdir -p "$DIR/backend/logs" "$DIR/stream/logs" "$DIR/services"
cat >"$DIR/backend/nginx.conf" <<EOF
daemon off;
worker_processes auto;
pid $DIR/backend/nginx.pid;
error_log $DIR/backend/logs/error.log warn;
events { worker_connections 10000; }
http { access_log off; server { listen $BACKEND backlog=4096; location / { return 200 "a short reply\n"; } } }
EOF
cat >"$DIR/stream/nginx.conf" <<EOF
load_module $STREAM;
daemon off;
worker_processes auto;
worker_rlimit_nofile 20000;
pid $DIR/stream/nginx.pid;
error_log $DIR/stream/logs/error.log warn;
events { worker_connections 19800; }
stream { server { listen 127.0.0.1:$NGINX_PORT; proxy_pass $BACKEND; proxy_timeout 1h; proxy_half_close on; } }
EOF
cat >"$DIR/haproxy.cfg" <<EOF
global
	maxconn 8726
	maxpipes 1024
defaults
	mode tcp
	maxconn 8726
	timeout connect 5s
	timeout client 1h
	timeout server 1h
	option splice-request
	option splice-response
listen web
	bind 127.0.0.1:$HAPROXY_PORT
	server backend $BACKEND
EOF
cat >"$DIR/services/web.yaml" <<EOF
apiVersion: v1
kind: Service
metadata: {name: web, namespace: wrk}
spec: {type: ClusterIP, clusterIP: 10.96.0.80, clusterIPs: [10.96.0.80], ports: [{name: http, protocol: TCP, port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: wrk, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, protocol: TCP, port: ${BACKEND#*:}}]
endpoints: [{addresses: ["${BACKEND%:*}"], conditions: {ready: true}}]
EOF

ip netns exec "$NS" nginx -p "$DIR/backend" -c "$DIR/backend/nginx.conf" -e "$DIR/backend/logs/error.log" &
ip netns exec "$NS" nginx -p "$DIR/stream" -c "$DIR/stream/nginx.conf" -e "$DIR/stream/logs/error.log" &
NGINX=$!
ip netns exec "$NS" haproxy -db -f "$DIR/haproxy.cfg" >"$DIR/haproxy.log" 2>&1 &
HAPROXY=$!
ip netns exec "$NS" "$UPROXY" --services "$DIR/services" --rules none --bind-address 127.0.0.1 --proxy-port-range $UPROXY_PORT-$UPROXY_PORT \
	--metrics-bind-address 127.0.0.1:10249 --healthz-bind-address 127.0.0.1:10256 \
	--conntrack-max-per-core 0 "$@" >"$DIR/uproxy.log" 2>&1 &
UPROXY_PID=$!

# Each proxy answers through the backend before the first round (wrk's warm-up).
declare -A LOG=([$UPROXY_PORT]=$DIR/uproxy.log [$HAPROXY_PORT]=$DIR/haproxy.log [$NGINX_PORT]=$DIR/stream/logs/error.log)
for port in $UPROXY_PORT $HAPROXY_PORT $NGINX_PORT; do
	ok=
	for _ in $(seq 50); do
		if in_ns wrk -t1 -c1 -d1s -H "Connection: close" "http://127.0.0.1:$port/" 2>/dev/null | grep -q "requests in"; then
			ok=1
			break
		fi
		sleep 0.2
	done
	[ -n "$ok" ] || { echo "wrk-close: nothing answers on 127.0.0.1:$port; the end of ${LOG[$port]##*/}:" >&2; tail -5 "${LOG[$port]}" >&2; exit 1; }
done

# cpu_ticks PID...: utime+stime of the processes and their children (nginx's
# workers). ip netns exec becomes the command it runs, so each PID is the proxy's.
cpu_ticks() {
	local total=0 pid kids p u s
	for pid in "$@"; do
		kids=$(cat /proc/"$pid"/task/*/children 2>/dev/null || true)
		for p in $pid $kids; do
			read -r u s < <(cut -d' ' -f14,15 /proc/"$p"/stat)
			total=$((total + u + s))
		done
	done
	echo $total
}
# machine_ticks: busy and all jiffies of every CPU.
machine_ticks() { awk '/^cpu /{busy=$2+$3+$4+$7+$8+$9; print busy, busy+$5+$6}' /proc/stat; }

HZ=$(getconf CLK_TCK)
CPUS=$(nproc)
declare -A PORT=([uproxy]=$UPROXY_PORT [haproxy]=$HAPROXY_PORT [nginx]=$NGINX_PORT)
declare -A PID=([uproxy]=$UPROXY_PID [haproxy]=$HAPROXY [nginx]=$NGINX)
echo "wrk -t1 -c$CONNECTIONS -d${SECONDS_PER_ROUND}s, Connection: close, to nginx on $BACKEND; $CPUS CPUs; $(date -u '+%F %T') UTC; load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s %-8s %8s %14s %11s %13s %7s\n' round proxy conn/s "CPU µs/conn" "proxy busy" "machine busy" errors
for r in $(seq "$ROUNDS"); do
	declare -A RATE=() COST=()
	for proxy in uproxy haproxy nginx; do
		c0=$(cpu_ticks "${PID[$proxy]}")
		read -r b0 t0 < <(machine_ticks)
		out=$(in_ns wrk -t1 -c"$CONNECTIONS" -d"${SECONDS_PER_ROUND}s" -H "Connection: close" "http://127.0.0.1:${PORT[$proxy]}/")
		c1=$(cpu_ticks "${PID[$proxy]}")
		read -r b1 t1 < <(machine_ticks)
		n=$(awk '/requests in/{print $1}' <<<"$out")
		errors=$(awk '/Socket errors|Non-2xx/{sub(/^ +/, ""); printf "%s; ", $0}' <<<"$out")
		RATE[$proxy]=$(awk -v n="$n" -v d="$SECONDS_PER_ROUND" 'BEGIN{printf "%.0f", n/d}')
		COST[$proxy]=$(awk -v c=$((c1 - c0)) -v hz="$HZ" -v n="$n" 'BEGIN{printf "%.1f", c/hz/n*1e6}')
		awk -v r="$r" -v p=$proxy -v rate="${RATE[$proxy]}" -v cost="${COST[$proxy]}" -v c=$((c1 - c0)) -v hz="$HZ" \
			-v d="$SECONDS_PER_ROUND" -v b=$((b1 - b0)) -v t=$((t1 - t0)) -v cpus="$CPUS" -v e="${errors:-none}" \
			'BEGIN{printf "%-6s %-8s %8d %14.1f %11.2f %13.2f %s\n", r, p, rate, cost, c/hz/d, cpus*b/t, e}'
	done
	awk -v ur="${RATE[uproxy]}" -v uc="${COST[uproxy]}" -v hr="${RATE[haproxy]}" -v hc="${COST[haproxy]}" \
		-v nr="${RATE[nginx]}" -v nc="${COST[nginx]}" -v r="$r" \
		'BEGIN{br = hr > nr ? hr : nr; bc = hc < nc ? hc : nc
		printf "%-6s uproxy ÷ better peer: conn/s %.2f, CPU per connection %.2f\n", r, ur/br, uc/bc}'
done
