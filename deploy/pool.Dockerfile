# Experience pool service: FastAPI on Postgres + Redis (or SQLite + in-process index).
# Build from the repository root:
#   docker build -f deploy/pool.Dockerfile -t exgrpo/pool:0.1.0 .
# Run `exgrpo db upgrade` once per release before the replicas start (compose and the Kubernetes
# init container do it), then `exgrpo serve` (the CMD). Configuration: EXGRPO_* variables.
# Package index settings of the build (PIP_INDEX_URL, PIP_CA_CERTS, ...): deploy/docker/pip-install.sh.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CA_CERTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY deploy/docker/pip-install.sh /usr/local/bin/pip-install
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY clients ./clients
RUN pip-install ".[server]" \
 && /opt/venv/bin/pip check

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="exgrpo-pool" \
      org.opencontainers.image.description="ExGRPO experience pool service" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 exgrpo \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin exgrpo \
 && mkdir -p /data /opt/exgrpo && chown 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/exgrpo/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    EXGRPO_HOST=0.0.0.0 \
    EXGRPO_PORT=8700
WORKDIR /data
USER 10001:10001
EXPOSE 8700
HEALTHCHECK --interval=10s --timeout=4s --start-period=20s --retries=5 \
  CMD python /opt/exgrpo/healthcheck.py "http://127.0.0.1:${EXGRPO_PORT}/healthz"
CMD ["exgrpo", "serve"]
