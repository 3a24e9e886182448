#!/usr/bin/env bash
# Build the agentrl base sandbox image without any registry:
# debootstrap a minimal Debian with python3, then `docker import` it.
# Usage: build.sh IMAGE_TAG   (skips the work if the tag already exists)
set -euo pipefail
tag=${1:-agentrl/base:bookworm}
if docker image inspect "$tag" >/dev/null 2>&1; then
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
debootstrap --variant=minbase --include=python3-minimal bookworm "$root" "$mirror" \
  | awk '/^I: (Retrieving|Validating|Extracting|Unpacking|Configuring|Base system)/ { if (++n % 25 == 1 || /Base system/) print "[sandbox]   " $0; fflush() }'
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
echo "[sandbox] importing as $tag"
tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "[sandbox] built $tag"
