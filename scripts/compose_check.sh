#!/usr/bin/env bash
# docker compose up, for real: build the images, start the `cpu` profile, train, verify, tear down.
#
#   bash scripts/compose_check.sh                      # the whole check (about 15-25 min cold)
#   bash scripts/compose_check.sh --steps 12 --keep    # keep the stack up afterwards
#   bash scripts/compose_check.sh --profile gpu --dry-run
#
# What it does (docs/operations.md, "Checking the stack end to end"):
#  1. installs docker.io, docker-compose and debootstrap from Debian's packages when they are missing,
#     and starts dockerd when none runs (without a bridge or iptables rules; it stops only a dockerd
#     that it started);
#  2. builds local base images from Debian packages (deploy/local/bases.Dockerfile on a debootstrap
#     root file system): python, postgres, redis and prometheus stand-ins. No image registry is used;
#  3. builds the project images with the real Dockerfiles in deploy/ (pool, rollout CPU, trainer CPU),
#     with this machine's pip settings: indexes and find-links given as file paths are served on
#     127.0.0.1 for the builds, and certificates this machine trusts beyond the public ones go in as
#     PIP_CA_CERTS (deploy/docker/pip-install.sh);
#  4. brings up the `cpu` profile with deploy/local/compose.hostnet.yml: every container on the host
#     network, each service on 127.0.0.1 on a port of its own (no container talks over a docker
#     bridge), fresh random secrets, project name exgrpo-check;
#  5. verifies: migrations ran, the pool is healthy, the init job built the model, the trainer
#     finished its steps, the workers completed tasks, the run switched to mixed batches and replayed,
#     /dashboard and /docs (with its Swagger UI assets) answer, Prometheus has the pool's target up.
#     Grafana is skipped: neither Debian nor PyPI has it;
#  6. `docker-compose down -v`, removes dangling images, and prints one summary line last.
# Exit status 0 only when every check passed.
#
# Options:
#   --profile cpu|gpu   cpu (default) runs the stack; gpu needs --dry-run here (no GPU, no CUDA image)
#   --dry-run           build and validate only: nothing is started
#   --steps N           trainer steps (default 16)
#   --keep              leave the stack running (tear down later with the command it prints)
#   --no-install        fail instead of installing missing tools
#   --reuse-images      do not build the project images when they exist (iterating on the stack)
#   --timeout S         the longest wait for the training to finish (default 1800)
# Environment: EXGRPO_CHECK_PORT_BASE (default 18000): the stack's ports are BASE+432 (Postgres),
# BASE+379 (Redis), BASE+700 (pool), BASE+1090 (Prometheus), BASE+1300/1400 (worker/trainer metrics),
# BASE+1500 (this machine's local package folders, served to the image builds).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PROFILE=cpu
DRY_RUN=0
STEPS=16
KEEP=0
INSTALL=1
REUSE=0
TRAIN_TIMEOUT=1800
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) PROFILE="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --steps) STEPS="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    --reuse-images) REUSE=1; shift ;;
    --timeout) TRAIN_TIMEOUT="$2"; shift 2 ;;
    -h | --help) sed -n '2,40p' "$0"; exit 0 ;;
    *) echo "compose_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$PROFILE" in cpu | gpu) ;; *) echo "compose_check: --profile cpu or gpu" >&2; exit 2 ;; esac
if [ "$PROFILE" = gpu ] && [ "$DRY_RUN" = 0 ]; then
  echo "compose_check: the gpu profile needs GPUs and the NVIDIA toolkit: run it with --dry-run here" >&2
  exit 2
fi

