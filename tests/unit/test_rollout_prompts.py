"""render_prompt: the trainer's rule (template as text, then tokenised without special tokens)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from exgrpo_client.schemas import ChatMessage
from exgrpo_onebox.tiny import build_tokenizer
from exgrpo_rollout.prompts import render_prompt, render_prompt_text

MESSAGES = [
    {"role": "system", "content": "Think first."},
    {"role": "user", "content": "What is 1 + 1?"},
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def test_template_text_then_tokens(tok: PreTrainedTokenizerFast) -> None:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Think first.\n<|user|>What is 1 + 1?\n<|assistant|><think>\n"
    assert render_prompt_text(tok, MESSAGES) == text
    assert render_prompt(tok, MESSAGES) == tok(text, add_special_tokens=False)["input_ids"]


def test_chat_messages_drop_system_and_left_cut(tok: PreTrainedTokenizerFast) -> None:
    models = [ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    assert render_prompt(tok, models) == render_prompt(tok, MESSAGES)
    no_system = render_prompt(tok, MESSAGES, drop_system=True)
    assert tok.decode(no_system) == "<|user|>What is 1 + 1?\n<|assistant|><think>\n"
    full = render_prompt(tok, MESSAGES)
    assert render_prompt(tok, MESSAGES, max_len=5) == full[-5:]
    assert render_prompt(tok, MESSAGES, max_len=10_000) == full


def test_refusals(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="no messages left"):
        render_prompt(tok, MESSAGES[:1], drop_system=True)
    with pytest.raises(ValueError, match="max_len"):
        render_prompt(tok, MESSAGES, max_len=0)
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        render_prompt(bare, MESSAGES)
