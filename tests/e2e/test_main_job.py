"""The README's main job, quick variant, end to end: `exgrpo run --quick` in a fresh folder, run
once for this module; its outputs are checked as a product and its per-step metrics against the
golden file.

`data/quick_main_job_metrics.jsonl` was written by `exgrpo run --quick --out DIR
experience.start_threshold=0.02` (one torch thread) with the `time` and `timing/*` keys dropped.
Refactors of the trainer or the one-box job must not change a number: every key of every line is
compared within a relative tolerance of 1e-4, and the set of keys must be the same. The tolerance is
the CPU's, not the code's: the same commit gives values that differ by up to 6e-6 relative on an
AVX2 machine and on the one that wrote the file (torch's float32 kernels sum in another order);
every sample, reward and selection is still the same, and a change of behaviour moves numbers by
far more. (How recipe, flags and key=value overrides reach the run's and the pool's settings is
tested case by case in tests/unit/test_onebox_settings.py.)
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

GOLDEN = Path(__file__).parent / "data" / "quick_main_job_metrics.jsonl"
REL_TOL = 1e-4


@dataclass(frozen=True)
class MainJob:
    out: Path
    stderr: str


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> MainJob:
    cwd = tmp_path_factory.mktemp("main-job")
    out = cwd / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "exgrpo_cli.main", "run", "--quick", "--out", str(out)]
    command.append("experience.start_threshold=0.02")
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return MainJob(out=out, stderr=proc.stderr)


def _lines(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k != "time" and not k.startswith("timing/")} for row in rows]


def test_quick_main_job_metrics_match_the_golden_file(main_job: MainJob) -> None:
    got, want = _lines(main_job.out / "metrics.jsonl"), _lines(GOLDEN)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert set(g) == set(w), f"line {step}: keys differ: {sorted(set(g) ^ set(w))}"
        for key, expected in w.items():
            value = g[key]
            assert math.isclose(value, expected, rel_tol=REL_TOL, abs_tol=0.0) or value == expected, (
                f"line {step}, {key}: {value} != golden {expected}"
            )


def test_quick_main_job_runs_end_to_end(main_job: MainJob) -> None:
    out = main_job.out
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "eval.jsonl",
        "report.md",
        "summary.json",
        "pool.db",
        "data/train.parquet",
        "data/heldout.parquet",
        "plots/accuracy.png",
        "plots/buckets.png",
        "plots/pool.png",
    ):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    evals = summary["heldout_accuracy"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] > 0
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == evals[-1]["step"]
    # the pool is in the run folder and records the run's progress, its override and the posted curves
    db = sqlite3.connect(out / "pool.db")
    ((run_step,),) = db.execute("select step from run where name = 'exgrpo'").fetchall()
    assert run_step == len(steps)
    ((overrides,),) = db.execute("select overrides from run where name = 'exgrpo'").fetchall()
    assert json.loads(overrides)["start_threshold"] == 0.02
    ((config,),) = db.execute("select config from pool where name = 'main'").fetchall()
    pool_rules = json.loads(config)
    saved = yaml.safe_load((out / "config.yaml").read_text())  # the effective settings, all of them
    b, ratio = saved["experience"]["batch_size"], saved["experience"]["ratio"]
    assert (pool_rules["k"], pool_rules["batch_size"], pool_rules["experience_ratio"]) == (8, b, ratio)
    assert saved["pool"]["batch_size"] == b
    assert saved["job"]["eval_max_new_tokens"] == saved["rollout"]["max_new_tokens"] == 96
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["batch/questions"] == b and m["batch/generated"] >= b * 7 for m in metrics)
    replayed = [m["batch/replayed_questions"] for m in metrics if m["phase/mixed"]]
    assert replayed and max(replayed) <= ratio * b
    curves = db.execute("select count(*) from run_metric").fetchone()[0]
    assert curves >= len(steps)
    assert "held-out accuracy" in main_job.stderr and str(out) in main_job.stderr
    assert "exgrpo serve" in main_job.stderr
