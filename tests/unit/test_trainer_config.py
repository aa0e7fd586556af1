"""Trainer settings: `key=value` overrides, validation errors that name the field, the shipped
recipes, and the two command lines (`python -m exgrpo_trainer`, `exgrpo train`) failing cleanly."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from exgrpo_cli.main import app
from exgrpo_trainer.config import (
    RECIPES_DIR,
    TrainConfig,
    apply_overrides,
    format_config_error,
    load_config,
    recipes,
)

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ overrides
def test_override_values_are_parsed_as_yaml() -> None:
    cfg = load_config(
        None,
        [
            "optim.lr=2e-6",
            "experience.enabled=false",
            "optim.betas=[0.9, 0.99]",
            "experience.ratio=null",
            "run.steps=7",
            "run.name=exp:1",
            "run.token=[abc",  # not valid YAML: kept as text
            "model.path=/models/m",
        ],
    )
    assert cfg.optim.lr == 2e-6
    assert cfg.experience.enabled is False
    assert cfg.optim.betas == (0.9, 0.99)
    assert cfg.experience.ratio is None
    assert cfg.run.steps == 7
    assert cfg.run.name == "exp:1"
    assert cfg.run.token == "[abc"
    assert cfg.model.path == Path("/models/m")


def test_overrides_replace_file_values_and_keep_the_rest(tmp_path: Path) -> None:
    file = tmp_path / "run.yaml"
    file.write_text("optim:\n  lr: 3.0e-6\n  grad_clip: 0.5\nrun:\n  steps: 9\n")
    cfg = load_config(file, ["optim.lr=1e-5", "run.name=again"])
    assert (cfg.optim.lr, cfg.optim.grad_clip, cfg.run.steps, cfg.run.name) == (1e-5, 0.5, 9, "again")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("optim.lr", "expected key=value"),
        ("=3", "expected section.key=value"),
        ("optim..lr=3", "expected section.key=value"),
        ("run.steps.x=1", "steps is not a section"),
    ],
)
def test_malformed_overrides_are_refused(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_overrides({"run": {"steps": 3}}, [item])


# ----------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optim.lr=0", "optim.lr"),
        ("optim.lr=fast", "optim.lr"),
        ("experience.ratio=1.5", "experience.ratio"),
        ("rollout.engine=vllm", "rollout.engine"),
        ("run.stepz=3", "run.stepz"),
        ("loss.nope=1", "loss.nope"),
        ("schedule=3", "schedule"),
        ("rollout.min_new_tokens=600", "rollout.min_new_tokens"),
    ],
)
def test_validation_errors_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_config(None, [override])
    line = format_config_error(info.value)
    assert field in line
    assert "\n" not in line and line.startswith("invalid config: ")


def test_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist \(shipped recipes: .*\bexgrpo, grpo\b"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(listed)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == TrainConfig()


def test_token_is_masked_in_dumps_and_the_dump_loads_back(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.token=s3cret-token", "optim.lr=3e-6"])
    text = cfg.to_yaml()
    assert "s3cret" not in text and "***" in text
    file = tmp_path / "dump.yaml"
    file.write_text(text)
    again = load_config(file, ["run.token=s3cret-token"])
    assert again == cfg


def test_asynchronous_generation_needs_remote_workers() -> None:
    with pytest.raises(ValidationError) as refused:
        load_config(None, ["rollout.max_policy_lag=2"])
    assert "rollout.max_policy_lag > 0 (asynchronous generation) needs rollout.engine=remote" in (
        format_config_error(refused.value)
    )
    assert load_config(None, ["rollout.engine=remote", "rollout.max_policy_lag=2"]).asynchronous
    synchronous = load_config(None, ["rollout.engine=remote"])
    assert synchronous.rollout.max_policy_lag == 0 and not synchronous.asynchronous
    assert synchronous.run.retry_budget_s == 600.0  # ten minutes of pool outage by default


# -------------------------------------------------------------------------------------- recipes
def test_recipes_hold_the_spec_defaults() -> None:
    assert {"exgrpo", "grpo"} <= set(recipes())
    ex = load_config("exgrpo")
    assert ex.experience.enabled is True
    assert ex.experience.ratio is None and ex.experience.start_threshold is None  # from the pool
    assert ex.experience.batch_size is None and ex.experience.metric == "ent"
    assert ex.optim.lr == 1e-6 and ex.optim.betas == (0.9, 0.999) and ex.optim.weight_decay == 0.01
    assert ex.optim.grad_clip == 1.0 and ex.optim.skip_grad_above == 500.0 and ex.optim.mini_batches == 2
    assert ex.loss.entropy_coeff == 0.001 and ex.loss.beta == 0.1 and ex.loss.kl_coeff == 0.0
    assert (ex.loss.clip_eps, ex.loss.clip_before_switch, ex.loss.clip_after_switch) == (0.2, True, False)
    assert ex.loss.normalizer is None and ex.max_response_len == 8192
    assert (ex.rollout.temperature, ex.rollout.top_p, ex.rollout.grader) == (1.0, 1.0, "math_think")
    assert ex.run.steps == 700 and ex.schedule.checkpoint_every == 50

    grpo = load_config("grpo")
    assert grpo.experience.enabled is False
    same = {"optim", "loss", "rollout", "model", "schedule"}
    assert {k: v for k, v in grpo.model_dump().items() if k in same} == {
        k: v for k, v in ex.model_dump().items() if k in same
    }


def test_recipes_are_package_data() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "recipes/*.yaml" in setup["package-data"]["exgrpo_trainer"]
    for recipe in RECIPES_DIR.glob("*.yaml"):
        assert isinstance(yaml.safe_load(recipe.read_text()), dict)


# -------------------------------------------------------------------------------- command lines
@pytest.mark.parametrize("argv", [["optim.lr=-1"], ["--config", "exgrpo", "optim.lrr=1"]])
def test_module_entry_point_rejects_bad_settings_in_one_line(argv: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "exgrpo_trainer", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("error: invalid config: optim.lr")


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_exgrpo_train_rejects_bad_settings_before_starting(nproc: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["train", "--nproc", nproc, "--config", "grpo", "optim.lr=0", f"run.output_dir={tmp_path}/o"]
    )
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("error: ") and "optim.lr" in line
    assert not (tmp_path / "o").exists()

    missing = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 1 and "does not exist" in missing.stderr
