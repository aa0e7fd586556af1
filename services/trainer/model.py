"""Model and tokenizer loading, FSDP2 sharding, full-weight export, and the scoring forward pass."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from exgrpo_trainer import dist
from exgrpo_trainer.algo import token_entropy, token_logprobs


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat template; add one to tokenizer_config.json")
    return tok


def load_model(
    path: Path, device: torch.device, *, dtype: str, activation_checkpointing: bool
) -> PreTrainedModel:
    """Load in float32 (master weights), shard with FSDP2 when several ranks run; on GPU with
    dtype auto/bfloat16, compute in bfloat16 and reduce gradients in float32."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = True
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    bf16 = device.type == "cuda" and dtype in ("auto", "bfloat16")
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else (MixedPrecisionPolicy())
    )
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


@contextlib.contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Keep the full weights gathered while generating (one all-gather, not one per token)."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for name in ("model.layers", "transformer.h", "model.decoder.layers"):
        obj: Any = model
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on CPU, on rank 0 (empty elsewhere). Collective: every rank calls it."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Write a Hugging Face folder (safetensors) of the current weights. Collective."""
    state = full_state_dict(model)
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        tied = getattr(model.config, "tie_word_embeddings", False)
        tensors = {k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "exgrpo.json").write_text(json.dumps({"source": "exgrpo-trainer"}))
    dist.barrier()


@dataclass
class Scored:
    """Per-row response log-probs and entropies (lists, unpadded)."""

    logprobs: list[list[float]]
    entropies: list[list[float]]


def pad_rows(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response rows.

    Returns input_ids [B, L], attention_mask [B, L], response_ids [B, R], response_mask [B, R]
    and gather positions [B, R] of the logits that predict each response token."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    r_width = max(1, max(len(r) for r in responses))
    n = len(prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    rids = torch.full((n, r_width), pad_id, dtype=torch.long)
    rmask = torch.zeros((n, r_width), dtype=torch.bool)
    pos = torch.zeros((n, r_width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        seq = p + r
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        att[i, : len(seq)] = 1
        if r:
            rids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            rmask[i, : len(r)] = True
            pos[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
    return ids.to(device), att.to(device), rids.to(device), rmask.to(device), pos.to(device)


def response_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    positions: torch.Tensor,
    *,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] (and entropies) of the response tokens at temperature 1."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    sel = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1])).float()
    lp = token_logprobs(sel, response_ids)
    ent = token_entropy(sel) if with_entropy else None
    return lp, ent
