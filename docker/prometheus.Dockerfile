# Prometheus for compose.monitoring.yaml, built the way the peer image is: from a Debian base (the
# BASE argument; docker/build-base.sh makes one without an image registry) and Debian's own package.
ARG BASE=python:3.11-slim
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/*
COPY docker/prometheus.yml /etc/prometheus/prometheus.yml
EXPOSE 9090
ENTRYPOINT ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
            "--web.listen-address=0.0.0.0:9090"]
