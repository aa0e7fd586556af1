"""`exgrpo run --workers N` and `--max-policy-lag N` resolve to the trainer's remote engine (the
quick recipe says colocated), and settings that cannot work together are refused before anything
starts, naming the setting to change. The worker command line follows the trainer config."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from exgrpo_onebox.config import MainJobOptions, resolve
from exgrpo_onebox.fleet import WorkerFleet, worker_command


def test_workers_make_the_job_remote_and_synchronous_by_default() -> None:
    colocated = resolve(MainJobOptions(quick=True)).config
    assert (colocated.rollout.engine, colocated.job.workers) == ("colocated", 0)
    cfg = resolve(MainJobOptions(quick=True, workers=2)).config
    assert (cfg.rollout.engine, cfg.rollout.max_policy_lag, cfg.job.workers) == ("remote", 0, 2)
    lagged = resolve(MainJobOptions(quick=True, workers=2, max_policy_lag=1)).config
    assert (lagged.rollout.engine, lagged.rollout.max_policy_lag) == ("remote", 1)
    as_data = resolve(MainJobOptions(quick=True, overrides=["job.workers=3"])).config
    assert (as_data.rollout.engine, as_data.job.workers) == ("remote", 3)


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (
            MainJobOptions(quick=True, workers=2, overrides=["rollout.engine=colocated"]),
            "rollout.engine=remote",
        ),
        (MainJobOptions(quick=True, overrides=["rollout.engine=remote"]), "--workers N"),
        (MainJobOptions(quick=True, max_policy_lag=1), "--workers N"),
    ],
)
def test_settings_that_cannot_work_together_are_refused(opts: MainJobOptions, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        resolve(opts)


def test_the_worker_command_follows_the_trainer_config(tmp_path: Path) -> None:
    cfg = resolve(MainJobOptions(quick=True, workers=2, overrides=["run.retry_budget_s=42"])).config
    command = worker_command("http://127.0.0.1:1", cfg, "w1", tmp_path, lease_seconds=7)
    assert command[3:6] == ["--url", "http://127.0.0.1:1", "rollout"]
    for flag, value in {
        "--pool": cfg.run.pool,
        "--run": cfg.run.name,
        "--model": str(tmp_path),
        "--worker-id": "w1",
        "--grader": cfg.rollout.grader,
        "--max-new-tokens": str(cfg.rollout.max_new_tokens),
        "--max-prompt-len": str(cfg.model.max_prompt_len),
        "--lease-seconds": "7",
        "--retry-budget-s": "42.0",
    }.items():
        assert command[command.index(flag) + 1] == value, (flag, command)
    with pytest.raises(ValueError, match="at least one worker"):
        WorkerFleet("http://127.0.0.1:1", cfg, tmp_path, tmp_path, count=0)
