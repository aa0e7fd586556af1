"""Tiny causal LMs in Hugging Face format, built from a config with a character-level tokenizer
and a think-then-answer chat template. Used by tests and as the starting point of the CPU demo."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL = ["<pad>", "<|eos|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)


def _byte_level(ch: str) -> str:
    """`ch` as the byte-level alphabet writes it (printable ASCII is itself, " " is "Ġ", "\n" "Ċ")."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ch)[0][0]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of `CHARS`, plus the special tokens.

    It is a byte-level BPE without merges: `AutoTokenizer` reloads a saved Qwen2 folder as a
    `Qwen2Tokenizer`, which rebuilds the pipeline as byte-level BPE from the saved vocabulary, so the
    vocabulary is written in the byte-level alphabet and the reloaded tokenizer gives the same ids."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in CHARS:
        vocab.setdefault(_byte_level(ch), len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<|eos|>",
        unk_token="<unk>",
        bos_token=None,
        additional_special_tokens=SPECIAL[3:],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen2(
    *,
    vocab_size: int,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 1024,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A random-init Qwen2 of the given size (tied embeddings, no BOS), seeded, in eval mode."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    return Qwen2ForCausalLM(config).eval()


def build_tiny_model(
    out: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 1024,
    seed: int = 0,
) -> Path:
    """A random-init Qwen2 and its tokenizer, saved to `out` (loads with AutoModelForCausalLM)."""
    tok = build_tokenizer()
    model = tiny_qwen2(
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        max_positions=max_positions,
        seed=seed,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
