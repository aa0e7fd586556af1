"""`exgrpo run` overrides: pool rules, job sizes and trainer settings go where they belong; bad ones
fail with a message that names them, before anything starts."""

from __future__ import annotations

import pytest

from exgrpo_onebox.experiment import ExperimentOptions, run_experiment
from exgrpo_onebox.main_job import JobPlan, _budget_steps, split_overrides


def test_overrides_are_routed_by_prefix() -> None:
    pool, job, rest = split_overrides(
        [
            "pool.weighting=uniform",
            "pool.experience_ratio=0.25",
            "job.eval_every=5",
            "run.steps=7",
            "job.eval_temperature=1",
            "experience.metric=random",
        ]
    )
    assert pool == {"weighting": "uniform", "experience_ratio": 0.25}
    assert job == {"eval_every": 5, "eval_temperature": 1.0}
    assert isinstance(job["eval_temperature"], float)
    assert rest == ["run.steps=7", "experience.metric=random"]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("pool.bogus=1", "unknown pool rule 'bogus'"),
        ("job.nope=3", "unknown job size 'nope'"),
        ("job.eval_every=often", "eval_every must be an integer"),
        ("job.eval_every=true", "eval_every must be an integer"),
        ("job.eval_temperature=hot", "eval_temperature must be a number"),
        ("run.steps", "expected key=value"),
    ],
)
def test_bad_overrides_are_named(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_overrides([item])


def test_rollout_budget_leaves_room_for_the_hook_to_stop() -> None:
    job = JobPlan(pool_k=8, pool_batch_size=16)
    (steps,) = _budget_steps(7680, job)
    # a step generates between B*(K-1) = 112 and B*K = 128 rollouts: the cap is never reached first
    assert steps == f"run.steps={7680 // 112 + 2}"
    assert _budget_steps(None, job) == []


def test_experiment_rejects_bad_arms_and_overrides_before_running(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown arm"):
        run_experiment(ExperimentOptions(out=tmp_path / "x", arms=("grpo", "ppo")))
    with pytest.raises(ValueError, match="unknown pool rule"):
        run_experiment(ExperimentOptions(out=tmp_path / "y", overrides=["pool.wieghting=uniform"]))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