STARTED=$(date +%s)
STATE="$(mktemp -d -t exgrpo-compose-check.XXXXXX)"
PROJECT=exgrpo-check
BASE_PORT="${EXGRPO_CHECK_PORT_BASE:-18000}"
PG_PORT=$((BASE_PORT + 432))
REDIS_PORT=$((BASE_PORT + 379))
POOL_PORT=$((BASE_PORT + 700))
PROM_PORT=$((BASE_PORT + 1090))
WORKER_PORT=$((BASE_PORT + 1300))
TRAINER_PORT=$((BASE_PORT + 1400))
POOL_URL="http://127.0.0.1:$POOL_PORT"
DEBIAN_IMAGE=exgrpo-local/debian:bookworm
PYTHON_IMAGE=exgrpo-local/python:bookworm
MIRROR="${EXGRPO_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
OWN_DOCKERD_PID=""
INDEX_PID=""
STACK_UP=0
RESULT="FAIL"
SUMMARY=""
FACTS=()

log() { printf '[compose-check %4ss] %s\n' "$(($(date +%s) - STARTED))" "$*" >&2; }
fact() { FACTS+=("$1"); log "ok: $1"; }
die() {
  SUMMARY="$*"
  log "FAILED: $*"
  exit 1
}

compose_sources() {  # docker-compose.yml with the host-network override, as given
  "${COMPOSE[@]}" --project-name "$PROJECT" --env-file "$STATE/check.env" \
    -f docker-compose.yml -f deploy/local/compose.hostnet.yml "$@"
}
compose() {  # the resolved file (section 4): what the check builds, starts and tears down
  "${COMPOSE[@]}" --project-name "$PROJECT" --project-directory "$ROOT" -f "$STATE/compose.yml" "$@"
}

finish() {
  local code=$?
  set +e
  if [ "$code" != 0 ] && [ "$STACK_UP" = 1 ]; then
    log "logs of the stack (last lines of each service):"
    compose logs --no-color --tail 40 >&2 2>/dev/null
  fi
  if [ "$STACK_UP" = 1 ]; then
    if [ "$KEEP" = 1 ]; then
      log "stack left running; tear down with: ${COMPOSE[*]} --project-name $PROJECT -f $STATE/compose.yml down -v"
    else
      log "docker-compose down -v"
      compose down -v --remove-orphans >/dev/null 2>&1 || log "docker-compose down failed"
    fi
  fi
  if docker info >/dev/null 2>&1; then
    docker image prune -f >/dev/null 2>&1  # dangling layers of rebuilt images only
  fi
  if [ -n "$INDEX_PID" ]; then kill "$INDEX_PID" 2>/dev/null; fi
  if [ -n "$OWN_DOCKERD_PID" ] && [ "$KEEP" = 0 ]; then
    log "stopping the dockerd this check started (pid $OWN_DOCKERD_PID)"
    kill "$OWN_DOCKERD_PID" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$OWN_DOCKERD_PID" 2>/dev/null || break; sleep 1; done
  fi
  if [ "$KEEP" = 0 ]; then rm -rf "$STATE"; fi
  local took=$(($(date +%s) - STARTED))
  if [ "$code" = 0 ]; then RESULT="PASS"; fi
  local joined
  joined="$(IFS=';'; echo "${FACTS[*]:-}")"
  if [ "$code" = 0 ]; then
    echo "compose-check: PASS profile $PROFILE$([ "$DRY_RUN" = 1 ] && echo ' (dry run)') in ${took}s: ${joined//;/, }"
  else
    echo "compose-check: FAIL profile $PROFILE after ${took}s: ${SUMMARY:-exit $code} (passed: ${joined//;/, })"
  fi
  exit "$code"
}
trap finish EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------ 1. tools, dockerd
need_pkg() {  # need_pkg COMMAND PACKAGE
  if ! command -v "$1" >/dev/null 2>&1; then
    [ "$INSTALL" = 1 ] || die "$1 is missing (apt-get install $2)"
    log "installing $2 (Debian package)"
    if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq >/dev/null; APT_UPDATED=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null \
      || die "apt-get install $2 failed"
  fi
}
need_pkg dockerd docker.io
need_pkg debootstrap debootstrap
need_pkg curl curl
if command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
else
  need_pkg docker-compose docker-compose
  COMPOSE=(docker-compose)
