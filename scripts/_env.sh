#!/usr/bin/env bash
# Shared set-up for scripts/run.sh and scripts/test.sh: a virtual environment in .venv with the
# project and its extras installed from pyproject.toml. Idempotent and quiet when up to date.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EXGRPO_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

ensure_venv() {
  local extras="$1"
  local stamp="$VENV/.installed-$(echo "$extras" | tr ',' '-')"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip >&2
  fi
  if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    echo "[setup] installing the project with extras [$extras] (first time takes a minute)" >&2
    # torch must come from the pinned CPU wheel; ask for it in the same command as the rest.
    "$VENV/bin/pip" install -q torch==2.13.0 -e "$ROOT[$extras]" >&2
    touch "$stamp"
  fi
}
