"""Supervised warm start of a tiny model on the synthetic arithmetic task (`exgrpo_onebox.synthetic`).

A random-init tiny Qwen2 (130k parameters) with the character tokenizer of `exgrpo_onebox.tiny` is
trained with cross-entropy on response tokens only (the prompt is context) for a fixed budget, so
that it starts reinforcement learning with partial success and room to improve.

The supervised examples mix two ways of answering a problem of the training partition: the
step-by-step trace (`synthetic.reference_response`) and, for `direct_share` of them, a direct answer
with an empty think block (`synthetic.direct_response`). The warm-started model thus answers about
half the questions without reasoning, which is right for most one-step problems and rarely for
longer chains, and the rest step by step with an error rate that grows with the chain. RL learns
from the reward alone that reasoning pays: one decision shared by every question, so held-out
accuracy rises within a few dozen steps. (Without the direct answers the model's errors are
individual arithmetic facts, and 60-150 RL steps of this size left held-out accuracy unchanged:
fixing facts from a binary reward is too slow for a few minutes on 2 cores.)

    from exgrpo_onebox.warmstart import prepare_model
    path = prepare_model("exgrpo-data/models/arith-warm")          # ~70 s on 2 shared CPU cores
    path = prepare_model("/tmp/arith-quick", quick=True)            # ~8 s, for tests

The folder is a Hugging Face model (config, safetensors, tokenizer with its chat template) plus
`warmstart.json`: the recipe, the held-out accuracy per difficulty at temperatures 1.0 and 0.6, and
the time it took. `prepare_model` skips the work when the folder already holds a model built from
the same recipe and seed. Training is deterministic in the seed on a given machine and thread
count. On a shared 2-core machine run it with one torch thread (`torch.set_num_threads(1)`): more
threads slow a model this small down several times over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from exgrpo_onebox.synthetic import (
    Problem,
    direct_response,
    make_problems,
    problem_stream,
    reference_response,
)
from exgrpo_onebox.tiny import build_tokenizer
from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.evaluate import EvalRow
from exgrpo_rollout.evaluate import evaluate as evaluate_rows  # `evaluate` is prepare_model's flag

__all__ = [
    "QUICK",
    "RECIPE",
    "WarmStartRecipe",
    "build_model",
    "evaluate_accuracy",
    "heldout_problems",
    "prepare_model",
    "train_sft",
]

log = logging.getLogger("exgrpo.warmstart")
MANIFEST = "warmstart.json"
FORMAT_VERSION = 3
"""Bump when the data, the model or the training procedure change in a way the recipe does not show."""


@dataclass(frozen=True)
class WarmStartRecipe:
    # model
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    max_positions: int = 256
    # supervised training
    steps: int = 1200
    batch_size: int = 32
    micro_batches: int = 2
    """Each batch is sorted by length and cut in this many forward/backward passes (less padding)."""
    direct_share: float = 0.5
    """Share of the supervised examples that answer without reasoning (`synthetic.direct_response`)."""
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    mix: dict[int, float] = field(default_factory=lambda: {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    # evaluation
    eval_per_level: int = 50
    eval_max_new_tokens: int = 96

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["mix"] = {str(k): v for k, v in self.mix.items()}
        return data


RECIPE = WarmStartRecipe()
"""The default warm start (see the report in `warmstart.json` for its measured accuracy)."""
QUICK = dataclasses.replace(RECIPE, steps=150, warmup_steps=10, eval_per_level=8)
"""The same model after ~8 s of training: well-formed answers, little accuracy (tests, smoke runs)."""


def heldout_problems(per_level: int = 50, seed: int = 0) -> list[Problem]:
    """Evaluation problems of levels 1-4 from the held-out partition (never a supervised trace,
    never a training question): `per_level` of each level (level 1 has 73 held-out problems; past
    that, level 2 takes the rest of its share)."""
    return make_problems(4 * per_level, seed, [1, 2, 3, 4], split="heldout")


def build_model(recipe: WarmStartRecipe, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A random-init Qwen2 of the recipe's size and the character tokenizer."""
    tok = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return Qwen2ForCausalLM(config), tok


# ------------------------------------------------------------------------------------- SFT
def _encode(tok: PreTrainedTokenizerBase, problem: Problem, direct: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + EOS) of the reference trace or of the direct answer."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": problem.expression}], add_generation_prompt=True, tokenize=False
    )
    prompt = list(tok(text, add_special_tokens=False)["input_ids"])
    text = direct_response(problem) if direct else reference_response(problem)
    response = list(tok(text, add_special_tokens=False)["input_ids"])
    return prompt, [*response, int(tok.eos_token_id)]


