"""The supervised warm start: a quick model saves in Hugging Face format with its tokenizer, chat
template and report, loads the way the trainer loads it, and writes well-formed answers; training
is deterministic in the seed; a folder built from the same recipe is reused."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from exgrpo_onebox.synthetic import direct_response, is_heldout, make_problems, reference_response
from exgrpo_onebox.tiny import build_tokenizer
from exgrpo_onebox.warmstart import QUICK, RECIPE, build_model, heldout_problems, prepare_model, train_sft
from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.graders import grade_one
from exgrpo_rollout.prompts import render_prompt
from exgrpo_trainer.model import load_tokenizer

WELL_FORMED = re.compile(r"(?s)[^<]*</think> \\boxed\{\d+\}<\|eos\|>")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return prepare_model(tmp_path_factory.mktemp("warm") / "model", quick=True)


def test_quick_model_folder_and_report(quick_model: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (quick_model / name).is_file(), name
    info = json.loads((quick_model / "warmstart.json").read_text())
    assert info["seed"] == 0 and info["recipe"] == QUICK.to_dict()
    assert info["parameters"] > 0 and info["train_seconds"] > 0
    assert info["loss_last"] < info["loss_first"]
    for temp in ("t1", "t0.6"):
        acc = info["accuracy"][temp]
        assert {"arith_d1", "arith_d2", "arith_d3", "arith_d4", "all", "well_formed", "direct"} <= set(acc)
        assert all(0.0 <= v <= 1.0 for v in acc.values())


def test_reloaded_tokenizer_matches_the_training_one(quick_model: Path) -> None:
    tok = load_tokenizer(quick_model)  # the trainer's loader (AutoTokenizer)
    fresh = build_tokenizer()
    p = make_problems(1, seed=0, mix=3)[0]
    messages = [{"role": "user", "content": p.expression}]
    assert render_prompt(tok, messages) == render_prompt(fresh, messages)
    assert render_prompt(tok, messages)[-3:] == [
        tok.convert_tokens_to_ids(t) for t in ("<|assistant|>", "<think>", "Ċ")
    ]
    for text in (reference_response(p), direct_response(p)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == fresh(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.chat_template == fresh.chat_template


def test_quick_model_writes_well_formed_answers(quick_model: Path) -> None:
    tok = load_tokenizer(quick_model)
    model = AutoModelForCausalLM.from_pretrained(quick_model, dtype=torch.float32).eval()
    problems = heldout_problems(per_level=4)
    prompts = [render_prompt(tok, [{"role": "user", "content": p.expression}]) for p in problems]
    engine = TransformersEngine(model, tok)
    out = engine.generate(prompts, SamplingConfig(n=2, temperature=0.6, max_new_tokens=96, seed=0))
    texts = [c.text for cs in out for c in cs]
    well_formed = [t for t in texts if WELL_FORMED.fullmatch(t)]
    assert len(well_formed) >= 0.8 * len(texts), texts[:4]
    rewards = [
        grade_one("arithmetic", c.text, str(p.answer), timeout_s=None).reward
        for p, cs in zip(problems, out, strict=True)
        for c in cs
    ]
    assert set(rewards) <= {0.0, 1.0}


def test_same_seed_same_weights() -> None:
    recipe = dataclasses.replace(QUICK, steps=4, batch_size=8)
    weights = []
    for _ in range(2):
        model, tok = build_model(recipe, seed=3)
        losses = train_sft(model, tok, recipe, seed=3)
        assert len(losses) == 4
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    other, tok = build_model(recipe, seed=4)
    train_sft(other, tok, recipe, seed=4)
    assert not torch.equal(other.state_dict()["model.norm.weight"], weights[0]["model.norm.weight"])


def test_a_folder_from_the_same_recipe_is_reused(tmp_path: Path) -> None:
    recipe = dataclasses.replace(QUICK, steps=2, batch_size=4)
    out = prepare_model(tmp_path / "m", recipe=recipe, evaluate=False)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert prepare_model(tmp_path / "m", recipe=recipe, evaluate=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # another recipe (or seed) rebuilds the folder
    prepare_model(tmp_path / "m", recipe=recipe, seed=1, evaluate=False)
    assert json.loads((out / "warmstart.json").read_text())["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_folder_with_other_files_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        prepare_model(tmp_path, recipe=dataclasses.replace(QUICK, steps=1), evaluate=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_heldout_problems_are_never_supervised() -> None:
    held = heldout_problems()
    assert len(held) == 200 and all(is_heldout(p.expression) for p in held)
    assert {p.difficulty for p in held} == set(RECIPE.mix)
