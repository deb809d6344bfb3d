#!/usr/bin/env bash
# demo-retry: the same client load through uproxy's userspace mode and through the
# iptables kernel mode while one backend is killed and another blackholed, printed
# side by side with what uproxy's events show; then the three retry strategies
# (sequential, hedged, budget) side by side on the same faults (refused,
# blackholed, slow accept). Needs root (network namespaces, iptables).
# Usage: hack/demo-retry.sh [path/to/uproxy]   (make demo-retry)
# PARTS=modes or PARTS=strategies runs one part only.
set -euo pipefail

UPROXY=$(realpath "${1:-bin/uproxy}")
CONNS=${CONNS:-400}          # connections per mode
INTERVAL=${INTERVAL:-10ms}   # one new connection every INTERVAL
CLIENT_TIMEOUT=${CLIENT_TIMEOUT:-3s}
VIP=10.96.100.10
METRICS=127.0.0.1:10249
P=urd                        # namespace prefix: urd-client, urd-node, urd-be
PARTS=${PARTS:-modes strategies}
STRATEGY_CONNS=${STRATEGY_CONNS:-200} # connections per fault and strategy

[ "$(id -u)" = 0 ] || { echo "demo-retry: needs root (network namespaces, iptables)" >&2; exit 1; }
for c in ip iptables go; do
	command -v "$c" >/dev/null || { echo "demo-retry: $c not found (make deps)" >&2; exit 1; }
done
[ -x "$UPROXY" ] || { echo "demo-retry: no uproxy binary at $UPROXY (make build)" >&2; exit 1; }

WORK=$(mktemp -d /tmp/demo-retry.XXXXXX)
PIDS=()
cleanup() {
	for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
	wait 2>/dev/null || true
	for ns in client node be; do ip netns del "$P-$ns" 2>/dev/null || true; done
	rm -rf "$WORK"
}
trap cleanup EXIT

# The helper: backends, the client load and the events summary, in plain Go.
mkdir -p "$WORK/tool"
cat >"$WORK/tool/main.go" <<'EOF'
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

func main() {
	switch os.Args[1] {
	case "serve": // serve ADDR NAME: answer every connection with NAME and close
		ln, err := net.Listen("tcp", os.Args[2])
		check(err)
		for {
			c, err := ln.Accept()
			check(err)
			fmt.Fprintf(c, "%s\n", os.Args[3])
			c.Close()
		}
	case "serve-slow": // serve-slow ADDR NAME EVERY: accept one connection per EVERY, backlog 1
		// An overloaded backend: its accept queue holds one connection, and
		// the kernel drops the SYNs that arrive while it is full.
		ln := listenBacklog(os.Args[2], 1)
		every := dur(os.Args[4])
		for {
			c, err := ln.Accept()
			check(err)
			fmt.Fprintf(c, "%s\n", os.Args[3])
			c.Close()
			time.Sleep(every)
		}
	case "dials": // dials METRICS-ADDR SERVICE: dial attempts and budget refusals of one Service port
		dials(os.Args[2], os.Args[3])
	case "load": // load TARGET N INTERVAL TIMEOUT
		load(os.Args[2], atoi(os.Args[3]), dur(os.Args[4]), dur(os.Args[5]))
	case "wait": // wait URL: until it answers 200 with a proxied Service
		for i := 0; i < 300; i++ {
			if resp, err := http.Get(os.Args[2]); err == nil {
				resp.Body.Close()
				if resp.StatusCode == 200 {
					return
				}
			}
			time.Sleep(100 * time.Millisecond)
		}
		check(errors.New("uproxy did not come up"))
	case "events": // events METRICS-ADDR: outcome counts and a sample retried connection
		events(os.Args[2])
	}
}

