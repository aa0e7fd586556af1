"""The scoring forward pass of the trainer: padded rows, and log-probs / entropies of the response
positions equal to those of the full-logits computation (LM head over every position)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2ForCausalLM

from exgrpo_onebox.tiny import tiny_qwen2
from exgrpo_trainer.algo import token_entropy, token_logprobs
from exgrpo_trainer.model import pad_rows, response_forward

PAD = 0
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return tiny_qwen2(vocab_size=97, pad_token_id=PAD, hidden=32, max_positions=128)


def _rows(seed: int, n: int = 7) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 2-12 tokens and responses of 0-10 tokens (one row has an empty response)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    responses = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 10))] for _ in range(n)]
    responses[n // 2] = []
    return prompts, responses


def _full_logits_path(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: logits of every position, then the response positions gathered."""
    ids, att, rids, _rmask, pos = batch
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    sel = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))
    return token_logprobs(sel, rids), token_entropy(sel)


def test_pad_rows_layout() -> None:
    ids, att, rids, rmask, pos = pad_rows([[5, 6, 7], [8]], [[9, 10], []], PAD, CPU)
    assert ids.tolist() == [[5, 6, 7, 9, 10], [8, PAD, PAD, PAD, PAD]]
    assert att.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert rids.tolist() == [[9, 10], [PAD, PAD]]
    assert rmask.tolist() == [[True, True], [False, False]]
    assert pos.tolist() == [[2, 3], [0, 0]]  # the logits at position p predict token p + 1
    assert ids.dtype == att.dtype == rids.dtype == pos.dtype == torch.long
    assert rmask.dtype == torch.bool


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["rows-a", "rows-b", "rows-c"])
def test_response_forward_equals_the_full_logits_path(model: Qwen2ForCausalLM, seed: int) -> None:
    batch = pad_rows(*_rows(seed), PAD, CPU)
    rmask = batch[3]
    with torch.no_grad():
        ref_lp, ref_ent = _full_logits_path(model, batch)
        lp, ent = response_forward(model, *batch[:3], batch[4], with_entropy=True)
        lp_only, no_ent = response_forward(model, *batch[:3], batch[4], with_entropy=False)
    assert ent is not None and no_ent is None
    assert lp.shape == ent.shape == rmask.shape
    torch.testing.assert_close(lp[rmask], ref_lp[rmask], rtol=0, atol=1e-6)
    torch.testing.assert_close(ent[rmask], ref_ent[rmask], rtol=0, atol=1e-6)
    torch.testing.assert_close(lp_only, lp, rtol=0, atol=0)


def test_response_forward_gradients_equal_the_full_logits_path(model: Qwen2ForCausalLM) -> None:
    batch = pad_rows(*_rows(3), PAD, CPU)
    rmask = batch[3]

    def grads(lp: torch.Tensor, ent: torch.Tensor | None) -> dict[str, torch.Tensor]:
        assert ent is not None
        model.zero_grad(set_to_none=True)
        (lp[rmask].sum() + 0.1 * ent[rmask].sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(*_full_logits_path(model, batch))
    got = grads(*response_forward(model, *batch[:3], batch[4], with_entropy=True))
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-5, msg=name)


def test_response_forward_leaves_the_model_as_it_was(model: Qwen2ForCausalLM) -> None:
    """The position gather is a temporary hook: a plain call afterwards sees every position."""
    ids, att, rids, _rmask, pos = pad_rows(*_rows(4), PAD, CPU)
    with torch.no_grad():
        response_forward(model, ids, att, rids, pos, with_entropy=False)
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    assert logits.shape == (*ids.shape, 97)
    assert not model.get_output_embeddings()._forward_pre_hooks
