#!/usr/bin/env bash
# Builds the Kueue manager (sigs.k8s.io/kueue/cmd/kueue) from the Go module proxy and caches it, with the manifests
# the tests install from the same module source, under ~/.cache/kinetic-prefect/kueue/<version>/:
#   kueue                   the manager, static (CGO off): tests/kueue_fixture.py runs it in a container
#   crds/*.yaml             config/components/crd/bases: the CustomResourceDefinitions
#   crd-conversion.yaml     the conversion patches config/components/crd/kustomization.yaml applies
#                           (patches/webhook_in_*.yaml): which CRDs convert between versions through the webhook
#   webhooks.yaml           config/components/webhook/manifests.yaml: the (mutating, validating) webhook configurations
# Prints the folder.  Nothing here is needed to use kinetic-prefect: only the Kueue tests of the control plane.
#
# Kueue's go.mod has no replace directives, so `go install pkg@version` builds it as published.
set -euo pipefail
VERSION="${KINETIC_KUEUE_VERSION:-v0.17.0}"
CACHE="${KINETIC_KUEUE_CACHE:-$HOME/.cache/kinetic-prefect/kueue}/$VERSION"

if [ -x "$CACHE/kueue" ] && [ -f "$CACHE/webhooks.yaml" ]; then echo "$CACHE"; exit 0; fi

source_dir="$(go mod download -json "sigs.k8s.io/kueue@$VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
rm -rf "$CACHE.partial" && mkdir -p "$CACHE.partial/crds"
echo "building kueue $VERSION" >&2
GOBIN="$CACHE.partial" CGO_ENABLED=0 GOFLAGS="-mod=mod" go install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$VERSION" "sigs.k8s.io/kueue/cmd/kueue@$VERSION" >&2
cp "$source_dir"/config/components/crd/bases/*.yaml "$CACHE.partial/crds/"
crd_dir="$source_dir/config/components/crd"
for patch in $(grep -oE '^- path: patches/webhook_in_[a-z]+\.yaml' "$crd_dir/kustomization.yaml" | cut -d' ' -f3); do
  echo "---"; cat "$crd_dir/$patch"
done > "$CACHE.partial/crd-conversion.yaml"
cp "$source_dir/config/components/webhook/manifests.yaml" "$CACHE.partial/webhooks.yaml"
chmod -R u+w "$CACHE.partial"  # the module cache's files are read-only
rm -rf "$CACHE" && mv "$CACHE.partial" "$CACHE"
echo "$CACHE"