func load(target string, n int, every, timeout time.Duration) {
	type result struct {
		kind string
		took time.Duration
	}
	results := make([]result, n)
	var wg sync.WaitGroup
	tick := time.NewTicker(every)
	for i := 0; i < n; i++ {
		<-tick.C
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			start := time.Now()
			kind := "ok"
			c, err := net.DialTimeout("tcp", target, timeout)
			if err == nil {
				c.SetDeadline(start.Add(timeout))
				_, err = bufio.NewReader(c).ReadString('\n')
				c.Close()
			}
			switch {
			case err == nil:
			case errors.Is(err, syscall.ECONNREFUSED):
				kind = "refused"
			case errors.Is(err, syscall.ECONNRESET):
				kind = "reset"
			case isTimeout(err):
				kind = "timeout"
			default:
				kind = "other"
			}
			results[i] = result{kind, time.Since(start)}
		}(i)
	}
	wg.Wait()
	count := map[string]int{}
	var ok []time.Duration
	for _, r := range results {
		count[r.kind]++
		if r.kind == "ok" {
			ok = append(ok, r.took)
		}
	}
	sort.Slice(ok, func(i, j int) bool { return ok[i] < ok[j] })
	q := func(f float64) string {
		if len(ok) == 0 {
			return "-"
		}
		return ok[int(f*float64(len(ok)-1))].Round(100 * time.Microsecond).String()
	}
	fmt.Printf("connections=%d ok=%d failed=%d refused=%d reset=%d timeout=%d other=%d p50=%s p99=%s max=%s\n",
		n, count["ok"], n-count["ok"], count["refused"], count["reset"], count["timeout"], count["other"], q(0.5), q(0.99), q(1))
}

func events(addr string) {
	// Counts come from /metrics (every connection); the event ring holds only
	// the most recent ones (--events), so it gives the samples.
	resp, err := http.Get("http://" + addr + "/metrics")
	check(err)
	count := map[string]float64{}
	sent := map[string]float64{} // dials (userspace) or DNATs (iptables) per backend
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		name, rest, _ := strings.Cut(line, "{")
		labels, val, _ := strings.Cut(rest, "} ")
		v, _ := strconv.ParseFloat(val, 64)
		switch name {
		case "uproxy_connections_total":
			for _, r := range []string{"success", "retried", "failed"} {
				if strings.Contains(labels, `result="`+r+`"`) {
					count[r] += v
				}
			}
		case "uproxy_dial_attempts_total":
			if _, ep, ok := strings.Cut(labels, `endpoint="`); ok {
				ep, _, _ = strings.Cut(ep, `"`)
				sent[ep] += v
			}
		case "uproxy_endpoint_ejections_total":
			count["ejection"] += v
		case "uproxy_retries_total":
			count["retries"] += v
		}
	}
	resp.Body.Close()
	fmt.Printf("events success=%.0f retried=%.0f failed=%.0f ejection=%.0f retries=%.0f\n",
		count["success"], count["retried"], count["failed"], count["ejection"], count["retries"])

	// A kernel mode dials nothing: its DNAT rule counters, in /debug/services,
	// count the connections the kernel sent to each backend.
	if len(sent) == 0 {
		var svcs struct {
			Services []struct {
				Endpoints []struct {
					Address string
					Packets float64
				}
			}
		}
		resp, err = http.Get("http://" + addr + "/debug/services")
		check(err)
		check(json.NewDecoder(resp.Body).Decode(&svcs))
		resp.Body.Close()
		for _, s := range svcs.Services {
			for _, e := range s.Endpoints {
				sent[e.Address] += e.Packets
			}
		}
	}
	fmt.Print("sent")
	for ep, n := range sent {
		host, _, _ := strings.Cut(ep, ":")
		fmt.Printf(" to%s=%.0f", host[strings.LastIndexByte(host, '.')+1:], n)
	}
	fmt.Println()

	var body struct {
		Events []struct {
			Kind, Outcome, Client, Endpoint, Reason, Duration string
			Attempts                                          []struct{ Endpoint, Result, Duration string }
		}
	}
	resp, err = http.Get("http://" + addr + "/debug/events?limit=100000")
	check(err)
	check(json.NewDecoder(resp.Body).Decode(&body))
	sample := -1
	for i, ev := range body.Events {
		if ev.Kind == "connection" && ev.Outcome == "retried" && sample < 0 {
			sample = i
		}
	}
	for _, ev := range body.Events {
		if ev.Kind == "ejection" {
			fmt.Printf("sample-ejection %s: %s\n", ev.Endpoint, ev.Reason)
			break
		}
	}
	if sample >= 0 {
		ev := body.Events[sample]
		fmt.Printf("sample-retried from %s:", ev.Client)
		for _, a := range ev.Attempts {
			fmt.Printf(" %s %s (%s);", a.Endpoint, a.Result, a.Duration)
		}
		fmt.Printf(" total %s\n", ev.Duration)
	}
}

