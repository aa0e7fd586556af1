"""FSDP2 over two processes (gloo) equals one process: the same rows give the same old log-probs,
losses, metrics and updated weights. The rows are fixed (no service, no generation) and are cut
into several mini-batches and uneven micro-batches, so ranks run padded, throw-away forwards. The
KL term (a sharded, frozen reference model) and activation checkpointing are on."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from ._helpers import torchrun

WORKER = Path(__file__).with_name("_equivalence_worker.py")
CLOSE = (
    "loss/total",
    "loss/pg",
    "loss/pg_fresh",
    "loss/pg_replay",
    "loss/entropy",
    "actor/entropy",
    "actor/ratio_mean",
    "actor/ratio_clipped_frac",
    "actor/kl",
    "loss/kl",
    "optim/grad_norm",
    "is/w_mean",
    "is/w_max",
    "is/w_min",
    "is/fw_mean",
)
EXACT = ("tokens/fresh", "tokens/replay", "optim/skipped")


def _launch_all(model: Path, tmp: Path, counts: tuple[int, ...]) -> list[dict[str, Any]]:
    """Run the worker with each process count at the same time; the results in order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            torchrun(n, str(WORKER), str(model), str(tmp / f"world{n}.pt")),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in counts
    ]
    results = []
    for n, proc in zip(counts, procs, strict=True):
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-4000:]
        result: dict[str, Any] = torch.load(tmp / f"world{n}.pt", weights_only=False)
        assert result["world"] == n
        results.append(result)
    return results


@pytest.mark.timeout(300)
def test_two_processes_match_one(tiny_model: Path, tmp_path: Path) -> None:
    one, two = _launch_all(tiny_model, tmp_path, (1, 2))
    assert len(one["steps"]) == len(two["steps"]) == 2
    for step, (a, b) in enumerate(zip(one["steps"], two["steps"], strict=True), start=1):
        ma, mb = a["metrics"], b["metrics"]
        assert ma.keys() == mb.keys(), step
        for key in EXACT:
            assert ma[key] == mb[key], (step, key)
        for key in CLOSE:
            if key.startswith("is/") and step == 1:
                assert key not in ma, "no importance weights without replayed tokens"
                continue
            assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-6), (step, key)
        assert ma["optim/skipped"] == 0.0
        assert len(a["old_lp"]) == len(b["old_lp"]) == 20
        for ra, rb in zip(a["old_lp"], b["old_lp"], strict=True):
            torch.testing.assert_close(torch.tensor(ra), torch.tensor(rb), rtol=0, atol=1e-5)
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            torch.testing.assert_close(a["state"][k], b["state"][k], rtol=0, atol=1e-5, msg=f"{step} {k}")
    assert one["steps"][1]["metrics"]["actor/kl"] > 0, "the policy has moved away from the reference"
    # the replayed rows took part in the second step, and the weights moved at every step
    assert one["steps"][1]["metrics"]["tokens/replay"] > 0
    s1, s2 = one["steps"][0]["state"], one["steps"][1]["state"]
    assert any(not torch.equal(s1[k], s2[k]) for k in s1)
