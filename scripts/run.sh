#!/usr/bin/env bash
# The main job on the embedded default (SQLite + in-process index, bound to 127.0.0.1).
# Arguments go to `exgrpo run`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
ensure_venv "server,train,rollout"
exec "$VENV/bin/exgrpo" run "$@"
