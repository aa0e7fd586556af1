"""One output folder, many runs: checkpoints and published weights are kept per pool and run, so a
new run never resumes another run's checkpoint, and a checkpoint folder that belongs to another
run (copied, or left from a run of the same name on another service) is refused with an error
naming both runs.

Compose and Kubernetes fix `run.output_dir` at /data/run, so every run there shares one folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from exgrpo_client import Client
from exgrpo_trainer.checkpoint import CheckpointOwnerError
from exgrpo_trainer.config import TrainConfig
from exgrpo_trainer.model import full_state_dict
from exgrpo_trainer.trainer import Trainer, run_training

from ._helpers import make_pool, run_config

POOL = "folders"


def _weights_equal(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> bool:
    state = full_state_dict(model)
    return all(torch.equal(state[k], reference[k]) for k in reference)


def _refused(cfg: TrainConfig, client: Client) -> str:
    """The error of a trainer that must not attach with this config."""
    trainer = Trainer(cfg, client=client)
    try:
        with pytest.raises(CheckpointOwnerError) as refused:
            trainer.attach()
    finally:
        trainer.close()
    return str(refused.value)


def test_a_new_run_in_a_reused_folder_starts_fresh(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"  # one folder for both runs, as in the compose and k8s files
    initial = load_file(str(tiny_model / "model.safetensors"))
    with Client(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.2)
        first = run_config(
            live_server.url, pool_name, tiny_model, out, "run.name=r1", "run.steps=2",
            "schedule.publish_every=1", "schedule.checkpoint_every=0",
        )  # fmt: skip
        run_training(first, client=client)
        r1_folder = out / "checkpoints" / pool_name / "r1"
        assert (r1_folder / "latest").read_text().strip() == "step-000002"
        r1_versions = client.list_policy_versions(pool_name, "r1").data
        assert [v.uri for v in r1_versions] == [
            (out / "published" / pool_name / "r1" / f"v{v:06d}").resolve().as_uri() for v in (1, 2)
        ]
        r1_weights = load_file(str(out / "published" / pool_name / "r1" / "v000002" / "model.safetensors"))

        second = run_config(
            live_server.url, pool_name, tiny_model, out, "run.name=brand-new", "run.steps=1",
            "schedule.publish_every=1", "schedule.checkpoint_every=0",
        )  # fmt: skip
        trainer = Trainer(second, client=client)
        try:
            trainer.attach()
            assert trainer.step == 0 and trainer.policy_version == 0
            assert _weights_equal(trainer.learner.model, initial), "the new run starts from model.path"
            trainer.train()
        finally:
            trainer.close()

    # each run has its own checkpoints and published weights; r1's are untouched
    assert (out / "checkpoints" / pool_name / "brand-new" / "latest").read_text().strip() == "step-000001"
    assert (r1_folder / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in r1_folder.glob("step-*")) == ["step-000002"]
    identity = json.loads((r1_folder / "run.json").read_text())
    assert (identity["pool"], identity["run"]) == (pool_name, "r1")
    again = load_file(str(out / "published" / pool_name / "r1" / "v000002" / "model.safetensors"))
    assert all(torch.equal(again[k], r1_weights[k]) for k in r1_weights)
    assert (out / "published" / pool_name / "brand-new" / "v000001" / "model.safetensors").is_file()


def test_a_checkpoint_of_another_run_is_refused(
    start_live_server: Callable[..., AbstractContextManager[Any]], tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    settings = ("run.steps=1", "schedule.publish_every=0", "schedule.checkpoint_every=0")
    with start_live_server(f"sqlite+aiosqlite:///{tmp_path / 'one.db'}") as one, Client(one.url) as client:
        make_pool(client, POOL)
        run_training(run_config(one.url, POOL, tiny_model, out, "run.name=r1", *settings), client=client)

        # a folder copied to another run's place: refused, naming both runs
        shutil.copytree(out / "checkpoints" / POOL / "r1", out / "checkpoints" / POOL / "r2")
        message = _refused(run_config(one.url, POOL, tiny_model, out, "run.name=r2", *settings), client)
        assert f"run r1 of pool {POOL}" in message and f"run r2 of pool {POOL}" in message
        assert "run.json" in message, "says how to adopt the checkpoint on purpose"

    # the same pool and run names on another service (a fresh database): a different run
    with start_live_server(f"sqlite+aiosqlite:///{tmp_path / 'two.db'}") as two, Client(two.url) as client:
        make_pool(client, POOL)
        message = _refused(run_config(two.url, POOL, tiny_model, out, "run.name=r1", *settings), client)
        assert "created" in message and f"run r1 of pool {POOL}" in message
