"""Building a generation engine and its tokenizer from a model folder, by engine name."""

from __future__ import annotations

from typing import Any, Literal

from exgrpo_rollout.engines.base import GenerationEngine

__all__ = ["EngineName", "load_engine"]

EngineName = Literal["transformers", "vllm"]


def load_engine(
    kind: EngineName,
    model: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    max_batch_rows: int = 256,
    torch_threads: int | None = None,
    vllm_options: dict[str, Any] | None = None,
) -> tuple[GenerationEngine, Any]:
    """(engine, Hugging Face tokenizer) for the folder `model`.

    transformers: `device` defaults to cuda when available, else cpu; `dtype` to bfloat16 on GPU and
    float32 on CPU; `seed` seeds torch's global generator (None: a random seed, so that two worker
    processes do not draw the same samples); `torch_threads` sets torch's intra-op threads of this
    process (on a busy CPU host, 1 is often several times faster for small models).
    vllm: `dtype` defaults to "auto", `seed` to 0; `vllm_options` go to `vllm.LLM`.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if kind == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        from exgrpo_rollout.engines.hf import TransformersEngine

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = (
            getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        )
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if seed is None:
            torch.seed()
        else:
            torch.manual_seed(seed)
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        net = net.to(dev).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types `to` unbound
        return TransformersEngine(net, tokenizer, max_batch_rows=max_batch_rows), tokenizer
    if kind == "vllm":
        from exgrpo_rollout.engines.vllm import VLLMEngine

        engine = VLLMEngine(model, seed=seed or 0, dtype=dtype or "auto", **(vllm_options or {}))
        return engine, tokenizer
    raise ValueError(f"unknown engine {kind!r}: use transformers or vllm")
