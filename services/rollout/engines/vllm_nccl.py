"""The trainer's side of vLLM's collective weight update over NCCL (GPU only).

The trainer is rank 0 of a process group of its own with the vLLM workers of one engine (ranks
1..n, one per tensor-parallel worker). A version is published by broadcasting every tensor of the
full state dict, in order; the workers receive each into a fresh tensor on their GPU and stream it
into vLLM's weight loader (`vllm_ext.WeightReloader.exgrpo_receive_weights`), which maps Hugging
Face names onto vLLM's fused layers and keeps each worker's shard. No serialization, no disk, no
host memory: GPU to GPU.

    engine = VLLMEngine(model_dir, ...)                   # the workers' GPUs
    sender = connect(engine, host, port, device)          # trainer GPU: another device than the workers'
    push_weights(engine, sender, state_dict)              # per version

NCCL needs the trainer and each worker on different GPUs (a communicator cannot hold one device
twice). `connect` and `push_weights` drive both sides from the process that holds the engine (the
engine's RPC returns once its workers are done, so the engine side runs in a thread while this
process broadcasts). `scripts/vllm_nccl_check.py` runs it on two GPUs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from exgrpo_rollout.engines.vllm_ext import WeightSpec, weight_specs

if TYPE_CHECKING:
    from exgrpo_rollout.engines.vllm import VLLMEngine

__all__ = ["NcclWeightSender", "connect", "push_weights"]

T = TypeVar("T")


class NcclWeightSender:
    """Rank 0 of the weight-update group: broadcasts state dicts to the vLLM workers."""

    def __init__(self, host: str, port: int, world_size: int, device: torch.device | str) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.device = torch.device(device)
        group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
        self.comm: Any = PyNcclCommunicator(group, device=self.device)

    def send(self, tensors: Mapping[str, torch.Tensor]) -> list[WeightSpec]:
        """Broadcast every tensor in order (moved to this GPU one at a time); the specs sent."""
        specs = weight_specs(tensors)
        stream = torch.cuda.current_stream(self.device)
        for t in tensors.values():
            self.comm.broadcast(t.to(self.device, non_blocking=True).contiguous(), src=0, stream=stream)
        stream.synchronize()
        return specs


def _beside(work: Callable[[], T], engine_side: Callable[[], Any]) -> tuple[T, Any]:
    """Run `engine_side` in a thread while `work` runs here; both results (errors re-raised)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = engine_side()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="vllm-weight-rpc", daemon=True)
    thread.start()
    try:
        mine = work()
    finally:
        thread.join()
    if "error" in box:
        raise box["error"]
    return mine, box["value"]


def connect(
    engine: VLLMEngine, host: str, port: int, device: torch.device | str, workers: int = 1
) -> NcclWeightSender:
    """Build the group: this process (rank 0, on `device`) and the engine's `workers` vLLM workers."""
    sender, _ = _beside(
        lambda: NcclWeightSender(host, port, workers + 1, device),
        lambda: engine.init_weight_group(host, port, 1, workers + 1),
    )
    return sender


def push_weights(
    engine: VLLMEngine, sender: NcclWeightSender, tensors: Mapping[str, torch.Tensor]
) -> list[int]:
    """Publish one version: broadcast `tensors` while the engine's workers receive and load them;
    the number of tensors each worker loaded."""
    specs = weight_specs(tensors)
    _, counts = _beside(lambda: sender.send(tensors), lambda: engine.receive_weights(specs))
    return list(counts)
