"""`exgrpo experiment` end to end on the quick main job: two arms, two seeds given as a list, the
calibrated task family, a rollout budget. Checks the budget stops each run, arms get their own pool
rules, the family and seeds reach every run, the table's numbers are the runs' numbers (paired per
seed), the replay diagnostics are written, and a second call keeps finished runs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

BUDGET = 300  # quick main job: K = 8, B = 16 -> 3 steps


def _experiment(tmp_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "exgrpo_cli.main", "experiment", "--quick", "--out", str(out)]
    cmd += ["--seeds", "3,5", "--family", "calibrated", "--arms", "grpo,buckets-uniform"]
    cmd += ["--rollouts", str(BUDGET), "experience.start_threshold=0.0"]
    cmd += ["--heldout", "16", "--jobs", "2", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # four quick main jobs (about 1.5 minutes): scripts/test.sh -m slow
def test_quick_experiment_runs_arms_and_seeds_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "exp"
    proc = _experiment(tmp_path, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 of 4 runs to do" in proc.stderr

    finals: dict[tuple[str, int], float] = {}
    for arm in ("grpo", "buckets-uniform"):
        for seed in (3, 5):
            folder = out / arm / f"seed-{seed}"
            summary = json.loads((folder / "summary.json").read_text())
            # the budget ends the run on the first step that reaches it
            assert BUDGET <= summary["rollouts"] < BUDGET + 128
            generated = [
                json.loads(x)["batch/generated"] for x in (folder / "metrics.jsonl").read_text().splitlines()
            ]
            assert sum(generated) == summary["rollouts"] and sum(generated[:-1]) < BUDGET
            finals[(arm, seed)] = summary["heldout_accuracy"][-1]["accuracy"]
            ((config,),) = sqlite3.connect(folder / "pool.db").execute("select config from pool").fetchall()
            weighting = json.loads(config)["weighting"]
            assert weighting == ("uniform" if arm == "buckets-uniform" else "normal")
            ((run,),) = sqlite3.connect(folder / "pool.db").execute("select name from run").fetchall()
            assert run == ("grpo" if arm == "grpo" else "exgrpo")
            sources = {
                s for (s,) in sqlite3.connect(folder / "pool.db").execute("select data_source from question")
            }
            assert sources and all(s.startswith("calib_d") for s in sources)
            ((run_seed,),) = sqlite3.connect(folder / "pool.db").execute("select seed from run").fetchall()
            assert run_seed == seed
            diag = [json.loads(x) for x in (folder / "diagnostics.jsonl").read_text().splitlines()]
            assert [d["step"] for d in diag] == list(range(1, len(generated) + 1))
            replayed = [
                json.loads(x)["batch/replayed_questions"]
                for x in (folder / "metrics.jsonl").read_text().splitlines()
            ]
            # every replayed question of every step is in the diagnostics, with its staleness
            assert [d["replay/questions"] for d in diag] == replayed
            assert all(d.get("replay/age_mean", 1) >= 1 for d in diag)

    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"grpo", "buckets-uniform"}
    for arm, entry in results.items():
        assert entry["seeds"] == [3, 5]
        mean = (finals[(arm, 3)] + finals[(arm, 5)]) / 2
        assert abs(entry["final"]["mean"] - mean) < 1e-9
    paired = [finals[("buckets-uniform", s)] - finals[("grpo", s)] for s in (3, 5)]
    assert abs(results["buckets-uniform"]["vs_grpo"]["mean"] - sum(paired) / 2) < 1e-9
    assert "vs_grpo" not in results["grpo"]
    assert "vs_exgrpo" not in results["buckets-uniform"]  # no exgrpo arm in this experiment
    table = (out / "results.md").read_text()
    assert "| grpo | 2 |" in table and "| buckets-uniform | 2 |" in table
    assert (out / "plots" / "grpo-vs-exgrpo.png").stat().st_size > 0
    assert (out / "plots" / "ablations.png").stat().st_size > 0
    assert (out / "plots" / "diagnostics.png").stat().st_size > 0
    assert results["buckets-uniform"]["reach"]["of"] == 2
    assert set(results["grpo"]["phases"]) == {"early", "middle", "late"}
    assert "Rollouts to reach GRPO's final accuracy" in table

    # a second call keeps what is finished and only rebuilds the report
    stamp = (out / "grpo" / "seed-3" / "summary.json").stat().st_mtime_ns
    again = _experiment(tmp_path, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs to do" not in again.stderr
    assert (out / "grpo" / "seed-3" / "summary.json").stat().st_mtime_ns == stamp
