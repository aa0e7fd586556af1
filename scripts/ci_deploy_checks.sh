#!/usr/bin/env bash
# Validates the deployment files without a container engine or a cluster (see
# tests/deploy/deploy_checks.py for the list of checks):
#   - docker-compose.yml with each profile: Debian's docker-compose (v1 parser, which knows
#     `profiles`), then the strict Compose Specification parser (PyPI `compose-spec`);
#   - deploy/k8s: every manifest against the Kubernetes schemas bundled in `kubernetes-validate`
#     (offline, strict), plus references between the objects;
#   - deploy/prometheus: promtool check config / check rules / test rules (promtool is taken
#     out of Debian's prometheus package, not installed as a service); Grafana provisioning and
#     dashboard JSON, every dashboard query parsed by promtool;
#   - the console scripts the images start (`exgrpo ... --help`, `python -m exgrpo_trainer --help`),
#     and every command that a Dockerfile CMD, a compose service or a manifest starts, parsed by
#     the command's own parser in the project's virtual environment;
#   - the images' install step: a wheel built from the .dockerignore-filtered context holds every
#     module and data file, and runs `exgrpo db upgrade` on a scratch database.
#
#   bash scripts/ci_deploy_checks.sh                  # install what is missing, run every check
#   bash scripts/ci_deploy_checks.sh --install-only   # install the tools (apt), check nothing
#   bash scripts/ci_deploy_checks.sh -k k8s           # only checks whose name contains "k8s"
#
# Tools go to ${EXGRPO_CI_TOOLS:-~/.cache/exgrpo-ci}; Python validators come from the dev extra.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${EXGRPO_CI_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/exgrpo-ci}"

install_only=0
no_venv=0
args=()
for a in "$@"; do
  case "$a" in
    --install-only) install_only=1 ;;
    --no-venv) no_venv=1 ;;       # use the Python that runs the checks as it is (pytest does)
    *) args+=("$a") ;;
  esac
done

apt_updated=0
apt_update_once() {
  if [ "$apt_updated" = 0 ]; then
    apt-get update -qq >&2
    apt_updated=1
  fi
}

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "[deploy-checks] $1 is missing and installing it needs root (apt): install it by hand" >&2
    exit 1
  fi
}

# docker-compose v1 (Debian bookworm: 1.29.2; `profiles` is understood since 1.28)
if ! command -v docker-compose >/dev/null 2>&1; then
  need_root docker-compose
  echo "[deploy-checks] installing docker-compose (Debian package)" >&2
  apt_update_once
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >&2
fi

# promtool: from Debian's prometheus package, extracted without installing the server
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$TOOLS/bin/promtool" ]; then
  need_root promtool
  echo "[deploy-checks] extracting promtool from Debian's prometheus package into $TOOLS" >&2
  mkdir -p "$TOOLS/bin"
  work="$(mktemp -d)"
  apt-cache show prometheus >/dev/null 2>&1 || apt_update_once
  if ! (cd "$work" && apt-get download prometheus >&2 2>/dev/null); then
    apt_update_once
    (cd "$work" && apt-get download prometheus >&2)
  fi
  dpkg-deb -x "$work"/prometheus_*.deb "$work/x"
  install -m 0755 "$work/x/usr/bin/promtool" "$TOOLS/bin/promtool"
  rm -rf "$work"
fi

if [ "$install_only" = 1 ]; then
  exit 0
fi

if [ "$no_venv" = 1 ]; then
  PYBIN="${PYTHON:-python3}"
else
  # shellcheck source=scripts/_env.sh
  source "$ROOT/scripts/_env.sh"
  ensure_venv "server,train,rollout,dev"
  PYBIN="$VENV/bin/python"
fi
export EXGRPO_CI_TOOLS="$TOOLS"
exec "$PYBIN" "$ROOT/tests/deploy/deploy_checks.py" "${args[@]}"
