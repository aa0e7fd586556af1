"""Resumable checkpoints with torch.distributed.checkpoint: model, optimizer, RNG, step.

Layout: one folder per run, `<output_dir>/checkpoints/<pool>/<run>/`. In it `step-000123/` holds
the DCP shards plus `extra-rank<r>.pt` (RNG states and counters of each rank), `latest` names the
newest complete one, and `run.json` says which run the folder belongs to (pool, run name and the
run's creation time on the service): a trainer of any other run refuses to resume from it.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from exgrpo_trainer import dist


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointOwnerError(ValueError):
    """A checkpoint folder that belongs to another run than the one being trained."""


@dataclass(frozen=True)
class RunIdentity:
    """Which run a checkpoint folder belongs to: a run of the same name created anew (on another
    service, or after the old one was deleted) is another run."""

    pool: str
    run: str
    created_at: str
    """The run's creation time on the pool service (ISO 8601)."""

    def describe(self) -> str:
        return f"run {self.run} of pool {self.pool} (created {self.created_at})"


class Checkpointer:
    IDENTITY = "run.json"

    def __init__(self, root: Path, keep: int) -> None:
        self.root = root
        self.keep = keep

    def claim(self, identity: RunIdentity) -> None:
        """Make sure the folder is this run's (its `run.json` names it, or it has none yet, which
        is then written). Raises `CheckpointOwnerError`, naming both runs, for another run's
        folder. Called on every rank; rank 0 writes."""
        path = self.root / self.IDENTITY
        if path.exists():
            try:
                owner = RunIdentity(**json.loads(path.read_text()))
            except (ValueError, TypeError) as e:
                raise CheckpointOwnerError(f"{path} is not a run identity file ({e})") from None
            if owner != identity:
                raise CheckpointOwnerError(
                    f"the checkpoint folder {self.root} belongs to {owner.describe()}, not to "
                    f"{identity.describe()} that this trainer attached to; it is not resumed. Give "
                    f"this run its own run.output_dir, or delete {path} to resume it on purpose"
                )
        elif dist.is_main():
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(identity), indent=2) + "\n")
            tmp.replace(path)
        dist.barrier()

    def latest(self) -> Path | None:
        marker = self.root / "latest"
        if not marker.exists():
            return None
        path = self.root / marker.read_text().strip()
        return path if path.exists() else None

    def save(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict[str, Any]
    ) -> Path:
        path = self.root / f"step-{step:06d}"
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        torch.save({"step": step, "rng": _rng_state(), **extra}, path / f"extra-rank{dist.rank()}.pt")
        dist.barrier()
        if dist.is_main():
            (self.root / "latest.tmp").write_text(path.name)
            (self.root / "latest.tmp").replace(self.root / "latest")
            done = sorted(p for p in self.root.glob("step-*") if p.is_dir())
            for old in done[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return path

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
        msd, osd = get_state_dict(model, optimizer)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))  # in place
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        extra_file = path / f"extra-rank{dist.rank()}.pt"
        if not extra_file.exists():
            raise ValueError(
                f"{path} was written by a run with fewer ranks (no {extra_file.name}); "
                "resume with the same number of processes"
            )
        extra: dict[str, Any] = torch.load(extra_file, weights_only=False)
        _set_rng_state(extra.pop("rng"))
        return extra
