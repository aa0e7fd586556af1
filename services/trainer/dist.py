"""torch.distributed set-up (gloo on CPU, NCCL on GPU) and the few collectives the trainer uses.

Works unchanged in a single process without torchrun (world size 1, no process group).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def init() -> torch.device:
    """Join the process group torchrun describes (if any) and pick this rank's device."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=30)
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # One process: a group of one, so FSDP2 and the collectives run the same code path.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return device


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def broadcast(obj: Any) -> Any:
    """Rank 0's object on every rank."""
    if not active():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def all_sum(value: float) -> float:
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def all_max(value: int) -> int:
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def barrier() -> None:
    if active():
        dist.barrier()