// listenBacklog listens on addr (IPv4) with the given accept queue length.
func listenBacklog(addr string, backlog int) net.Listener {
	ap, err := net.ResolveTCPAddr("tcp4", addr)
	check(err)
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	check(err)
	check(syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1))
	sa := &syscall.SockaddrInet4{Port: ap.Port}
	copy(sa.Addr[:], ap.IP.To4())
	check(syscall.Bind(fd, sa))
	check(syscall.Listen(fd, backlog))
	ln, err := net.FileListener(os.NewFile(uintptr(fd), "listener"))
	check(err)
	return ln
}

func dials(addr, service string) {
	resp, err := http.Get("http://" + addr + "/metrics")
	check(err)
	defer resp.Body.Close()
	var n, refused float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, rest, _ := strings.Cut(sc.Text(), "{")
		labels, val, _ := strings.Cut(rest, "} ")
		if !strings.Contains(labels, `service="`+service+`"`) {
			continue
		}
		v, _ := strconv.ParseFloat(val, 64)
		switch name {
		case "uproxy_dial_attempts_total":
			n += v
		case "uproxy_retry_budget_refusals_total":
			refused += v
		}
	}
	fmt.Printf("dials=%.0f budget-refusals=%.0f\n", n, refused)
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

func atoi(s string) int { n, err := strconv.Atoi(s); check(err); return n }

func dur(s string) time.Duration { d, err := time.ParseDuration(s); check(err); return d }

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo-retry tool:", err)
		os.Exit(1)
	}
}
EOF
(cd "$WORK/tool" && go mod init demoretry >/dev/null 2>&1 && go build -o "$WORK/t" .)
T="$WORK/t"