fi

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd (no bridge, no iptables: every container of the check uses the host network)"
  dockerd --bridge=none --iptables=false --ip-masq=false --pidfile "$STATE/dockerd.pid" \
    >"$STATE/dockerd.log" 2>&1 &
  OWN_DOCKERD_PID=$!
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log" >&2; die "dockerd did not start"; }
fi
DOCKER_ROOT="$(docker info -f '{{.DockerRootDir}}')"
FREE_GB=$(($(df -Pk "$DOCKER_ROOT" | awk 'NR==2 {print $4}') / 1024 / 1024))
log "docker $(docker version -f '{{.Server.Version}}'), ${COMPOSE[*]}, ${FREE_GB} GiB free in $DOCKER_ROOT"
[ "$FREE_GB" -ge 12 ] || die "only ${FREE_GB} GiB free in $DOCKER_ROOT: the images need about 8 GiB"

# ------------------------------------------------------------------------------ 2. local base images
export DOCKER_BUILDKIT=0  # the classic builder: no frontend image to fetch, --network host builds
if ! docker image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1; then
  log "debootstrap: Debian bookworm (minbase) from $MIRROR"
  debootstrap --variant=minbase bookworm "$STATE/rootfs" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log" >&2; die "debootstrap failed"; }
  printf '%s\n' "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    "deb ${MIRROR%/debian}/debian-security bookworm-security main" >"$STATE/rootfs/etc/apt/sources.list"
  rm -rf "$STATE"/rootfs/var/cache/apt/archives/*.deb "$STATE"/rootfs/var/lib/apt/lists/*
  tar -C "$STATE/rootfs" -c . | docker import - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$STATE/rootfs"
fi
for target in python postgres redis prometheus; do
  log "base image exgrpo-local/$target:bookworm (Debian packages)"
  docker build -q --network host --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f deploy/local/bases.Dockerfile --target "$target" -t "exgrpo-local/$target:bookworm" deploy/local \
    >"$STATE/base-$target.log" 2>&1 || { tail -30 "$STATE/base-$target.log" >&2; die "base image $target"; }
done
fact "local base images built"

# ------------------------------------------------------------------------------ 3. pip settings
# This machine's pip configuration, made usable inside the builds: local folders (file:// or
# paths) are served read-only on 127.0.0.1, extra trusted certificates travel as PIP_CA_CERTS.
mkdir -p "$STATE/index"
# a fixed port: the build arguments hold it, and a changed argument would rebuild the torch layers
INDEX_PORT=$((BASE_PORT + 1500))
for port in $PG_PORT $REDIS_PORT $POOL_PORT $PROM_PORT $WORKER_PORT $TRAINER_PORT $INDEX_PORT; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port on 127.0.0.1 is taken: set EXGRPO_CHECK_PORT_BASE"
  fi
done
translate() {  # a pip location -> one usable from a build on the host network
  local loc="$1" path=""
  case "$loc" in
    file://*) path="${loc#file://}" ;;
    /*) path="$loc" ;;
    *) echo "$loc"; return ;;
  esac
  local name
  name="d$(printf '%s' "$path" | cksum | cut -d' ' -f1)"
  ln -sfn "$(dirname "$path")" "$STATE/index/$name"
  echo "http://127.0.0.1:$INDEX_PORT/$name/$(basename "$path")/"
}
pip_setting() {  # pip_setting NAME: the environment's PIP_NAME, else pip's configuration
  local env="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!env:-}" ]; then echo "${!env}"; return; fi
  python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | tail -1
}
BUILD_ENV=()
for setting in index-url extra-index-url find-links trusted-host; do
  value="$(pip_setting "$setting")"
  [ -n "$value" ] || continue
  if [ "$setting" != trusted-host ]; then
    out=""
    for loc in $value; do out="$out $(translate "$loc")"; done
    value="${out# }"
  fi
  BUILD_ENV+=("PIP_$(echo "$setting" | tr 'a-z-' 'A-Z_')=$value")
done
CERT="$(pip_setting cert)"
CERT="${CERT:-${REQUESTS_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}}"
EXTRA_CA="$(python3 - "$CERT" <<'PY'
import glob, re, sys
pem = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
def certs(paths):
    out = []
    for p in paths:
        try:
            out += pem.findall(open(p, encoding="ascii", errors="ignore").read())
        except OSError:
            pass
    return out
public = set(certs(glob.glob("/usr/share/ca-certificates/mozilla/*.crt")))
extra = [c for c in certs([sys.argv[1]]) if c not in public] if public else []
print("\n".join(extra))
PY
)"
if [ -n "$EXTRA_CA" ]; then BUILD_ENV+=("PIP_CA_CERTS=$EXTRA_CA"); fi
if curl -fsS -o /dev/null --max-time 10 https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
  : # the Dockerfiles' default TORCH_CPU_INDEX works
else
  # PyPI's own torch is the CUDA build: only a +cpu wheel among the find-links avoids it
  local_cpu=""
  for loc in $(pip_setting find-links); do
    dir="${loc#file://}"
    if ls "$dir"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then local_cpu="$dir"; fi
  done
  [ -n "$local_cpu" ] || die "the PyTorch CPU index is unreachable and no torch-2.13.0+cpu wheel is among pip's find-links"
  BUILD_ENV+=("TORCH_CPU_INDEX=$(pip_setting index-url | awk '{print $1}')")
  [ -n "$(pip_setting index-url)" ] || BUILD_ENV[-1]="TORCH_CPU_INDEX=https://pypi.org/simple"
fi
python3 -m http.server --bind 127.0.0.1 --directory "$STATE/index" "$INDEX_PORT" >"$STATE/index.log" 2>&1 &
INDEX_PID=$!
for entry in "${BUILD_ENV[@]}"; do
  case "$entry" in PIP_CA_CERTS=*) log "build setting PIP_CA_CERTS ($(grep -c BEGIN <<<"$EXTRA_CA") certificates)" ;;
    *) log "build setting $entry" ;; esac
done

# ------------------------------------------------------------------------------ 4. environment
PROM_DIR="$STATE/prometheus"
mkdir -p "$PROM_DIR"
chmod 755 "$STATE" "$PROM_DIR"
rand() { python3 -c 'import secrets; print(secrets.token_urlsafe(24))'; }
cat >"$STATE/check.env" <<EOF
COMPOSE_PROJECT_NAME=$PROJECT
EXGRPO_VERSION=0.1.0
POSTGRES_PASSWORD=$(rand)
EXGRPO_ADMIN_TOKEN=$(rand)
EXGRPO_TRAINER_TOKEN=$(rand)
EXGRPO_WORKER_TOKEN=$(rand)
EXGRPO_READ_TOKEN=$(rand)
EXGRPO_SERVE_FLAGS=
EXGRPO_LOG_LEVEL=INFO
EXGRPO_POOL=demo
EXGRPO_RUN=demo
GRAFANA_ADMIN_PASSWORD=$(rand)
EXGRPO_PYTHON_IMAGE=$PYTHON_IMAGE
EXGRPO_PG_PORT=$PG_PORT
EXGRPO_REDIS_PORT=$REDIS_PORT
EXGRPO_POOL_PORT=$POOL_PORT
EXGRPO_PROMETHEUS_PORT=$PROM_PORT
EXGRPO_WORKER_METRICS_PORT=$WORKER_PORT
EXGRPO_TRAINER_METRICS_PORT=$TRAINER_PORT
EXGRPO_PROMETHEUS_DIR=$PROM_DIR
EXGRPO_TRAIN_STEPS=$STEPS
EOF
READ_TOKEN="$(sed -n 's/^EXGRPO_READ_TOKEN=//p' "$STATE/check.env")"
cp deploy/prometheus/alerts.yml "$PROM_DIR/alerts.yml"
cat >"$PROM_DIR/prometheus.yml" <<EOF
# written by scripts/compose_check.sh: deploy/prometheus/prometheus.yml with static 127.0.0.1 targets
global:
  scrape_interval: 5s
  evaluation_interval: 15s
rule_files:
  - alerts.yml
scrape_configs:
  - job_name: exgrpo-pool
    static_configs:
      - targets: ["127.0.0.1:$POOL_PORT"]
        labels: {component: pool}
  - job_name: exgrpo-rollout
    static_configs:
      - targets: ["127.0.0.1:$WORKER_PORT"]
        labels: {component: rollout, service: rollout-cpu}
  - job_name: exgrpo-trainer
    static_configs:
      - targets: ["127.0.0.1:$TRAINER_PORT"]
        labels: {component: trainer, service: trainer-cpu}
  - job_name: prometheus
    static_configs:
      - targets: ["127.0.0.1:$PROM_PORT"]
EOF
chmod 644 "$PROM_DIR"/*.yml

# The compose file as the check runs it: the sources resolved with this environment (the build
# arguments too), less the published ports, which a host network has no use for and which
# docker-compose 1.x refuses beside network_mode: host (an override file cannot remove them).
compose_sources --profile "$PROFILE" config -q || die "docker-compose config rejects the $PROFILE profile"
PYYAML=python3
python3 -c 'import yaml' 2>/dev/null || PYYAML="$(head -1 "$(command -v docker-compose)" | sed 's/^#! *//')"
resolve_compose() {
  touch "$STATE/compose.yml" && chmod 600 "$STATE/compose.yml"  # it holds the generated secrets
  # only the settings found above: none of the caller's own PIP_* variables
  env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_TRUSTED_HOST -u PIP_CA_CERTS \
    -u TORCH_CPU_INDEX "${BUILD_ENV[@]}" "${COMPOSE[@]}" --project-name "$PROJECT" --env-file "$STATE/check.env" \
    -f docker-compose.yml -f deploy/local/compose.hostnet.yml --profile cpu --profile gpu config \
    | $PYYAML -c '
import sys, yaml
cfg = yaml.safe_load(sys.stdin)
for svc in cfg["services"].values():
    svc.pop("ports", None)
yaml.safe_dump(cfg, sys.stdout, sort_keys=False)' >"$STATE/compose.yml" || die "cannot resolve the compose files"
  compose --profile "$PROFILE" config -q || die "the resolved compose file does not validate"
}
resolve_compose
fact "compose config valid"

