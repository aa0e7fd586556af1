"""The transformers engine: `record=False` samples the same tokens and leaves out the per-token
log-probs and entropies (the trainer recomputes both); repeating a prompt n times with n=1 samples
what n samples of it would."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from exgrpo_onebox.tiny import build_tokenizer, tiny_qwen2
from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    return tiny_qwen2(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden=32,
        max_positions=128,
    )


def _prompts(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in ("1+2=", "30+4=", "x")]


SAMPLING = SamplingConfig(n=3, temperature=0.9, top_p=0.95, max_new_tokens=40, min_new_tokens=2, seed=7)


def test_record_off_samples_the_same_tokens_without_stats(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompts = _prompts(tokenizer)
    with_stats = TransformersEngine(model, tokenizer).generate(prompts, SAMPLING)
    without = TransformersEngine(model, tokenizer, record=False).generate(prompts, SAMPLING)
    reasons = {c.finish_reason for cs in without for c in cs}
    assert reasons == {"stop", "length"}, "both ways of ending are covered"
    for group_a, group_b in zip(with_stats, without, strict=True):
        assert len(group_a) == len(group_b) == SAMPLING.n
        for a, b in zip(group_a, group_b, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
            assert len(a.logprobs) == len(a.token_ids) and a.entropies is not None
            assert b.logprobs == [] and b.entropies is None
            assert b.text == tokenizer.decode(b.token_ids, skip_special_tokens=False)
            eos_at = [i for i, t in enumerate(b.token_ids) if t == tokenizer.eos_token_id]
            assert eos_at == ([len(b.token_ids) - 1] if b.finish_reason == "stop" else [])


def test_repeated_prompts_with_one_sample_each_match_n_samples(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast
) -> None:
    """The trainer generates a step's rows in one call this way (K or K-1 samples per question)."""
    prompts = _prompts(tokenizer)
    engine = TransformersEngine(model, tokenizer, record=False)
    grouped = engine.generate(prompts, SAMPLING)
    one = dataclasses.replace(SAMPLING, n=1)
    flat = engine.generate([p for p in prompts for _ in range(SAMPLING.n)], one)
    assert [c.token_ids for cs in grouped for c in cs] == [cs[0].token_ids for cs in flat]
