#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler from the Go module k8s.io/kubernetes and caches
# them under ~/.cache/kinetic-prefect/kube/<version>/ (≈ 20 min and 2.5 GB RAM on 2 cores, once per machine).
# Prints the folder holding the binaries.  Nothing here is needed to use kinetic-prefect: only the control-plane tests.
#
# Why a throwaway module: k8s.io/kubernetes' go.mod replaces its k8s.io/<staging> modules with local folders, so
# `go install pkg@version` refuses it.  We require it and replace each staging module with its published v0.Y.Z.
set -euo pipefail
VERSION="${KINETIC_KUBE_VERSION:-v1.36.3}"
CACHE="${KINETIC_KUBE_CACHE:-$HOME/.cache/kinetic-prefect/kube}/$VERSION"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler)

have_all() { for b in "${BINARIES[@]}"; do [ -x "$CACHE/$b" ] || return 1; done; }
if have_all; then echo "$CACHE"; exit 0; fi

# Go 1.27 turns on jsonv2, which breaks the apiserver's /openapi/v2: keep it off whatever Go builds this.
export GOEXPERIMENT="${GOEXPERIMENT:-nojsonv2}"
export GOFLAGS="-mod=mod"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
modfile="$(go mod download -json "k8s.io/kubernetes@$VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
staging_version="v0.${VERSION#v1.}"
{
  echo "module kinetic-kube-build"
  echo
  grep -E '^go ' "$modfile"
  echo
  echo "require k8s.io/kubernetes $VERSION"
  echo
  grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging' "$modfile" | awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
} > go.mod
go mod download k8s.io/kubernetes >&2
mkdir -p "$CACHE.partial"
for b in "${BINARIES[@]}"; do
  echo "building $b $VERSION" >&2
  go build -trimpath -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$VERSION" \
    -o "$CACHE.partial/$b" "k8s.io/kubernetes/cmd/$b" >&2
done
rm -rf "$CACHE" && mv "$CACHE.partial" "$CACHE"
echo "$CACHE"