# ------------------------------------------------------------------------------ 5. project images
build_service() {  # build_service NAME...
  log "building ${*} (deploy/*.Dockerfile; the torch layers are reused between runs)"
  compose --profile "$PROFILE" build "$@" >"$STATE/build.log" 2>&1 \
    || { tail -40 "$STATE/build.log" >&2; die "building $* failed"; }
}
keep_build_stages() {
  # The build stages (torch and the dependencies in /opt/venv) are in no final image: tagged, they
  # survive the prune of dangling images at the end and the next run reuses them.
  local args=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE") entry spec file stage
  for entry in "${BUILD_ENV[@]}"; do args+=(--build-arg "$entry"); done
  for spec in pool:build rollout:build trainer:build-cpu; do
    file="${spec%%:*}" stage="${spec##*:}"
    docker build -q --network host "${args[@]}" -f "deploy/$file.Dockerfile" --target "$stage" \
      -t "exgrpo-local/build-cache:$file-$stage" . >/dev/null 2>&1 || log "could not keep the $file $stage stage"
  done
}
image_mb() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%d", $1 / 1048576}'; }

if [ "$PROFILE" = gpu ]; then
  gpu_dry_run() {
    # validates what the gpu profile starts; builds the trainer's gpu image (no CUDA base image:
    # the PyPI torch wheel carries CUDA). Unverified here: the vLLM image (its CUDA base image is on
    # a registry), GPU scheduling, NCCL and vLLM at run time.
    local gpus=1 reserved
    if command -v nvidia-smi >/dev/null 2>&1; then gpus="$(nvidia-smi -L | wc -l)"; fi
    reserved="$(compose --profile gpu config | python3 -c '
import sys, yaml
for name, svc in yaml.safe_load(sys.stdin)["services"].items():
    res = ((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    for d in res.get("devices") or []:
        for i in d.get("device_ids") or []:
            for one in str(i).split(","):
                print(name, one)')" || die "cannot read the gpu profile's GPU reservations"
    while read -r name id; do
      [ -n "$name" ] || continue
      [ "$id" -lt "$gpus" ] || die "$name reserves GPU $id, which a host with $gpus GPU(s) lacks"
    done <<<"$reserved"
    fact "gpu profile: every reserved GPU exists on a $gpus-GPU host ($(echo $reserved))"
    build_service trainer-gpu
    local cudart
    cudart="$(docker run --rm --network none --entrypoint sh "exgrpo/trainer:0.1.0-gpu" -c \
      'find / -xdev -name "libcudart.so*" 2>/dev/null | wc -l')"
    [ "$cudart" = 1 ] || die "the gpu trainer image holds $cudart copies of libcudart (want 1)"
    fact "trainer gpu image built ($(image_mb exgrpo/trainer:0.1.0-gpu) MB, one CUDA runtime)"
    fact "unverified here: rollout-vllm image build, GPU start-up, NCCL, vLLM generation"
  }
  gpu_dry_run
  exit 0
fi

if [ "$REUSE" = 1 ] && docker image inspect exgrpo/pool:0.1.0 exgrpo/rollout:0.1.0 exgrpo/trainer:0.1.0-cpu \
  >/dev/null 2>&1; then
  log "reusing the project images (--reuse-images)"
else
  build_service pool init rollout-cpu trainer-cpu
  keep_build_stages
fi
fact "images pool $(image_mb exgrpo/pool:0.1.0) MB, rollout $(image_mb exgrpo/rollout:0.1.0) MB, trainer $(image_mb exgrpo/trainer:0.1.0-cpu) MB"
if [ "$DRY_RUN" = 1 ]; then exit 0; fi

# ------------------------------------------------------------------------------ 6. up and verify
STACK_UP=1
log "docker-compose --profile cpu up -d (Grafana skipped: no Debian or PyPI package)"
compose --profile cpu up -d --no-build postgres redis pool prometheus init rollout-cpu trainer-cpu \
  >"$STATE/up.log" 2>&1 || { cat "$STATE/up.log" >&2; die "docker-compose up failed"; }
cid() { compose ps -a -q "$1" | head -1; }

api() {  # api PATH: GET on the pool with the read token
  curl -fsS --max-time 10 -H "Authorization: Bearer $READ_TOKEN" "$POOL_URL$1"
}
health="$(docker inspect -f '{{.State.Health.Status}}' "$(cid pool)")"
[ "$health" = healthy ] || die "pool container is $health"
api /readyz >/dev/null || die "pool /readyz is not ready"
fact "pool healthy"

want_rev="$(python3 - <<'PY'
import pathlib, re
revs, downs = set(), set()
for f in pathlib.Path("services/buffer_api/store/migrations/versions").glob("*.py"):
    text = f.read_text()
    m = re.search(r'^revision[^=]*=\s*"([^"]+)"', text, re.M)
    d = re.search(r'^down_revision[^=]*=\s*"([^"]+)"', text, re.M)
    if m: revs.add(m.group(1))
    if d: downs.add(d.group(1))
print(" ".join(sorted(revs - downs)))
PY
)"
have_rev="$(docker exec "$(cid postgres)" psql -p "$PG_PORT" -U exgrpo -d exgrpo -tAc \
  'select version_num from alembic_version' 2>&1 || true)"
[ -n "$have_rev" ] && [ "$have_rev" = "$want_rev" ] \
  || die "migrations: database at '${have_rev}', the code's head is '${want_rev}'"
fact "migrations at head $have_rev"

init_state="$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$(cid init)")"
[ "$init_state" = "exited 0" ] || die "init job: $init_state"
MODELS_VOLUME="${PROJECT}_models"
warm="$(docker run --rm --network none -v "$MODELS_VOLUME:/models:ro" "$PYTHON_IMAGE" \
  python3 -c 'import json; d = json.load(open("/models/arith-warm/warmstart.json")); print(d["parameters"], d["accuracy"]["t1"]["all"])' \
  2>/dev/null)" || die "init job left no warm-started model in the models volume"
