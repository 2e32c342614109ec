#!/usr/bin/env bash
# Make lmforge's Debian base image locally, with no container registry: Debian bookworm (minbase) with python3.11
# in a virtual environment at /opt/venv, first on PATH (Debian's Python is externally managed, PEP 668).
# The Dockerfiles take it as BASE_IMAGE in place of the public python:3.11-slim base where no registry is in reach:
#   make base-image && make images BASE_IMAGE=localhost/lmforge-base:bookworm ENGINE=podman
# Usage: images/base/build.sh [IMAGE]   (ENGINE=podman|docker, DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR; needs root
# and mmdebstrap). The Python is Debian's CPython 3.11 with Debian's security fixes.
set -euo pipefail
image=${1:-localhost/lmforge-base:bookworm}
engine=${ENGINE:-podman}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mmdebstrap --variant=minbase --mode=root --include=python3.11,python3-venv,ca-certificates,passwd \
  --dpkgopt=force-unsafe-io \
  --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  bookworm "$work/rootfs.tar" \
  "deb $mirror bookworm main" "deb $mirror bookworm-updates main" "deb $security bookworm-security main"
"$engine" import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python"]' \
  "$work/rootfs.tar" "$image"
