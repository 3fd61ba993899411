#!/bin/sh
# Builds the images docker-compose.yml runs, for a machine that reaches no registry (Docker Hub) but reaches a
# Debian mirror and a Python package index from the host:
#   cfemu-debian:bookworm   the stand-in for python:3.11-slim (docker/base-image.sh; built once, kept)
#   cfemu:latest            FROM it: SQM servers, backup, restore (--target base)
#   cfemu-spark:latest      plus a JRE and PySpark (--target spark): the Spark master and worker, the tools service
# pip runs on the host (its index, its trust settings, its cache): it builds every wheel the images need into
# docker/wheels/, which a throwaway HTTP server on 127.0.0.1 serves to the builds (PIP_FIND_LINKS, PIP_NO_INDEX=1).
# The builds use the host's network (--network host; apt reaches the Debian mirror): a container on a daemon
# without NAT (dockerd --iptables=false) reaches nothing outside. Layers are cached: a second run takes seconds.
#
# Settings: DOCKER (the docker client), PYTHON (a Python 3.11 with pip, as the image's: default .venv/bin/python),
# SPARK_VERSION (default: 4.3.0, the pin of pyproject.toml's spark extra), CFEMU_COMPOSE_SPARK=0 (no Spark image).
set -eu
cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
PYTHON=${PYTHON:-.venv/bin/python}
BASE=${CFEMU_BASE_IMAGE:-cfemu-debian:bookworm}
SPARK_VERSION=${SPARK_VERSION:-4.3.0}
WHEELS=docker/wheels

DOCKER="$DOCKER" docker/base-image.sh "$BASE"

mkdir -p "$WHEELS"
# async-timeout: what redis needs on the image's Python (bookworm's 3.11.2) and not on a newer host Python.
"$PYTHON" -m pip wheel -q --disable-pip-version-check -w "$WHEELS" . "setuptools>=74.1" wheel "async-timeout>=4.0.3"
if [ "${CFEMU_COMPOSE_SPARK:-1}" != 0 ]; then
    "$PYTHON" -m pip wheel -q --disable-pip-version-check -w "$WHEELS" "pyspark==$SPARK_VERSION" pyarrow
fi

# A fixed port: the URL is a build argument, part of the layer cache's key.
PORT=${CFEMU_WHEEL_PORT:-38111}
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELS" "$PORT" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT INT TERM
sleep 1
kill -0 "$SERVER" 2>/dev/null || { echo "cannot serve the wheels on 127.0.0.1:$PORT (CFEMU_WHEEL_PORT)" >&2; exit 1; }
PIP="--build-arg PIP_FIND_LINKS=http://127.0.0.1:$PORT/ --build-arg PIP_NO_INDEX=1"

# shellcheck disable=SC2086
"$DOCKER" build --network host --build-arg BASE="$BASE" $PIP --target base -t cfemu:latest .
if [ "${CFEMU_COMPOSE_SPARK:-1}" != 0 ]; then
    # shellcheck disable=SC2086
    "$DOCKER" build --network host --build-arg BASE="$BASE" $PIP --build-arg SPARK_VERSION="$SPARK_VERSION" \
        --target spark -t cfemu-spark:latest .
fi
