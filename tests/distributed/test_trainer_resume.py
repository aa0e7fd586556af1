"""Checkpoint and resume: N uninterrupted steps equal a run stopped part way and resumed to step N,
in one process and in two ranks of FSDP2 over gloo (torchrun; each rank writes its own RNG state
beside the sharded model and optimizer).

Each run gets its own service (a fresh SQLite database), so both start from the same pool state
with the same question ids."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from exgrpo_client import Client
from exgrpo_trainer.config import load_config
from exgrpo_trainer.trainer import run_training

from ._helpers import (
    assert_same_metrics,
    assert_same_weights,
    child_env,
    make_pool,
    read_metrics,
    run_overrides,
    torchrun,
)

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


def _train(url: str, model: Path, out: Path, steps: int, nproc: int) -> None:
    overrides = run_overrides(
        url,
        "resume",
        model,
        out,
        f"run.steps={steps}",
        "schedule.publish_every=1",  # the same policy versions in both runs
        "schedule.checkpoint_every=0",  # a checkpoint at the end only
    )
    if nproc == 1:
        run_training(load_config(None, overrides))
        return
    command = torchrun(nproc, "-m", "exgrpo_trainer", *overrides)
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.parametrize(
    ("nproc", "stops"),
    [pytest.param(1, (3, 5), id="one-process"), pytest.param(2, (2, 4), id="two-ranks")],
)
def test_resume_continues_exactly(
    start_live_server: Callable[..., AbstractContextManager[Any]],
    tiny_model: Path,
    tmp_path: Path,
    nproc: int,
    stops: tuple[int, int],
) -> None:
    first, last = stops
    outs = {}
    for name, run_to in (("straight", [last]), ("resumed", [first, last])):
        out = tmp_path / name
        with start_live_server(f"sqlite+aiosqlite:///{tmp_path / name}.db") as server:
            with Client(server.url) as client:
                make_pool(client, "resume", start_threshold=0.2)
            for steps in run_to:
                _train(server.url, tiny_model, out, steps, nproc)
            with Client(server.url) as client:
                run = client.get_run("resume", "run-1")
        assert run.step == last and run.phase == "mixed"
        outs[name] = out

    ckpts = outs["resumed"] / "checkpoints" / "resume" / "run-1"
    assert sorted(p.name for p in ckpts.glob("step-*")) == [f"step-{first:06d}", f"step-{last:06d}"]
    for rank in range(nproc):  # every rank restores its own RNG state
        assert (ckpts / f"step-{first:06d}" / f"extra-rank{rank}.pt").is_file()

    a, b = (read_metrics(outs[n]) for n in ("straight", "resumed"))
    assert [m["step"] for m in a] == list(range(1, last + 1))
    assert [m["step"] for m in b] == list(range(1, last + 1))  # appended to the same metrics.jsonl
    assert any(m["batch/replayed_questions"] > 0 for m in a[first:]), "resumed steps replay"
    assert_same_metrics(a, b, COMPARED)

    published = f"published/resume/run-1/v{last:06d}"
    wa = assert_same_weights(outs["straight"] / published, outs["resumed"] / published)
    w0 = load_file(str(tiny_model / "model.safetensors"))
    assert any(not torch.equal(w0[k], wa[k]) for k in wa), "the weights moved"