fact "init built the model (${warm%% *} parameters, warm-start accuracy ${warm##* })"

log "training $STEPS steps (timeout ${TRAIN_TIMEOUT}s)"
deadline=$(($(date +%s) + TRAIN_TIMEOUT))
while :; do
  state="$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$(cid trainer-cpu)")"
  case "$state" in
    "exited 0 "*) break ;;
    exited* | dead*) die "trainer: $state" ;;
  esac
  [ "$(date +%s)" -lt "$deadline" ] || die "trainer did not finish $STEPS steps in ${TRAIN_TIMEOUT}s"
  sleep 10
done
run_json="$(api /v1/pools/demo/runs)" || die "GET runs failed"
read -r step phase switched <<<"$(python3 -c '
import json, sys
run = next(r for r in json.load(sys.stdin)["data"] if r["name"] == "demo")
print(run["step"], run["phase"], run["switched_at_step"])' <<<"$run_json")"
[ "$step" = "$STEPS" ] || die "the run is at step $step, not $STEPS"
fact "$step steps trained"

pool_metrics="$(api /metrics)" || die "GET /metrics failed"
metric() { awk -v name="$1" '$1 ~ "^"name"({|$)" {s += $2} END {printf "%d", s}' <<<"$pool_metrics"; }
tasks="$(metric exgrpo_tasks_completed_total)"
[ "$tasks" -gt 0 ] || die "no generation task was completed"
fact "$tasks tasks done by the workers"