def _batch(
    pairs: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        seq = p + r
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(r)
    return ids, mask, labels


def train_sft(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, recipe: WarmStartRecipe, seed: int
) -> list[float]:
    """Cross-entropy on the response tokens of a stream of problems of the training partition
    (levels drawn from `recipe.mix`), answered step by step or, for `recipe.direct_share` of them,
    directly; returns the loss of every step."""
    torch.manual_seed(seed)
    stream = problem_stream(seed, recipe.mix, split="train")
    coin = random.Random(f"direct-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        frac = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    for _ in range(recipe.steps):
        pairs = sorted(
            (
                _encode(tok, next(stream), coin.random() < recipe.direct_share)
                for _ in range(recipe.batch_size)
            ),
            key=lambda x: len(x[0]) + len(x[1]),
        )
        num_tokens = sum(len(r) for _, r in pairs)
        per = math.ceil(len(pairs) / recipe.micro_batches)
        total = 0.0
        for i in range(0, len(pairs), per):
            chunk = pairs[i : i + per]
            ids, mask, labels = _batch(chunk, tok.pad_token_id)
            # the model's loss is a token mean over the chunk: weight it to a mean over the batch
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss = loss * (sum(len(r) for _, r in chunk) / num_tokens)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    model.eval()
    return losses


# -------------------------------------------------------------------------------- evaluation
def evaluate_accuracy(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    *,
    temperature: float = 1.0,
    samples: int = 1,
    max_new_tokens: int = 96,
    seed: int = 1234,
    grader: str = "arithmetic",
) -> dict[str, float]:
    """Mean reward of `samples` sampled responses per problem, per data source (`arith_d<level>`)
    and overall (`all`), with the transformers engine and a named grader; also the share of
    well-formed responses (think block closed, not truncated) and of direct answers (no reasoning)."""
    rows = [
        EvalRow(p.data_source, i, [{"role": "user", "content": p.expression}], str(p.answer))
        for i, p in enumerate(problems)
        for _ in range(samples)
    ]
    was_training = model.training
    model.eval()
    engine = TransformersEngine(model, tok, max_batch_rows=512)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    records = evaluate_rows(engine, tok, rows, sampling=sampling, grader=grader, prompts_per_call=256)
    model.train(was_training)
    by_source: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_source[r.data_source].append(r.reward)
    out = {ds: sum(v) / len(v) for ds, v in sorted(by_source.items())}
    out["all"] = sum(r.reward for r in records) / len(records)
    out["well_formed"] = sum(
        r.reason != "no_think_close" and r.finish_reason == "stop" for r in records
    ) / len(records)
    out["direct"] = sum(r.response.startswith("</think>") for r in records) / len(records)
    return out


# ------------------------------------------------------------------------------ the entry point
def _manifest_matches(out: Path, recipe: WarmStartRecipe, seed: int) -> bool:
    try:
        data = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        data.get("format_version") == FORMAT_VERSION
        and data.get("seed") == seed
        and data.get("recipe") == recipe.to_dict()
        and (out / "model.safetensors").is_file()
    )


def prepare_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    quick: bool = False,
    recipe: WarmStartRecipe | None = None,
    evaluate: bool = True,
) -> Path:
    """A warm-started model in `out_dir` (built unless it is already there from the same recipe
    and seed). Returns the folder; its `warmstart.json` holds the recipe and measured accuracy."""
    out = Path(out_dir)
    recipe = recipe or (QUICK if quick else RECIPE)
    if _manifest_matches(out, recipe, seed):
        log.info("warm-started model in %s is up to date", out)
        return out
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise ValueError(f"{out} is not empty and holds no warm-started model: give an empty or new folder")
    start = time.perf_counter()
    model, tok = build_model(recipe, seed)
    losses = train_sft(model, tok, recipe, seed)
    train_s = time.perf_counter() - start
    report: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "recipe": recipe.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_s, 1),
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
    }
    if evaluate:
        t = time.perf_counter()
        subset = heldout_problems(recipe.eval_per_level)
        report["accuracy"] = {
            f"t{temp:g}": evaluate_accuracy(
                model, tok, subset, temperature=temp, max_new_tokens=recipe.eval_max_new_tokens
            )
            for temp in (1.0, 0.6)
        }
        report["eval_seconds"] = round(time.perf_counter() - t, 1)
    # written next to the target and renamed into place: a reader never sees half a model
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    (tmp / MANIFEST).write_text(json.dumps(report, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("warm start: %s", json.dumps(report))
    return out
