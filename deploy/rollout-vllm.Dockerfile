# Rollout worker on vLLM (GPU). Its own image and pins (deploy/rollout-vllm/requirements.txt):
# vLLM pins a torch that differs from the trainer's. Build from the repository root:
#   docker build -f deploy/rollout-vllm.Dockerfile -t exgrpo/rollout-vllm:0.1.0 .
# Package index settings of the build (PIP_INDEX_URL, PIP_CA_CERTS, ...): deploy/docker/pip-install.sh.
# The default command serves the run of EXGRPO_POOL / EXGRPO_RUN (as --pool / --run do).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CA_CERTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
COPY deploy/docker/pip-install.sh /usr/local/bin/pip-install
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
COPY deploy/rollout-vllm/requirements.txt /tmp/requirements.txt
RUN pip-install -r /tmp/requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY clients ./clients
RUN pip-install --no-deps . \
 && /opt/venv/bin/pip check

FROM ${CUDA_IMAGE} AS runtime
LABEL org.opencontainers.image.title="exgrpo-rollout-vllm" \
      org.opencontainers.image.description="ExGRPO rollout worker (vLLM, GPU)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# vLLM compiles kernels at start (triton): it needs a C compiler and the Python headers at run time
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 exgrpo \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin exgrpo \
 && mkdir -p /data/run/published /models /opt/exgrpo /data/.cache \
 && chown -R 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/exgrpo/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data XDG_CACHE_HOME=/data/.cache \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    EXGRPO_WORKER_METRICS_PORT=9300
WORKDIR /data
USER 10001:10001
EXPOSE 9300
HEALTHCHECK --interval=15s --timeout=4s --start-period=600s --retries=4 \
  CMD python3 /opt/exgrpo/healthcheck.py "http://127.0.0.1:${EXGRPO_WORKER_METRICS_PORT}/metrics"
CMD ["exgrpo", "rollout", "--engine", "vllm"]
