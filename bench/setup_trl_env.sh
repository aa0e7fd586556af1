#!/usr/bin/env bash
# A separate virtual environment with TRL for the trainer comparison (bench/trl_compare.py).
# TRL stays out of the project's .venv: this one lives in bench/.venv-trl (git-ignored) and gets
# the same CPU torch and transformers versions as the project, in one pip command, so pip never
# reaches for a CUDA build of torch.
#
#   bash bench/setup_trl_env.sh            # idempotent; EXGRPO_TRL_VENV=... to put it elsewhere
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EXGRPO_TRL_VENV:-$ROOT/bench/.venv-trl}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
REQ="$ROOT/bench/requirements-trl.txt"
STAMP="$VENV/.installed"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[trl-env] creating $VENV" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
fi
if [ ! -f "$STAMP" ] || [ "$REQ" -nt "$STAMP" ]; then
  echo "[trl-env] installing $(grep -v '^#' "$REQ" | tr '\n' ' ')" >&2
  "$VENV/bin/pip" install -q -r "$REQ" >&2
  touch "$STAMP"
fi
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
assert not torch.version.cuda, f"expected the CPU build of torch, got CUDA {torch.version.cuda}"
print(f"[trl-env] ready: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY
