#!/bin/sh
# Builds a stand-in base image from Debian's packages, for a machine that reaches no registry (Docker Hub) but
# does reach a Debian mirror: a minimal bookworm (debootstrap --variant=minbase) with python3 (3.11), its venv
# module, redis-server and redis-cli (7.0), imported as one layer. Needs root and debootstrap
# (apt-get install debootstrap). The Dockerfile's default BASE, python:3.11-slim, is what users with a registry get.
#
#   docker/base-image.sh [TAG]        (default cfemu-debian:bookworm; kept when it exists)
set -eu
TAG=${1:-cfemu-debian:bookworm}
DOCKER=${DOCKER:-docker}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if "$DOCKER" image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG exists"
    exit 0
fi
ROOTFS=$(mktemp -d /var/tmp/cfemu-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT INT TERM
debootstrap --variant=minbase --include=python3,python3-venv,redis-server bookworm "$ROOTFS" "$MIRROR"
# What a container does not need: package caches and lists, documentation, locales other than C.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
    "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/*
tar --numeric-owner -C "$ROOTFS" -c . \
    | "$DOCKER" import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' \
        -m "debootstrap bookworm minbase + python3 python3-venv redis-server ($MIRROR)" - "$TAG"
echo "built base image $TAG"
