"""Model and tokenizer loading, FSDP2 sharding, the hook-free generation view of the sharded model,
full-weight export, and the scoring forward pass."""

from __future__ import annotations

import contextlib
import copy
import json
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
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
        for layer in _decoder_layers(model):
            checkpoint_layer(layer)
    model.to(device)  # type: ignore[arg-type]  # transformers types its wrapped to() as taking a model
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
def unsharded(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Keep the full weights gathered while generating (one all-gather, not one per token), and
    yield `generation_view(model)` computing with them."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        view = generation_view(model)
        if view is not model:
            _bind(view, model)
        yield view
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


_VIEWS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def generation_view(model: torch.nn.Module) -> torch.nn.Module:
    """The module to generate with: for an FSDP2-sharded model, a plain module of the same
    architecture (built once, on the meta device, so it holds no memory of its own) that
    `unsharded(model)` points at the gathered parameters and buffers; any other model itself.

    Every call of a sharded module runs FSDP2's pre- and post-forward hooks; a decode step calls
    every module once per generated token, and with the weights already gathered the hooks do
    nothing but cost time (about a tenth of generation on the tiny CPU model). The view is used at
    every world size, so generation takes the same path on one rank as on many."""
    if not isinstance(model, FSDPModule):
        return model
    view = _VIEWS.get(model)
    if view is None:
        plain: Any = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
        with torch.device("meta"):
            built = plain(copy.deepcopy(model.config))  # the model class of the sharded module
        built.generation_config = model.generation_config
        built.eval()
        _VIEWS[model] = view = built
    return view


def _bind(view: torch.nn.Module, model: torch.nn.Module) -> None:
    """Point `view`'s parameters and buffers at `model`'s current ones (no copy). Inside `unsharded`
    those are the gathered tensors; they are freed again when it ends, so the view is only used
    inside it. Tied weights appear under each of their names and stay tied."""
    for kind, named in (("_parameters", model.named_parameters), ("_buffers", model.named_buffers)):
        for name, tensor in named(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            slots = getattr(view.get_submodule(owner), kind)
            assert leaf in slots, f"{name} is not in the generation view of {type(model).__name__}"
            slots[leaf] = tensor


def checkpoint_layer(layer: torch.nn.Module) -> None:
    """Recompute `layer` in backward instead of keeping its activations, whenever autograd records
    (transformers' own option only acts in training mode, and the trainer keeps the model in eval
    mode so dropout stays off). The layer's `forward` is wrapped in place, so parameter names, FSDP2
    sharding and saved checkpoints stay as they are; no-grad passes run the layer once as usual."""
    inner = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward


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
    state: dict[str, torch.Tensor] = get_model_state_dict(model, options=opts)  # type: ignore[assignment]  # tensors only for a model
    return state


def publishable_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The full weights as published (on CPU, rank 0; empty elsewhere): a tied LM head is left out,
    as Hugging Face folders store it. Collective."""
    state = full_state_dict(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}


def write_model_files(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """The Hugging Face folder's files other than the weights: config, generation config, tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "exgrpo.json").write_text(json.dumps({"source": "exgrpo-trainer"}))


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Write a Hugging Face folder (safetensors) of the current weights. Collective."""
    tensors = publishable_state(model)
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_model_files(model, tokenizer, out)
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
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    r_lengths = [len(r) for r in responses]
    width = max(lengths)
    r_width = max(1, max(r_lengths))
    # one tensor per field from padded lists: a tensor per row costs more than the copy itself
    ids = torch.tensor(
        [p + r + [pad_id] * (width - n) for p, r, n in zip(prompts, responses, lengths, strict=True)]
    )
    rids = torch.tensor([r + [pad_id] * (r_width - len(r)) for r in responses])
    column, r_column = torch.arange(width), torch.arange(r_width)
    att = (column[None, :] < torch.tensor(lengths)[:, None]).long()
    rmask = r_column[None, :] < torch.tensor(r_lengths)[:, None]
    starts = torch.tensor([len(p) - 1 for p in prompts])
    pos = torch.where(rmask, starts[:, None] + r_column[None, :], 0)
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
    """Log-probs [B, R] (and entropies) of the response tokens at temperature 1.

    Only the response positions go through the LM head: a pre-hook on the output embedding gathers
    them from the final hidden states, so the logits are [B, R, V] instead of [B, L, V] (with a large
    vocabulary and long prompts, the largest tensor of a step). The gather runs inside the model's
    own forward, so FSDP2 gathers and frees the head's weights (and reduces its gradient) as usual."""
    head: torch.nn.Module = model.get_output_embeddings()  # type: ignore[operator]  # nn.Module's __getattr__ types it as a Tensor

    def keep_response_positions(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]  # [B, L, H]
        index = positions[..., None].expand(-1, -1, hidden.shape[-1])
        return (hidden.gather(1, index), *args[1:])

    handle = head.register_forward_pre_hook(keep_response_positions)
    try:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        handle.remove()
    # token_logprobs / token_entropy upcast chunk by chunk: no float32 copy of all logits here
    lp = token_logprobs(logits, response_ids)
    ent = token_entropy(logits) if with_entropy else None
    return lp, ent
