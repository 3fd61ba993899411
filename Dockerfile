# The project's image: every SQM server, the backup scheduler and the backup/restore tools run from it.
#   docker build -t cfemu .                 (the default target: SQM servers, cfbackup, cfrestore --engine local)
#   docker build --target spark -t cfemu-spark .   (adds a JRE and PySpark: cfrestore --engine spark, Spark worker)
# BASE is any Debian-based image with Python 3.11+ and its venv module: the public python image by default; `make
# compose-test` builds a stand-in from Debian's packages where no registry is reachable (docker/base-image.sh).
ARG BASE=python:3.11-slim
FROM ${BASE} AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CFEMU_LOG_ROOT=/var/lib/cfemu/logs \
    CFEMU_BACKUP_DIR=/var/lib/cfemu/backups \
    PATH=/opt/cfemu/venv/bin:$PATH

# Where no package index is reachable from the build, docker/build-images.sh serves wheels built on the host and
# passes PIP_FIND_LINKS (their URL) and PIP_NO_INDEX=1; unset, pip uses PyPI.
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX

WORKDIR /opt/cfemu
COPY pyproject.toml ./
COPY cfemu ./cfemu
COPY sqm ./sqm
COPY backup ./backup
COPY restore ./restore
COPY qsg ./qsg
# A virtual environment: the same on the python image and on a Debian python3 (whose system pip refuses to install).
RUN python3 -m venv /opt/cfemu/venv \
    && pip install . \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/cfemu cfemu \
    && mkdir -p /var/lib/cfemu/logs /var/lib/cfemu/backups /run/cfemu \
    && chown cfemu:cfemu /var/lib/cfemu /var/lib/cfemu/logs /var/lib/cfemu/backups /run/cfemu \
    && chmod 0700 /var/lib/cfemu /var/lib/cfemu/logs /var/lib/cfemu/backups /run/cfemu

# Named volumes mounted at these paths start out owned by the cfemu user, 0700 (Docker copies the mount point's
# ownership and mode into a new volume): the logs, the backups and the group's secrets (/run/cfemu) are the owner's.
VOLUME ["/var/lib/cfemu/logs", "/var/lib/cfemu/backups"]
USER cfemu
WORKDIR /var/lib/cfemu
EXPOSE 7001 9101
STOPSIGNAL SIGTERM
CMD ["sqm", "run", "--help"]


# Restore planning on Spark needs a JVM next to the same Python and the same code on the driver and every worker
# (PySpark refuses a driver and workers with different Python versions), so the Spark worker runs this image too.
FROM base AS spark
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*
ARG SPARK_VERSION=4.3.0
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
RUN pip install "pyspark==${SPARK_VERSION}" pyarrow
# The worker's work directory (executors' files and output) in the cfemu user's home (0700): its default, under
# SPARK_HOME, is root's and the worker, which runs as cfemu, died at start on it.
ENV SPARK_HOME=/opt/cfemu/venv/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=/opt/cfemu/venv/bin/python \
    SPARK_WORKER_DIR=/var/lib/cfemu/spark-work
USER cfemu
