"""The README's main job, quick variant, end to end: `exgrpo run --quick` in a fresh folder."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import yaml


def test_quick_main_job_runs_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    proc = subprocess.run(
        # the run's experience settings (B included) must become the run's rules and the pool's
        [
            sys.executable,
            "-m",
            "exgrpo_cli.main",
            "run",
            "--quick",
            "--out",
            str(out),
            "experience.ratio=0.25",
            "experience.batch_size=8",  # B, over the recipe's 16
            "experience.start_threshold=0.02",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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
    # the pool is in the run folder and records the run's progress and the posted curves
    db = sqlite3.connect(out / "pool.db")
    ((run_step,),) = db.execute("select step from run where name = 'exgrpo'").fetchall()
    assert run_step == len(steps)
    ((overrides,),) = db.execute("select overrides from run where name = 'exgrpo'").fetchall()
    assert json.loads(overrides)["experience_ratio"] == 0.25
    assert json.loads(overrides)["start_threshold"] == 0.02
    ((config,),) = db.execute("select config from pool where name = 'main'").fetchall()
    pool_rules = json.loads(config)
    assert (pool_rules["k"], pool_rules["batch_size"], pool_rules["experience_ratio"]) == (8, 8, 0.25)
    saved = yaml.safe_load((out / "config.yaml").read_text())  # the effective settings, all of them
    assert saved["experience"]["batch_size"] == saved["pool"]["batch_size"] == 8
    assert saved["job"]["eval_max_new_tokens"] == saved["rollout"]["max_new_tokens"] == 96
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["batch/questions"] == 8 and m["batch/generated"] >= 8 * 7 for m in metrics)
    replayed = [m["batch/replayed_questions"] for m in metrics if m["phase/mixed"]]
    assert replayed and max(replayed) <= 0.25 * 8  # a quarter of B = 8 at most
    curves = db.execute("select count(*) from run_metric").fetchone()[0]
    assert curves >= len(steps)
    assert "held-out accuracy" in proc.stderr and str(out) in proc.stderr
    assert "exgrpo serve" in proc.stderr
