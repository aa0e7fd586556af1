"""`exgrpo run --workers N` and `--max-policy-lag N` resolve to the trainer's remote engine (the
quick recipe says colocated), and settings that cannot work together are refused before anything
starts, naming the setting to change. The workers' settings follow the trainer config."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from exgrpo_onebox.config import MainJobOptions, resolve
from exgrpo_onebox.fleet import WorkerFleet, worker_config


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
        (MainJobOptions(quick=True, overrides=["job.worker_engine=vllm"]), "--workers N"),
        (
            MainJobOptions(quick=True, workers=1, overrides=["job.worker_vllm.enforce_eager=true"]),
            "job.worker_engine=vllm",
        ),
        (MainJobOptions(quick=True, workers=1, overrides=["job.worker_engine=sglang"]), "worker_engine"),
    ],
)
def test_settings_that_cannot_work_together_are_refused(opts: MainJobOptions, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        resolve(opts)


def test_the_workers_follow_the_trainer_config(tmp_path: Path) -> None:
    cfg = resolve(MainJobOptions(quick=True, workers=2, overrides=["run.retry_budget_s=42"])).config
    fleet = WorkerFleet("http://127.0.0.1:1", cfg, tmp_path / "model", tmp_path, count=2, lease_seconds=7)
    assert fleet.names == ["w1", "w2"]
    spec = fleet.spec("w2")
    assert (spec.url, spec.model, spec.log) == ("http://127.0.0.1:1", tmp_path / "model", tmp_path / "w2.log")
    assert spec.config == worker_config(cfg, "w2", lease_seconds=7)
    w, r = spec.config, cfg.rollout
    assert (w.pools, w.runs, w.worker_id, w.lease_seconds) == ([cfg.run.pool], [cfg.run.name], "w2", 7)
    assert (w.grader, w.max_prompt_len, w.drop_system) == (r.grader, cfg.model.max_prompt_len, False)
    # sampling: the fallback for tasks without settings; the trainer's tasks carry the same
    assert (w.temperature, w.top_p, w.max_new_tokens) == (r.temperature, r.top_p, r.max_new_tokens)
    assert w.retry_budget_s == 42
    with pytest.raises(ValueError, match="at least one worker"):
        WorkerFleet("http://127.0.0.1:1", cfg, tmp_path, tmp_path, count=0)


def test_the_workers_generate_with_the_engine_of_the_job(tmp_path: Path) -> None:
    cfg = resolve(MainJobOptions(quick=True, workers=1)).config
    spec = WorkerFleet("http://127.0.0.1:1", cfg, tmp_path, tmp_path, count=1).spec("w1")
    assert (spec.engine, dict(spec.vllm_options)) == ("transformers", {})
    vllm = resolve(
        MainJobOptions(
            quick=True,
            workers=1,
            overrides=[
                "job.worker_engine=vllm",
                "job.worker_vllm.gpu_memory_utilization=0.3",
                "job.worker_vllm.enforce_eager=true",
            ],
        )
    ).config
    assert (vllm.rollout.engine, vllm.job.worker_engine) == ("remote", "vllm")
    job = vllm.job
    fleet = WorkerFleet(
        "http://127.0.0.1:1",
        vllm,
        tmp_path,
        tmp_path,
        count=1,
        engine=job.worker_engine,
        vllm_options=job.worker_vllm,
    )
    spec = fleet.spec("w1")
    assert (spec.engine, dict(spec.vllm_options)) == (
        "vllm",
        {"gpu_memory_utilization": 0.3, "enforce_eager": True},
    )
    assert spec.torch_threads is None  # torch's CPU threads are the transformers engine's setting
