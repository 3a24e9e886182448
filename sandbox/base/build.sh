#!/usr/bin/env bash
# Build the agentrl base sandbox image without any registry:
# debootstrap a minimal Debian with python3 (full standard library: tools expect json, http, ...),
# then `docker import` it.
# Usage: build.sh IMAGE_TAG  (AGENTRL_SANDBOX_PACKAGES: the packages, for images built on this recipe)
# Idempotent: skips the work when the tag exists and carries this recipe's hash
# (label agentrl.recipe), so editing this script rebuilds the image.
set -euo pipefail
tag=${1:-agentrl/base:bookworm}
packages=${AGENTRL_SANDBOX_PACKAGES:-python3-minimal,python3}
recipe=$( (cat "$0"; echo "$packages") | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{index .Config.Labels "agentrl.recipe"}}' "$tag" 2>/dev/null || true)" = "$recipe" ]; then
  echo "[sandbox] $tag is up to date"; exit 0
fi
mirror=${AGENTRL_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(grep -hoE '^URIs: *http[^ ]*debian/?$|^deb +http[^ ]*debian/? ' /etc/apt/sources.list.d/* /etc/apt/sources.list 2>/dev/null \
    | head -n1 | sed -E 's/^URIs: *//; s/^deb +//; s/ *$//' || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}
root=$(mktemp -d /tmp/agentrl-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "[sandbox] debootstrap bookworm from $mirror (about 30-60 s)"
debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" \
  | awk '/^I: (Retrieving|Validating|Extracting|Unpacking|Configuring|Base system)/ { if (++n % 25 == 1 || /Base system/) print "[sandbox]   " $0; fflush() }'
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
echo "[sandbox] importing as $tag"
tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' -c "LABEL agentrl.recipe=$recipe" - "$tag" >/dev/null
echo "[sandbox] built $tag"
