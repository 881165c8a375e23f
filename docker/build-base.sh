#!/usr/bin/env bash
# Build a local Debian base image for docker/Dockerfile without an image registry:
# debootstrap a minimal bookworm root filesystem from Debian's package mirror, then `docker import` it.
#   sudo docker/build-base.sh [IMAGE [MIRROR]]   (defaults: mapl-swarm-base:bookworm, http://deb.debian.org/debian)
# Then build with:  docker build -f docker/Dockerfile --build-arg BASE=mapl-swarm-base:bookworm .
# Needs root, debootstrap and a running Docker engine. The image has python3.11, venv, pip and CA certificates
# (Debian's and this host's local ones).
set -euo pipefail
IMAGE="${1:-mapl-swarm-base:bookworm}"
MIRROR="${2:-http://deb.debian.org/debian}"
command -v debootstrap >/dev/null || { echo "build-base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }
docker info >/dev/null 2>&1 || { echo "build-base.sh: no Docker engine answers (start dockerd)" >&2; exit 2; }
ROOTFS="$(mktemp -d /tmp/mapl-base.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
started=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR" >/dev/null
# This host's own trust anchors (a TLS-inspecting proxy's CA, say) go into the image's store, so pip
# in the build trusts what pip on this host trusts.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >/dev/null 2>&1
fi
# A Debian base, as python:3.11-slim: no apt lists or caches in the image.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin
tar -C "$ROOTFS" -c . | docker import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' - "$IMAGE" >/dev/null
echo "build-base.sh: built $IMAGE in $(( $(date +%s) - started )) s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
