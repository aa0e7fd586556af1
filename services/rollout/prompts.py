"""Turning chat messages into prompt token ids: one rule for the trainer, the workers and evaluation.

The prompt is the model's own chat template applied to the messages with the generation prompt,
rendered as text first and then tokenised without extra special tokens (the template already
holds them). Rendering and tokenising in two steps keeps the ids identical to what a text-based
engine would see. Prompts longer than `max_len` tokens are cut from the left, so the end of the
conversation and the generation prompt stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["ChatTokenizer", "render_prompt", "render_prompt_text"]


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


def _messages(messages: Sequence[Any], drop_system: bool) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for m in messages:
        if isinstance(m, Mapping):
            role, content = m["role"], m["content"]
        else:  # exgrpo_client.schemas.ChatMessage or anything with role/content attributes
            role, content = m.role, m.content
        if drop_system and role == "system":
            continue
        out.append({"role": str(role), "content": str(content)})
    if not out:
        raise ValueError("no messages left to render (only system messages, and drop_system is on)")
    return out


def render_prompt_text(tokenizer: ChatTokenizer, messages: Sequence[Any], drop_system: bool = False) -> str:
    """The chat template applied to `messages` with the generation prompt, as text."""
    if getattr(tokenizer, "chat_template", "") is None:
        raise ValueError("the tokenizer has no chat template: add one to tokenizer_config.json")
    text = tokenizer.apply_chat_template(
        _messages(messages, drop_system), add_generation_prompt=True, tokenize=False
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
    return text


def render_prompt(
    tokenizer: ChatTokenizer,
    messages: Sequence[Any],
    drop_system: bool = False,
    max_len: int | None = None,
) -> list[int]:
    """Prompt token ids of `messages` (dicts or `ChatMessage`s with role and content).

    `drop_system` removes system messages first (the evaluation protocol does, training keeps
    them); `max_len` keeps only the last `max_len` tokens.
    """
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    text = render_prompt_text(tokenizer, messages, drop_system)
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if max_len is not None and len(ids) > max_len:
        ids = ids[-max_len:]
    return ids