[ "$phase" = mixed ] || die "the run never switched to mixed batches (phase $phase)"
metrics_jsonl="$(docker run --rm --network none -v "${PROJECT}_checkpoints:/data/run:ro" "$PYTHON_IMAGE" \
  cat /data/run/metrics.jsonl)" || die "no metrics.jsonl in the checkpoints volume"
replayed="$(python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
print(sum(1 for r in rows if r.get("batch/replayed_questions", 0) > 0))' <<<"$metrics_jsonl")"
stats="$(api /v1/pools/demo/stats)" || die "GET pool stats failed"
trajectories="$(python3 -c 'import json, sys; print(json.load(sys.stdin)["num_trajectories"])' <<<"$stats")"
picks="$(metric exgrpo_replay_picks_total)"
[ "$replayed" -gt 0 ] && [ "$picks" -gt 0 ] \
  || die "no replay: $replayed batches with replayed questions, $picks replay picks"
fact "mixed from step $switched, $replayed replayed batches ($picks questions), $trajectories trajectories in the pool"

code="$(curl -s -o "$STATE/dashboard.html" -w '%{http_code}' --max-time 10 "$POOL_URL/dashboard")"
[ "$code" = 200 ] && grep -qi '<html' "$STATE/dashboard.html" || die "/dashboard answered $code"
docs="$(curl -fsS --max-time 10 "$POOL_URL/docs")" || die "/docs does not answer"
asset="$(grep -o 'src="[^"]*swagger-ui-bundle.js"' <<<"$docs" | head -1 | sed 's/^src="//; s/"$//')"
case "$asset" in /*) ;; *) die "/docs loads Swagger UI from elsewhere: '${asset}'" ;; esac
curl -fsS -o /dev/null --max-time 10 "$POOL_URL$asset" || die "/docs asset $asset does not answer"
fact "/dashboard and /docs answer (Swagger UI served by the pool)"

target=""
for _ in $(seq 1 12); do
  target="$(curl -fsS --max-time 10 "http://127.0.0.1:$PROM_PORT/api/v1/targets" | python3 -c '
import json, sys
t = [x for x in json.load(sys.stdin)["data"]["activeTargets"] if x["labels"]["job"] == "exgrpo-pool"]
print(t[0]["health"] if t else "missing")' 2>/dev/null || echo unreachable)"
  [ "$target" = up ] && break
  sleep 5
done
[ "$target" = up ] || die "Prometheus: the pool target is $target"
fact "Prometheus target exgrpo-pool up (Grafana not run: no package)"
