# The project's image: every SQM server, the backup scheduler and the backup/restore tools run from it.
#   docker build -t cfemu .                 (the default target: SQM servers, cfbackup, cfrestore --engine local)
#   docker build --target spark -t cfemu-spark .   (adds a JRE and PySpark: cfrestore --engine spark, Spark worker)
FROM python:3.11-slim AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CFEMU_LOG_ROOT=/var/lib/cfemu/logs \
    CFEMU_BACKUP_DIR=/var/lib/cfemu/backups

WORKDIR /opt/cfemu
COPY pyproject.toml ./
COPY cfemu ./cfemu
COPY sqm ./sqm
COPY backup ./backup
COPY restore ./restore
COPY qsg ./qsg
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /var/lib/cfemu cfemu \
    && mkdir -p /var/lib/cfemu/logs /var/lib/cfemu/backups \
    && chown -R cfemu /var/lib/cfemu

# Named volumes mounted here start out owned by the cfemu user (Docker copies the mount point's ownership).
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
ARG SPARK_VERSION=4.0.0
RUN pip install "pyspark==${SPARK_VERSION}" pyarrow
ENV SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=/usr/local/bin/python
USER cfemu
