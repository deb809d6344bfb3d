# uproxy — build, run the demo, test everything.
GO       ?= go
BIN      := bin
UPROXY   := $(BIN)/uproxy
PKGS     := ./...
# Integration tests need root, network namespaces, iptables and a kube-apiserver.
TESTFLAGS ?= -race -count=1 -timeout 10m

.PHONY: all build run demo demo-retry test unit lint deps kube-bins bench bench-deps microbench soak clean

all: build

build:
	$(GO) build -o $(UPROXY) .

# The proxy on an embedded demo: backends on loopback, no root needed.
run: build
	$(UPROXY) demo

demo: run

# Everything, integration included. Installs what the tests need first.
test: deps kube-bins lint
	$(GO) test $(TESTFLAGS) $(PKGS)

unit:
	$(GO) test -count=1 -short $(PKGS)

lint:
	$(GO) vet $(PKGS)
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# iptables, nftables, iproute2 and conntrack for the integration tests (idempotent; root only).
deps:
	@missing=""; \
	for c in iptables:iptables nft:nftables ip:iproute2 conntrack:conntrack chromium:chromium; do \
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

# Mixed TCP/UDP load with checksums while endpoints churn, backends die and the rules are flushed (root).
SOAK ?= 60s
soak: deps
	$(GO) test -count=1 -timeout 20m -run '^TestSoak$$' -v ./soak -soak.duration=$(SOAK)

# Go microbenchmarks of the packages.
microbench: build
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

clean:
	rm -f $(UPROXY)
