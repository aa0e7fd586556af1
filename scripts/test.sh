#!/usr/bin/env bash
# The test command: installs what the tests need, starts Postgres/Redis when down, type-checks the
# packages (mypy, scripts/typecheck.py: its errors fail the command before any test runs), runs pytest.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m slow` for the slow paths).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
ensure_venv "server,train,rollout,dev"
bash "$ROOT/scripts/services.sh"
"$VENV/bin/python" "$ROOT/scripts/typecheck.py"
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
