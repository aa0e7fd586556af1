"""Weights without disk through the real processes: `exgrpo run --quick --workers 1` with
`rollout.publish=http`. The trainer serves every version from memory, the pool registers http://
uris, the `exgrpo rollout` worker loads each one before generating (synchronous mode: every step's
`rollout/policy_lag_max` is 0), and no published folder is written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 2


@pytest.mark.slow  # a second run of the remote main job (about 2 minutes): `bash scripts/test.sh -m slow`
def test_quick_main_job_publishes_over_http(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "exgrpo_cli.main", "run", "--quick", "--workers", "1", "--out", str(out),
        "--heldout", "16", f"run.steps={STEPS}", "job.eval_every=100", "experience.batch_size=8",
        "experience.start_threshold=0.02", "rollout.publish=http",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=1200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = stdout.decode(errors="replace")[-3000:] + stderr.decode(errors="replace")[-5000:]
    assert proc.returncode == 0, text

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["rollout/policy_lag_max"] for m in metrics] == [0] * STEPS
    db = sqlite3.connect(out / "pool.db")
    rows = db.execute("select version, uri from policy_version order by version").fetchall()
    assert [v for v, _ in rows] == list(range(STEPS + 1))
    assert all(uri.startswith("http://127.0.0.1:") for _, uri in rows), rows
    assert not (out / "published").exists(), "no published folder was written"
    log = (out / "workers" / "w1.log").read_text()
    loaded = [line for line in log.splitlines() if "policy_loaded" in line]
    assert len(loaded) >= STEPS, log[-3000:]
