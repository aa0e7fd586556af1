# Rollout worker on the transformers engine (CPU): claims a run's generation tasks, generates,
# grades, completes. Build from the repository root:
#   docker build -f deploy/rollout.Dockerfile -t exgrpo/rollout:0.1.0 .
# The GPU worker on vLLM has its own image (deploy/rollout-vllm.Dockerfile).
# Package index settings of the build (PIP_INDEX_URL, PIP_CA_CERTS, ...): deploy/docker/pip-install.sh.
# The default command serves the run of EXGRPO_POOL / EXGRPO_RUN (as --pool / --run do).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CA_CERTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY deploy/docker/pip-install.sh /usr/local/bin/pip-install
RUN python -m venv /opt/venv \
 && pip-install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY clients ./clients
# prometheus-client serves --metrics-port (the rollout extra does not pull it)
RUN pip-install ".[rollout]" "prometheus-client>=0.20" \
 && /opt/venv/bin/pip check

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="exgrpo-rollout" \
      org.opencontainers.image.description="ExGRPO rollout worker (transformers, CPU)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 exgrpo \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin exgrpo \
 && mkdir -p /data/run/published /models /opt/exgrpo \
 && chown -R 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/exgrpo/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    EXGRPO_WORKER_METRICS_PORT=9300
WORKDIR /data
USER 10001:10001
EXPOSE 9300
# Serves the run of EXGRPO_POOL / EXGRPO_RUN with metrics on EXGRPO_WORKER_METRICS_PORT (the
# options --pool, --run, --metrics-port read them); healthy once the engine is loaded and the
# metrics port answers.
HEALTHCHECK --interval=15s --timeout=4s --start-period=300s --retries=4 \
  CMD python /opt/exgrpo/healthcheck.py "http://127.0.0.1:${EXGRPO_WORKER_METRICS_PORT}/metrics"
CMD ["exgrpo", "rollout", "--engine", "transformers"]