# service_yaml NAME VIP ANNOTATIONS: a Service over the three backends.
service_yaml() {
	cat <<EOF
---
apiVersion: v1
kind: Service
metadata: {name: $1, namespace: demo, annotations: $3}
spec:
  clusterIP: $2
  ports: [{name: http, protocol: TCP, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: $1-1
  namespace: demo
  labels: {kubernetes.io/service-name: $1}
addressType: IPv4
ports: [{name: http, protocol: TCP, port: 8080}]
endpoints:
- {addresses: ["10.99.2.11"], conditions: {ready: true}}
- {addresses: ["10.99.2.12"], conditions: {ready: true}}
- {addresses: ["10.99.2.13"], conditions: {ready: true}}
EOF
}
service_yaml web "$VIP" "{}" >"$WORK/services.yaml"

HELP=$("$UPROXY" --help 2>&1 || true)
has_flag() { grep -q -- "--$1" <<<"$HELP"; }
MODES=(userspace)
# The same userspace mode without outlier ejection shows what ejection saves.
has_flag eject-after && MODES+=(no-eject)
if has_flag proxy-mode; then MODES+=(iptables); else
	echo "note: this uproxy has no --proxy-mode yet: running the userspace mode only"
fi

# world builds client -- node -- backends, the node routing between them, and
# starts the backends named (by their last byte; default all three).
world() {
	for ns in client node be; do ip netns del "$P-$ns" 2>/dev/null || true; ip netns add "$P-$ns"; done
	for ns in client node be; do ip -n "$P-$ns" link set lo up; done
	ip link add "$P-c0" netns "$P-client" type veth peer name n1 netns "$P-node"
	ip link add "$P-b0" netns "$P-be" type veth peer name n2 netns "$P-node"
	ip -n "$P-client" addr add 10.99.1.2/24 dev "$P-c0"
	ip -n "$P-node" addr add 10.99.1.1/24 dev n1
	ip -n "$P-node" addr add 10.99.2.1/24 dev n2
	for i in 11 12 13; do ip -n "$P-be" addr add "10.99.2.$i/24" dev "$P-b0"; done
	ip -n "$P-client" link set "$P-c0" up
	ip -n "$P-be" link set "$P-b0" up
	ip -n "$P-node" link set n1 up
	ip -n "$P-node" link set n2 up
	ip -n "$P-client" route add default via 10.99.1.1
	ip -n "$P-be" route add default via 10.99.2.1
	ip netns exec "$P-node" sysctl -qw net.ipv4.ip_forward=1
	BACKEND=()
	for i in ${1:-11 12 13}; do
		ip netns exec "$P-be" "$T" serve "10.99.2.$i:8080" "backend-$i" &
		BACKEND[$i]=$!
		PIDS+=($!)
	done
}

declare -A RESULT EVENTS
run_mode() {
	local mode=$1
	world
	local args=(--services "$WORK/services.yaml" --rules iptables --metrics-bind-address "$METRICS"
		--healthz-bind-address "" --hostname-override node)
	local proxy_mode=$mode eject=3
	[ "$mode" = no-eject ] && proxy_mode=userspace eject=0
	has_flag proxy-mode && args+=(--proxy-mode "$proxy_mode")
	has_flag eject-after && args+=(--eject-after "$eject")
	ip netns exec "$P-node" "$UPROXY" "${args[@]}" >"$WORK/uproxy-$mode.log" 2>&1 &
	local up=$!
	PIDS+=($up)
	ip netns exec "$P-node" "$T" wait "http://$METRICS/healthz" || { cat "$WORK/uproxy-$mode.log"; exit 1; }
	sleep 1 # the first sync programs the rules

	ip netns exec "$P-client" "$T" load "$VIP:80" "$CONNS" "$INTERVAL" "$CLIENT_TIMEOUT" >"$WORK/load-$mode" &
	local load=$!
	sleep 1
	kill "${BACKEND[12]}"                                    # killed: connects are refused
	sleep 1
	ip netns exec "$P-be" iptables -A INPUT -d 10.99.2.13 -p tcp --dport 8080 -j DROP # blackholed
	wait "$load"
	RESULT[$mode]=$(cat "$WORK/load-$mode")
	EVENTS[$mode]=$(ip netns exec "$P-node" "$T" events "$METRICS" 2>/dev/null || echo "events unavailable")
	if [ "$mode" != no-eject ] && "$UPROXY" explain --help >/dev/null 2>&1; then
		ip netns exec "$P-node" "$UPROXY" explain "$VIP:80" --client 10.99.1.2 --metrics-address "$METRICS" --events 3 >"$WORK/explain-$mode" 2>&1 || true
	fi
	kill "$up"; wait "$up" 2>/dev/null || true
}

run_modes() {
	for m in "${MODES[@]}"; do
		desc=$m; [ "$m" = no-eject ] && desc="userspace with --eject-after 0"
		echo "== $desc: $CONNS connections, one per $INTERVAL; backend-12 killed at 1s, backend-13 blackholed at 2s"
		run_mode "$m"
	done

	echo
	printf "%-46s" ""; for m in "${MODES[@]}"; do printf "%14s" "$m"; done; echo
	row() { # LABEL KEY [events]
		printf "%-46s" "$1"
		local m src v
		for m in "${MODES[@]}"; do
			src=${RESULT[$m]}
			if [ "${3:-}" = sent ]; then
				src=${EVENTS[$m]}
			elif [ "${3:-}" = events ]; then
				# Kernel modes have no data path in uproxy, so no events to count.
				src=""
				[ "$m" = iptables ] || src=${EVENTS[$m]}
			fi
			v=$(field "$src" "$2")
			printf "%14s" "${v:--}"
		done
		echo
	}
	row "client connections" connections
	row "  answered" ok
	row "  failed" failed
	row "    refused (killed backend)" refused
	row "    reset" reset
	row "    timed out (blackholed backend)" timeout
	row "  p50 latency of answered" p50
	row "  p99 latency of answered" p99
	row "  slowest answered" max
	echo "tries per backend (uproxy's dials; the kernel's DNATs)"
	row "  backend-11 (alive)" to11 sent
	row "  backend-12 (killed)" to12 sent
	row "  backend-13 (blackholed)" to13 sent
	row "uproxy: served by the first dial" success events
	row "uproxy: retried, then served" retried events
	row "uproxy: failed (client reset)" failed events
	row "uproxy: dial attempts retried" retries events
	row "uproxy: endpoint ejections" ejection events
	echo
	grep -h "sample-" <<<"${EVENTS[userspace]}" | sed 's/^sample-retried/a retried connection, as \/debug\/events shows it:\n /; s/^sample-ejection/an ejection, as \/debug\/events shows it:\n /'
	for m in "${MODES[@]}"; do
		[ -s "$WORK/explain-$m" ] || continue
		echo
		echo "$m mode: uproxy explain $VIP:80 --client 10.99.1.2, right after the load:"
		sed 's/^/  /' "$WORK/explain-$m"
	done
}

# The retry strategies. One uproxy serves three Services over the same three
# backends, each with its own policy from annotations: sequential (the
# defaults), hedged (uproxy.io/dial-hedge: 30ms) and budget
# (uproxy.io/retry-budget: "20"). backend-13 is faulty for the whole run, one
# fault at a time: refused (not running), blackholed (SYNs dropped), slow accept
# (an accept queue of one, drained every 100ms: SYNs that find it full are
# dropped). Outlier ejection is off (--eject-after 0), so every connection meets
# the fault and the strategies alone differ.
strategy_services() {
	local i=0 ann
	for s in sequential hedged budget; do
		i=$((i + 1)); ann="{}"
		[ "$s" = hedged ] && ann='{uproxy.io/dial-hedge: "30ms"}'
		[ "$s" = budget ] && ann='{uproxy.io/retry-budget: "20"}'
		service_yaml "web-$s" "10.96.100.2$i" "$ann"
	done
}

run_strategies() {
	strategy_services >"$WORK/strategies.yaml"
	echo "== retry strategies: backend-13 of 3 faulty, $STRATEGY_CONNS connections per strategy, one per $INTERVAL, no ejection"
	printf "%-12s %-11s %7s %9s %9s %13s %9s\n" fault strategy failed p50 p99 "extra dials" refusals
	local fault s i load dl up
	for fault in ${FAULTS:-none refused blackholed slow-accept}; do
		case $fault in
		none) world ;;
		refused) world "11 12" ;; # nothing listens on backend-13's port
		blackholed)
			world
			ip netns exec "$P-be" iptables -A INPUT -d 10.99.2.13 -p tcp --dport 8080 -j DROP
			;;
		slow-accept)
			world "11 12"
			ip netns exec "$P-be" "$T" serve-slow 10.99.2.13:8080 backend-13 100ms &
			PIDS+=($!)
			;;
		esac
		ip netns exec "$P-node" "$UPROXY" --services "$WORK/strategies.yaml" --rules iptables --metrics-bind-address "$METRICS" \
			--healthz-bind-address "" --hostname-override node --eject-after 0 >"$WORK/uproxy-strategies-$fault.log" 2>&1 &
		up=$!
		PIDS+=($up)
		ip netns exec "$P-node" "$T" wait "http://$METRICS/healthz" || { cat "$WORK/uproxy-strategies-$fault.log"; exit 1; }
		sleep 1 # the first sync programs the rules
		i=0
		for s in sequential hedged budget; do
			i=$((i + 1))
			load=$(ip netns exec "$P-client" "$T" load "10.96.100.2$i:80" "$STRATEGY_CONNS" "$INTERVAL" "$CLIENT_TIMEOUT")
			dl=$(ip netns exec "$P-node" "$T" dials "$METRICS" "demo/web-$s:http")
			printf "%-12s %-11s %7s %9s %9s %13s %9s\n" "$fault" "$s" "$(field "$load" failed)" "$(field "$load" p50)" "$(field "$load" p99)" \
				"$(awk -v d="$(field "$dl" dials)" -v n="$STRATEGY_CONNS" 'BEGIN { printf "%.2f/conn", (d - n) / n }')" \
				"$(field "$dl" budget-refusals)"
		done
		kill "$up"; wait "$up" 2>/dev/null || true
	done
}

field() { grep -o "$2=[^ ]*" <<<"$1" | cut -d= -f2 || true; }
for part in $PARTS; do
	case $part in
	modes) run_modes ;;
	strategies) echo; run_strategies ;;
	esac
done
