#!/usr/bin/env bash
# Builds the kube-apiserver and etcd binaries that test/testbed/kubeapi starts for tests, and
# the kube-proxy that integration tests run beside uproxy.
#
# Usage: hack/build-kube.sh [BINDIR [cluster]]   (BINDIR defaults to bin/ at the repository root;
# "cluster" also builds what the conformance cluster runs)
#
# Versions are pinned by the modules tools/kube-apiserver (k8s.io/kubernetes: every
# Kubernetes binary and the e2e suite are its tools), tools/etcd and tools/coredns (go.mod
# and go.sum are committed), so every machine builds the same sources. A binary is kept
# while the stamp file beside it (.NAME.stamp) names the same go.mod, go.sum, package and
# flags; delete it to force a rebuild. Each binary is written to a temporary name and
# renamed when complete, so an interrupted build never leaves a truncated binary that a
# later run would take for a finished one.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bindir="${1:-$root/bin}"
mkdir -p "$bindir"
bindir="$(cd "$bindir" && pwd)"

# A go.work elsewhere on the machine must not pull the tool modules into a workspace.
export GOWORK=off

log() { printf 'build-kube: %s\n' "$*"; }

# build NAME MODULE_DIR PACKAGE [EXTRA_LDFLAGS]
# An existing binary is kept when the stamp beside it names the same module file, package
# and flags, that is when a rebuild would compile the same sources the same way.
# PACKAGE may be "test:PKG", which compiles PKG's tests into one binary (go test -c).
build() {
	local name="$1" moddir="$2" pkg="$3" extra="${4:-}"
	local out="$bindir/$name" stamp="$bindir/.$name.stamp" want
	want="$(cat "$root/$moddir/go.mod" "$root/$moddir/go.sum" | sha256sum | cut -c1-16) $pkg $extra"
	if [[ -x "$out" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
		log "$name is up to date at $out"
		return 0
	fi
	log "building $name from $pkg (module $moddir) into $out"
	local start=$SECONDS
	if [[ "$pkg" == test:* ]]; then
		go -C "$root/$moddir" test -c -trimpath -ldflags="-s -w $extra" -o "$out.tmp" "${pkg#test:}"
	else
		go -C "$root/$moddir" build -trimpath -ldflags="-s -w $extra" -o "$out.tmp" "$pkg"
	fi
	mv -f "$out.tmp" "$out"
	printf '%s\n' "$want" >"$stamp"
	log "built $name in $((SECONDS - start))s, $(du -h "$out" | cut -f1)"
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
build kube-apiserver tools/kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$kube_ldflags"
build kube-proxy tools/kube-apiserver k8s.io/kubernetes/cmd/kube-proxy "$kube_ldflags"
if [[ "${2:-}" == cluster ]]; then
	# The conformance cluster's nodes and control plane, its DNS, the image its test pods
	# run, and the suite that judges it (test/conformance/ and `make conformance`).
	for cmd in kubelet kube-controller-manager kube-scheduler kubectl; do
		build "$cmd" tools/kube-apiserver "k8s.io/kubernetes/cmd/$cmd" "$kube_ldflags"
	done
	build agnhost tools/kube-apiserver k8s.io/kubernetes/test/images/agnhost
	build regression-issue-74839 tools/kube-apiserver k8s.io/kubernetes/test/images/regression-issue-74839
	build ginkgo tools/kube-apiserver github.com/onsi/ginkgo/v2/ginkgo
	build e2e-network.test tools/kube-apiserver test:./e2enetwork "$kube_ldflags"
	build coredns tools/coredns .
fi
log "done: binaries in $bindir"
