"""`rollout.publish: http | shm`: the trainer publishes every version without writing a folder, the
pool service registers the uri, and an engine that loads the uri holds the trainer's weights bit
for bit; the trainer frees what it published when it closes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from exgrpo_client import Client
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.weights import load_policy, shm_path
from exgrpo_trainer.model import full_state_dict, load_tokenizer
from exgrpo_trainer.trainer import Trainer, run_training

from ._helpers import make_pool, run_config


@pytest.mark.parametrize("kind", ["http", "shm"])
def test_published_versions_load_from_memory(
    kind: str, live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    if kind == "shm" and not Path("/dev/shm").is_dir():
        pytest.skip("POSIX shared memory (/dev/shm) is Linux only")
    out = tmp_path / "run"
    net = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = TransformersEngine(net, load_tokenizer(tiny_model))
    seen: list[tuple[int, str, bool]] = []

    def on_step(trainer: Trainer, metrics: dict[str, float]) -> None:
        versions = client.list_policy_versions(pool_name, "r1").data
        newest = max(versions, key=lambda v: v.version)
        load_policy(engine, newest.uri)
        want, got = full_state_dict(trainer.learner.model), engine.model.state_dict()
        seen.append((newest.version, newest.uri, all(torch.equal(got[k], want[k]) for k in want)))

    with Client(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.2)
        cfg = run_config(
            live_server.url, pool_name, tiny_model, out, "run.name=r1", "run.steps=2",
            "schedule.publish_every=1", "schedule.checkpoint_every=0", f"rollout.publish={kind}",
        )  # fmt: skip
        run_training(cfg, client=client, on_step=on_step)
    assert [v for v, _, _ in seen] == [1, 2]
    assert all(uri.startswith(f"{kind}://") for _, uri, _ in seen), seen
    assert all(same for _, _, same in seen), "the engine holds the trainer's weights after each load"
    assert not (out / "published").exists(), "nothing was written to disk"
    with pytest.raises((FileNotFoundError, ConnectionError)):
        load_policy(engine, seen[-1][1])  # freed when the trainer closed
    if kind == "shm":
        assert not shm_path(seen[-1][1]).exists()
