"""`exgrpo run` settings: recipe, flags and `key=value` overrides resolve to one config; bad or
misplaced settings fail with a message that names them (and the owner to set), before anything
starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from exgrpo_onebox.config import MainJobOptions, resolve
from exgrpo_onebox.experiment import ExperimentOptions, run_experiment
from exgrpo_trainer import format_config_error


def _error(overrides: list[str]) -> str:
    try:
        resolve(MainJobOptions(quick=True, overrides=overrides))
    except ValidationError as e:
        return format_config_error(e)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{overrides} resolved without an error")


def test_overrides_reach_their_sections() -> None:
    cfg = resolve(
        MainJobOptions(
            quick=True,
            overrides=[
                "pool.weighting=uniform",
                "job.eval_every=5",
                "run.steps=7",
                "job.eval_temperature=1",
                "experience.metric=random",
                "job.eval_grader=choice_letter",
            ],
        )
    ).config
    assert (cfg.pool.weighting, cfg.job.eval_every, cfg.run.steps) == ("uniform", 5, 7)
    assert cfg.job.eval_temperature == 1.0 and isinstance(cfg.job.eval_temperature, float)
    assert cfg.experience.metric == "random"
    assert cfg.job.eval_grader == "choice_letter"


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("pool.bogus=1", "pool.bogus: Extra inputs are not permitted"),
        ("job.nope=3", "job.nope: Extra inputs are not permitted"),
        ("job.eval_every=often", "job.eval_every: Input should be a valid integer"),
        ("job.eval_every=true", "job.eval_every: Input should be a valid integer"),
        ("job.eval_temperature=hot", "job.eval_temperature: Input should be a valid number"),
        ("run.steps", "expected key=value"),
        ("job.pool_k=4", "job.pool_k: the one-box job's setting is pool.k"),
        ("job.pool_batch_size=8", "job.pool_batch_size: the one-box job's setting is experience.batch_size"),
        (
            "pool.batch_size=8",
            "pool.batch_size is the run's experience.batch_size (16): set experience.batch_size",
        ),
        ("pool.experience_ratio=0.25", "set experience.ratio"),
        ("pool.start_threshold=0.1", "set experience.start_threshold"),
        ("run.pool_url=http://127.0.0.1:1", "run.pool_url: set by the one-box job"),
        ("job.rollouts=0", "job.rollouts: Input should be greater than or equal to 1"),
        ("job.eval_grader=no_such_grader", "unknown grader 'no_such_grader'"),
    ],
)
def test_bad_or_misplaced_settings_are_named(item: str, message: str) -> None:
    assert message in _error([item])


def test_a_derived_setting_given_with_its_owners_value_is_accepted() -> None:
    cfg = resolve(MainJobOptions(quick=True, overrides=["pool.batch_size=16", "experience.ratio=0.3"])).config
    assert cfg.pool.batch_size == 16 and cfg.pool.experience_ratio == 0.3


def test_rollout_budget_leaves_room_for_the_hook_to_stop() -> None:
    cfg = resolve(MainJobOptions(quick=True, rollouts=7680)).config
    # a step generates between B*(K-1) = 112 and B*K = 128 rollouts: the cap is never reached first
    assert cfg.run.steps == 7680 // 112 + 2
    assert cfg.rollouts_per_eval == 4 * 8 * 16
    smaller = resolve(
        MainJobOptions(quick=True, rollouts=7680, overrides=["pool.k=4", "experience.batch_size=8"])
    )
    assert smaller.config.run.steps == 7680 // 24 + 1
    assert resolve(MainJobOptions(quick=True)).config.run.steps == 8  # no budget: the recipe's


def test_defaults_of_the_job(tmp_path: Path) -> None:
    job = resolve(MainJobOptions(quick=True, cache=tmp_path / "cache"))
    cfg = job.config
    assert job.warm_start and cfg.model.path == (tmp_path / "cache" / "warmstart-quick").resolve()
    assert (cfg.run.pool, cfg.run.name) == ("main", "exgrpo")
    assert cfg.run.output_dir.is_absolute() and cfg.run.output_dir.parent.name == "runs"
    assert resolve(MainJobOptions(overrides=["experience.enabled=false"])).config.run.name == "grpo"
    named = resolve(MainJobOptions(grpo=True, overrides=["run.name=plain"])).config
    assert (named.run.name, named.experience.enabled) == ("plain", False)
    assert resolve(MainJobOptions()).config.job.train_questions == 2000  # cpu_demo without --quick


def test_a_missing_recipe_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"none\.yaml"):
        resolve(MainJobOptions(recipe=tmp_path / "none.yaml"))


def test_experiment_rejects_bad_arms_and_overrides_before_running(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arm"):
        run_experiment(ExperimentOptions(out=tmp_path / "x", arms=("grpo", "ppo")))
    with pytest.raises(ValueError, match=r"pool\.wieghting"):
        run_experiment(ExperimentOptions(out=tmp_path / "y", overrides=["pool.wieghting=uniform"]))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
