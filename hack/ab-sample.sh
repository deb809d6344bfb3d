#!/usr/bin/env bash
# ab-sample: the README's `uproxy ab` sample. Three network namespaces (node, pod,
# ext), three `uproxy echo` backends on ext, and in the node namespace two uproxy
# processes over the same backends: the iptables kernel mode (DNAT, the path
# kube-proxy's iptables mode programs) for 10.96.0.10:80, the userspace mode with
# iptables portals for 10.96.0.11:80. Then `uproxy ab` from the pod namespace, with
# the arguments given (default: 10.96.0.10:80 10.96.0.11:80). Removes everything it
# made on exit. Needs root. Usage: hack/ab-sample.sh [path/to/uproxy] [-- ab args]
set -euo pipefail

UPROXY=$(realpath "${1:-bin/uproxy}")
shift || true
[ "${1:-}" = -- ] && shift
[ $# -gt 0 ] || set -- 10.96.0.10:80 10.96.0.11:80
P=uab$$                      # namespace prefix: uab<pid>-node, -pod, -ext
DIR=$(mktemp -d)
PIDS=()

[ "$(id -u)" = 0 ] || { echo "ab-sample: needs root (network namespaces, iptables)" >&2; exit 1; }
[ -x "$UPROXY" ] || { echo "ab-sample: no uproxy binary at $UPROXY (make build)" >&2; exit 1; }

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  for r in node pod ext; do ip netns del "$P-$r" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT

# inns ROLE CMD...: CMD in that namespace. Background jobs call ip directly, so
# that $! is the process itself (ip netns exec execs CMD), not a subshell.
inns() { local r=$1; shift; ip netns exec "$P-$r" "$@"; }
for r in node pod ext; do ip netns add "$P-$r"; ip -n "$P-$r" link set lo up; done
ip link add vpod netns "$P-node" type veth peer name eth0 netns "$P-pod"
ip link add vext netns "$P-node" type veth peer name eth0 netns "$P-ext"
ip -n "$P-node" addr add 10.244.1.1/24 dev vpod
ip -n "$P-node" addr add 192.168.50.1/24 dev vext
ip -n "$P-node" link set vpod up
ip -n "$P-node" link set vext up
ip -n "$P-node" route add default via 192.168.50.2
inns node sysctl -qw net.ipv4.ip_forward=1
ip -n "$P-pod" addr add 10.244.1.2/24 dev eth0
ip -n "$P-pod" link set eth0 up
ip -n "$P-pod" route add default via 10.244.1.1
ip -n "$P-ext" addr add 192.168.50.2/24 dev eth0
ip -n "$P-ext" link set eth0 up
ip -n "$P-ext" route add 10.244.1.0/24 via 192.168.50.1

for port in 8081 8082 8083; do
  ip netns exec "$P-ext" "$UPROXY" echo "192.168.50.2:$port" 2>/dev/null &
  PIDS+=($!)
done

# service NAME CLUSTER_IP: a Service over the three backends.
service() {
  printf 'apiVersion: v1\nkind: Service\nmetadata: {name: %s, namespace: default}\n' "$1"
  printf 'spec:\n  clusterIP: %s\n  ports: [{name: p, protocol: TCP, port: 80}]\n' "$2"
  for port in 8081 8082 8083; do
    printf -- '---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n'
    printf 'metadata: {name: %s-%s, namespace: default, labels: {kubernetes.io/service-name: %s}}\n' "$1" "$port" "$1"
    printf 'addressType: IPv4\nports: [{name: p, protocol: TCP, port: %s}]\n' "$port"
    printf 'endpoints: [{addresses: ["192.168.50.2"], conditions: {ready: true}}]\n'
  done
}
mkdir "$DIR/dnat" "$DIR/userspace"
service echo-dnat 10.96.0.10 > "$DIR/dnat/services.yaml"
service echo-userspace 10.96.0.11 > "$DIR/userspace/services.yaml"

ip netns exec "$P-node" "$UPROXY" --proxy-mode iptables --chain-prefix ABDNAT --services "$DIR/dnat" \
  --metrics-bind-address 127.0.0.1:10249 --healthz-bind-address "" > "$DIR/dnat.log" 2>&1 &
PIDS+=($!)
ip netns exec "$P-node" "$UPROXY" --proxy-mode userspace --rules iptables --services "$DIR/userspace" \
  --metrics-bind-address 127.0.0.1:10259 --healthz-bind-address "" > "$DIR/userspace.log" 2>&1 &
PIDS+=($!)

# Both Services answer before the measurement starts.
for vip in 10.96.0.10 10.96.0.11; do
  for i in $(seq 100); do
    if inns pod "$UPROXY" ab "$vip:80" "$vip:80" --connections 1 --max-errors 1 >/dev/null 2>&1; then break; fi
    [ "$i" = 100 ] && { echo "ab-sample: $vip:80 never answered; logs:" >&2; tail -5 "$DIR"/*.log >&2; exit 1; }
    sleep 0.1
  done
done

inns pod "$UPROXY" ab "$@"
