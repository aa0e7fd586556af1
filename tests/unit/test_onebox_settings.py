"""Each setting of the one-box job has one owner, and every component reads the owner's value.

For every shared setting (experience ratio, start threshold, batch size B, group size K, sampling
temperature and max_new_tokens, loss beta, the replay age limit) and every way of setting it (a
recipe file given with `exgrpo run --recipe`, a `key=value` override of `exgrpo run`, an experiment
arm's settings), the change is seen by every component that uses it: the trainer config, the run's
rules as the service stores them, the pool config, the pool service's effective rules for the run
(computed by the service's own code from what the job created over HTTP), and the job's sizes.
Every other setting keeps its value, so a component that read a setting from a copy would fail here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import exgrpo_onebox.main_job as main_job
from exgrpo_cli.main import app
from exgrpo_client import ChatMessage, Client, QuestionCreate, RunOverrides
from exgrpo_onebox.config import OneBoxConfig, default_recipe, resolve
from exgrpo_onebox.experiment import Arm, ExperimentOptions, run_options
from exgrpo_onebox.main_job import MainJobOptions, prepare_pool
from exgrpo_pool.service.convert import rules_for
from exgrpo_pool.store.models import Pool, Run
from exgrpo_trainer import TrainConfig
from exgrpo_trainer.algo import LossConfig

CHANGES: dict[str, tuple[str, Any]] = {
    # setting: (owner, new value); the quick recipe's values are 0.5, 0.35, 16, 8, 1.0, 96, 0.1
    "experience ratio": ("experience.ratio", 0.3),
    "start threshold": ("experience.start_threshold", 0.6),
    "batch size": ("experience.batch_size", 8),
    "K": ("pool.k", 4),
    "temperature": ("rollout.temperature", 0.7),
    "max_new_tokens": ("rollout.max_new_tokens", 48),
    "loss beta": ("loss.beta", 0.2),
    "max replay age": ("experience.max_replay_age", 8),
}
BASE = {
    "experience ratio": 0.5,
    "start threshold": 0.35,
    "batch size": 16,
    "K": 8,
    "temperature": 1.0,
    "max_new_tokens": 96,
    "loss beta": 0.1,
    "max replay age": None,
}
WAYS = ("recipe file", "key=value override", "experiment arm")
QUESTION = QuestionCreate(prompt=[ChatMessage(role="user", content="1+1")], ground_truth="2")


@pytest.fixture
def client(live_server: Any) -> Iterator[Client]:
    with Client(live_server.url) as c:
        yield c


def _nested(key: str, value: Any) -> dict[str, Any]:
    section, name = key.split(".")
    return {section: {name: value}}


def _cli_options(monkeypatch: pytest.MonkeyPatch, *args: str) -> MainJobOptions:
    """What `exgrpo run ARGS` hands the one-box job (the job itself is not run)."""
    seen: list[MainJobOptions] = []
    monkeypatch.setattr(main_job, "run_main_job", seen.append)
    result = CliRunner().invoke(app, ["run", *args])
    assert result.exit_code == 0, result.output
    (opts,) = seen
    return opts


def _options(
    way: str, key: str, value: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> MainJobOptions:
    if way == "recipe file":
        recipe = yaml.safe_load(default_recipe(quick=True).read_text())
        section, name = key.split(".")
        recipe.setdefault(section, {})[name] = value
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        return _cli_options(monkeypatch, "--quick", "--recipe", str(path))
    if way == "key=value override":
        return _cli_options(monkeypatch, "--quick", f"{key}={value}")
    arm = Arm("changed", _nested(key, value), "one setting changed")
    return run_options(arm, 0, ExperimentOptions(quick=True, out=tmp_path / "exp"))


def _service_view(client: Client, cfg: OneBoxConfig) -> tuple[RunOverrides, Any]:
    """Create the run's pool and run as the job does, then read back what the service stores and
    the rules its own code derives for the run."""
    cfg.run.pool = f"t-{uuid.uuid4().hex[:10]}"
    prepare_pool(client, cfg, [QUESTION], "test")
    pool, run = client.get_pool(cfg.run.pool), client.get_run(cfg.run.pool, cfg.run.name)
    stored_pool = Pool(name=pool.name, config=pool.config.model_dump())
    stored_run = Run(name=run.name, overrides=run.overrides.model_dump())
    return run.overrides, rules_for(stored_pool, stored_run)


def seen_by_components(cfg: OneBoxConfig, client: Client) -> dict[str, dict[str, Any]]:
    """Each shared setting as every component that uses it sees it."""
    run_rules, service = _service_view(client, cfg)
    evals_apart = cfg.rollouts_per_eval // cfg.job.eval_every  # K * B of the job's evaluation points
    return {
        "experience ratio": {
            "trainer": cfg.experience.ratio,
            "run": run_rules.experience_ratio,
            "pool": cfg.pool.experience_ratio,
            "service": service.experience_ratio,
        },
        "start threshold": {
            "trainer": cfg.experience.start_threshold,
            "run": run_rules.start_threshold,
            "pool": cfg.pool.start_threshold,
            "service": service.start_threshold,
        },
        "batch size": {
            "trainer": cfg.experience.batch_size,
            "run": run_rules.batch_size,
            "pool": cfg.pool.batch_size,
            "service": service.batch_size,
            "job": evals_apart // cfg.pool.k,
        },
        "K": {"pool": cfg.pool.k, "service": service.k, "job": evals_apart // cfg.experience.batch_size},
        "temperature": {"trainer": cfg.rollout.temperature},
        "max_new_tokens": {
            "trainer": cfg.rollout.max_new_tokens,
            "loss": cfg.loss.max_response_len,
            "evaluation": cfg.eval_sampling(seed=0).max_new_tokens,
        },
        "loss beta": {"trainer": cfg.loss.beta},
        "max replay age": {
            "trainer": cfg.experience.max_replay_age,
            "run": run_rules.max_replay_age,
            "pool": cfg.pool.max_replay_age,
            "service": service.max_replay_age,
        },
    }


def test_the_quick_recipe_is_what_every_component_sees(client: Client) -> None:
    cfg = resolve(MainJobOptions(quick=True)).config
    assert isinstance(cfg, TrainConfig) and isinstance(cfg.loss, LossConfig)  # embedded, not copied
    seen = seen_by_components(cfg, client)
    assert {name: set(views.values()) for name, views in seen.items()} == {
        name: {value} for name, value in BASE.items()
    }
    assert cfg.eval_sampling(seed=0).temperature == 0.6  # the evaluation's own setting, not rollout's


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("setting", list(CHANGES))
def test_a_setting_changed_any_way_is_seen_by_every_component(
    setting: str, way: str, client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, value = CHANGES[setting]
    cfg = resolve(_options(way, key, value, tmp_path, monkeypatch)).config
    seen = seen_by_components(cfg, client)
    for name, views in seen.items():
        expected = value if name == setting else BASE[name]
        assert views == dict.fromkeys(views, expected), f"{way}: {setting} changed; {name}: {views}"


def test_flags_set_their_owners(client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    opts = _cli_options(
        monkeypatch,
        *("--quick", "--seed", "3", "--rollouts", "1000", "--heldout", "10", "--grpo"),
        *("--out", str(tmp_path / "run"), "--model", str(model)),
    )
    job = resolve(opts)
    cfg = job.config
    assert (cfg.run.seed, cfg.job.rollouts, cfg.job.heldout_questions) == (3, 1000, 10)
    assert cfg.run.output_dir == (tmp_path / "run").resolve() and cfg.model.path == model.resolve()
    assert not job.warm_start
    assert cfg.run.steps == -(-1000 // (16 * 7)) + 1  # just past the budget: the hook ends the run
    assert not cfg.experience.enabled and cfg.run.name == "grpo"
    cfg.run.pool = f"t-{uuid.uuid4().hex[:10]}"
    prepare_pool(client, cfg, [QUESTION], "test")
    run = client.get_run(cfg.run.pool, "grpo")
    assert run.seed == 3 and run.overrides.experience is False


def test_an_override_wins_over_the_flag_and_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = _cli_options(
        monkeypatch, "--quick", "--seed", "3", "--rollouts", "1000", "run.seed=4", "run.steps=2"
    )
    cfg = resolve(opts).config
    assert (cfg.run.seed, cfg.run.steps) == (4, 2)


def test_the_saved_config_is_the_effective_one_and_reloads_unchanged() -> None:
    cfg = resolve(MainJobOptions(quick=True, overrides=["experience.ratio=0.25", "pool.k=4"])).config
    again = OneBoxConfig.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg
