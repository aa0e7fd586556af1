# ExGRPO trainer (FSDP2 under torchrun). Two targets from the repository root:
#   docker build -f deploy/trainer.Dockerfile --target cpu -t exgrpo/trainer:0.1.0-cpu .
#   docker build -f deploy/trainer.Dockerfile --target gpu -t exgrpo/trainer:0.1.0-gpu .
# cpu: torch 2.13.0 CPU wheel on Debian slim (gloo). gpu: torch 2.13.0 from PyPI on the same slim
# base: the wheel brings its CUDA, cuDNN and NCCL libraries (nvidia-* wheels), so the image holds
# one CUDA, not a CUDA base image's as well. The host needs the NVIDIA driver and container toolkit
# (they mount the driver into the container).
# Package index settings of the build (PIP_INDEX_URL, PIP_CA_CERTS, ...): deploy/docker/pip-install.sh.
# The cpu stages come first: the classic builder builds every stage before the target, so the cpu
# target skips the CUDA download there (the gpu target builds the small cpu stages as well).
# The CMD starts `exgrpo-launch-trainer` (deploy/docker/launch-trainer.sh): NNODES,
# NPROC_PER_NODE, NODE_RANK and RDZV_ENDPOINT choose single- or multi-node torchrun.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# ------------------------------------------------------------------------------------ cpu build
FROM ${PYTHON_IMAGE} AS build-cpu
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
# torch is already the CPU build: the extras' torch==2.13.0 pin is satisfied by it. The rollout
# extra brings the graders' math-verify (the trainer grades colocated rollouts and replays).
RUN pip-install ".[train,rollout]" "prometheus-client>=0.20" \
 && /opt/venv/bin/pip check

# ---------------------------------------------------------------------------------- cpu runtime
FROM ${PYTHON_IMAGE} AS cpu
RUN groupadd --system --gid 10001 exgrpo \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin exgrpo \
 && mkdir -p /data/run/published /models /etc/exgrpo \
 && chown -R 10001:10001 /data /models
COPY --from=build-cpu /opt/venv /opt/venv
COPY deploy/docker/launch-trainer.sh /usr/local/bin/exgrpo-launch-trainer
COPY deploy/trainer/ /etc/exgrpo/
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /data
USER 10001:10001
CMD ["exgrpo-launch-trainer", "--config", "/etc/exgrpo/cpu.yaml"]

# ------------------------------------------------------------------------------------ gpu build
FROM ${PYTHON_IMAGE} AS build-gpu
ARG TORCH_VERSION
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CA_CERTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY deploy/docker/pip-install.sh /usr/local/bin/pip-install
# PyPI's torch for Linux x86_64 is the CUDA build: it pulls the nvidia-* library wheels. Only
# the index here: find-links may hold a CPU wheel of the same version, which would satisfy the pin.
RUN python -m venv /opt/venv \
 && PIP_FIND_LINKS= pip-install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY clients ./clients
RUN pip-install ".[train,rollout]" "prometheus-client>=0.20" \
 && /opt/venv/bin/pip check

# ---------------------------------------------------------------------------------- gpu runtime
FROM ${PYTHON_IMAGE} AS gpu
RUN groupadd --system --gid 10001 exgrpo \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --shell /usr/sbin/nologin exgrpo \
 && mkdir -p /data/run/published /models /etc/exgrpo \
 && chown -R 10001:10001 /data /models
COPY --from=build-gpu /opt/venv /opt/venv
COPY deploy/docker/launch-trainer.sh /usr/local/bin/exgrpo-launch-trainer
COPY deploy/trainer/ /etc/exgrpo/
# what the NVIDIA container toolkit mounts into the container: the driver's compute libraries
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /data
USER 10001:10001
# No HEALTHCHECK: the trainer serves no HTTP endpoint of its own; its liveness is its process
# and its progress is the run's step on the pool service.
CMD ["exgrpo-launch-trainer", "--config", "/etc/exgrpo/gpu.yaml"]
