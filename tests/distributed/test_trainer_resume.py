"""Checkpoint and resume: 5 uninterrupted steps equal 3 steps, a stop, and a resume to step 5.

Each run gets its own service (a fresh SQLite database), so both start from the same pool state
with the same question ids."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from exgrpo_client import Client
from exgrpo_trainer.trainer import run_training

from ._helpers import make_pool, read_metrics, run_config

COMPARED = (
    "batch/solved",
    "batch/replayed_questions",
    "loss/total",
    "loss/pg",
    "loss/pg_replay",
    "actor/entropy",
    "optim/grad_norm",
    "response/length_mean",
    "experience/trajectories",
)


def _train(url: str, model: Path, out: Path, steps: int) -> None:
    cfg = run_config(
        url,
        "resume",
        model,
        out,
        f"run.steps={steps}",
        "schedule.publish_every=1",  # the same policy versions in both runs
        "schedule.checkpoint_every=0",  # a checkpoint at the end only
    )
    run_training(cfg)


def test_resume_continues_exactly(
    start_live_server: Callable[..., AbstractContextManager[Any]], tiny_model: Path, tmp_path: Path
) -> None:
    outs = {}
    for name, stops in (("straight", [5]), ("resumed", [3, 5])):
        out = tmp_path / name
        with start_live_server(f"sqlite+aiosqlite:///{tmp_path / name}.db") as server:
            with Client(server.url) as client:
                make_pool(client, "resume", start_threshold=0.2)
            for steps in stops:
                _train(server.url, tiny_model, out, steps)
            with Client(server.url) as client:
                run = client.get_run("resume", "run-1")
        assert run.step == 5 and run.phase == "mixed"
        outs[name] = out

    ckpts = outs["resumed"] / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000003", "step-000005"]

    a, b = (read_metrics(outs[n]) for n in ("straight", "resumed"))
    assert [m["step"] for m in a] == [1, 2, 3, 4, 5]
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5]  # appended to the same metrics.jsonl
    assert any(m["batch/replayed_questions"] > 0 for m in a[3:]), "resumed steps replay"
    for ma, mb in zip(a, b, strict=True):
        for key in COMPARED:
            assert abs(ma[key] - mb[key]) <= 1e-6 * max(1.0, abs(ma[key])), (
                ma["step"],
                key,
                ma[key],
                mb[key],
            )

    wa = load_file(str(outs["straight"] / "published" / "v000005" / "model.safetensors"))
    wb = load_file(str(outs["resumed"] / "published" / "v000005" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    w0 = load_file(str(tiny_model / "model.safetensors"))
    assert any(not torch.equal(w0[k], wa[k]) for k in wa), "the weights moved"
