# uproxy — build, run the demo, test everything.
GO       ?= go
BIN      := bin
UPROXY   := $(BIN)/uproxy
STATICCHECK := $(BIN)/staticcheck
# The version uproxy reports: git describe (a tag, else the commit, -dirty with
# uncommitted changes), or dev outside a git checkout. The binary is stripped
# (-s -w) and holds no local paths (-trimpath), as the image's.
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS  := -s -w -X github.com/uproxy/uproxy/app.version=$(VERSION)
PKGS     := ./...
# Integration tests need root, network namespaces, iptables and a kube-apiserver.
TESTFLAGS ?= -race -count=1 -timeout 10m

.PHONY: all build run demo demo-retry test unit lint deps kube-bins cluster-bins conformance conformance-down bench bench-deps perf-doc microbench soak clean

all: build

build:
	$(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(UPROXY) .

# The proxy on an embedded demo: backends on loopback, no root needed.
run: build
	$(UPROXY) demo

demo: run

# Everything, integration included. Installs what the tests need first. The
# conformance cluster runs here in its short form (one node, the userspace mode,
# `[sig-network] Services`); `make conformance` is the whole matrix.
test: deps cluster-bins lint
	$(GO) test $(TESTFLAGS) -skip '^TestConformance$$' $(PKGS)
	@echo "conformance (short form): log in conformance-ci.log"; rc=0; \
	$(GO) test -count=1 -timeout 45m -v ./test/conformance -run '^TestConformance$$' > conformance-ci.log 2>&1 || rc=$$?; \
	grep -E '(^(---|ok|FAIL|PASS)|passed, .* failed|up in|images built|^\| )' conformance-ci.log; \
	if [ $$rc != 0 ]; then tail -n 150 conformance-ci.log; fi; exit $$rc

# The conformance cluster: three nodes, upstream's network suites, kube-proxy in both
# kernel modes and uproxy in all four; the table goes to docs/conformance-table.md.
CONFORMANCE_NODES   ?= 3
CONFORMANCE_PROXIES ?= kube-proxy-iptables,kube-proxy-nftables,uproxy-userspace-nftables,uproxy-userspace-iptables,uproxy-nftables,uproxy-iptables
CONFORMANCE_SUITES  ?= all
CONFORMANCE_PROCS   ?= 6
conformance: deps cluster-bins
	$(GO) test -count=1 -timeout 0 -v ./test/conformance -run '^TestConformance$$' \
		-conformance.nodes=$(CONFORMANCE_NODES) -conformance.proxies=$(CONFORMANCE_PROXIES) \
		-conformance.suites='$(CONFORMANCE_SUITES)' -conformance.procs=$(CONFORMANCE_PROCS) \
		-conformance.report=$(CURDIR)/docs/conformance-table.md

# Removes a cluster left by -conformance.keep or an interrupted run.
conformance-down:
	$(GO) test -count=1 -v ./test/conformance -run '^TestConformance$$' -conformance.down

unit:
	$(GO) test -count=1 -short $(PKGS)

# go vet, gofmt and staticcheck (pinned by tools/staticcheck, built into bin/).
lint: $(STATICCHECK)
	$(GO) vet $(PKGS)
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(STATICCHECK) $(PKGS)

$(STATICCHECK): tools/staticcheck/go.mod tools/staticcheck/go.sum
	$(GO) -C tools/staticcheck build -o $(CURDIR)/$(STATICCHECK) honnef.co/go/tools/cmd/staticcheck

# iptables, nftables, iproute2 and conntrack for the integration tests, containerd, runc, the
# CNI plugins and debootstrap for the conformance cluster (idempotent; root only).
deps:
	@missing=""; \
	for c in iptables:iptables nft:nftables ip:iproute2 conntrack:conntrack chromium:chromium \
		containerd:containerd runc:runc /usr/lib/cni/ptp:containernetworking-plugins debootstrap:debootstrap; do \
		command -v $${c%%:*} >/dev/null 2>&1 || missing="$$missing $${c#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "need root to install:$$missing"; exit 1; fi; \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# kube-apiserver and etcd for the Kubernetes source tests, and kube-proxy to run beside uproxy,
# built from pinned modules (cached in bin/).
kube-bins:
	bash hack/build-kube.sh $(BIN)

# kube-bins and what the conformance cluster runs: kubelet, the controller manager and
# scheduler, kubectl, CoreDNS, the test images' binaries, ginkgo and the network suite.
cluster-bins:
	bash hack/build-kube.sh $(BIN) cluster

# Retry semantics side by side: userspace vs iptables mode while backends fail (root).
demo-retry: build
	bash hack/demo-retry.sh $(UPROXY)

# HAProxy and nginx with its stream module, the peers of `uproxy bench` (root; Debian packages).
bench-deps:
	@missing=""; \
	command -v haproxy >/dev/null 2>&1 || missing="$$missing haproxy"; \
	command -v nginx >/dev/null 2>&1 || missing="$$missing nginx"; \
	[ -e /usr/lib/nginx/modules/ngx_stream_module.so ] || missing="$$missing libnginx-mod-stream"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "need root to install:$$missing"; exit 1; fi; \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# A/B benchmark of every path (root): table on stdout, latency chart in bench.svg.
# BENCHFLAGS=--quick: under 2 minutes.
BENCHFLAGS ?=
bench: build deps bench-deps
	$(UPROXY) bench $(BENCHFLAGS) --chart bench.svg

# docs/performance.md from one bench run (root): the JSON stays in bench.json, and
# `bin/uproxy bench report bench.json > docs/performance.md` renders it again.
PERFFLAGS ?= --duration 2s --rounds 3 --idle-connections 8000 --sync-sizes 1000,10000
perf-doc: build deps bench-deps
	$(UPROXY) bench $(PERFFLAGS) -o json > bench.json
	$(UPROXY) bench report bench.json > docs/performance.md

# Mixed TCP/UDP load with checksums while endpoints churn, backends die and the rules are flushed (root).
SOAK ?= 60s
soak: deps
	$(GO) test -count=1 -timeout 20m -run '^TestSoak$$' -v ./test/soak -soak.duration=$(SOAK)

# Go microbenchmarks of the packages.
microbench: build
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

clean:
	rm -f $(UPROXY)
