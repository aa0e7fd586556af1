"""Work the trainer saves, checked against the long way round: the first mini-batch of a step takes
its old log-probs and entropies from its own update forward (equal to a no-grad forward on the same
weights); a mixed step generates fresh and replayed questions in one call; generation runs on a
hook-free view of the gathered FSDP2 weights (equal to generating with the plain model)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_trainer.algo import PlannedQuestion, Response
from exgrpo_trainer.batch import StepBatch
from exgrpo_trainer.model import full_state_dict, unsharded
from exgrpo_trainer.trainer import Trainer

from ._equivalence_worker import fixed_rows, learn_rows, row_config


@pytest.mark.parametrize("mini_batches", [1, 3], ids=["one-mini-batch", "three-mini-batches"])
def test_old_logprobs_equal_a_separate_no_grad_forward(
    tiny_model: Path, tmp_path: Path, mini_batches: int
) -> None:
    trainer = Trainer(row_config(tiny_model, tmp_path / "out", f"optim.mini_batches={mini_batches}"))
    try:
        rows = fixed_rows(trainer.tokenizer, replay=True)
        ref_lp, ref_ent = trainer.learner.score(
            [r.prompt_ids for r in rows], [r.response_ids for r in rows], with_entropy=True
        )
        seen: list[str] = []
        score = trainer.learner.score

        def counting_score(*args: Any, **kwargs: Any) -> Any:
            seen.append("score")
            return score(*args, **kwargs)

        trainer.learner.score = counting_score  # type: ignore[method-assign]
        old_lp, old_ent, metrics = learn_rows(trainer, rows, mixed=True)
        assert seen == ([] if mini_batches == 1 else ["score"]), "a no-grad pass only for later mini-batches"
        assert metrics["optim/skipped"] == 0.0
        assert len(old_lp) == len(old_ent) == len(rows)
        for i, row in enumerate(rows):
            assert len(old_lp[i]) == len(old_ent[i]) == len(row.response_ids)
            torch.testing.assert_close(torch.tensor(old_lp[i]), torch.tensor(ref_lp[i]), rtol=0, atol=1e-6)
            torch.testing.assert_close(torch.tensor(old_ent[i]), torch.tensor(ref_ent[i]), rtol=0, atol=1e-6)
    finally:
        trainer.close()


def test_mixed_step_generates_k_minus_one_and_k_samples_in_one_call(tiny_model: Path, tmp_path: Path) -> None:
    trainer = Trainer(row_config(tiny_model, tmp_path / "out", "rollout.min_new_tokens=2"))
    try:
        rows = fixed_rows(trainer.tokenizer, groups=4, k=4, replay=False)
        prompts = [rows[g * 4].prompt_ids for g in range(4)]
        stored = Response(response_ids=[5, 6, 7], reward=1.0, logprobs=[-1.0, -1.0, -1.0])
        questions = [
            PlannedQuestion(question_id=10 + i, prompt_ids=p, replay=stored if i % 2 else None)
            for i, p in enumerate(prompts)
        ]
        calls: list[int] = []
        generate = trainer.rollouts.engine.generate

        def counting_generate(prompt_ids: list[list[int]], sampling: Any) -> Any:
            calls.append(len(prompt_ids))
            assert sampling.n == 1
            return generate(prompt_ids, sampling)

        trainer.rollouts.engine.generate = counting_generate  # type: ignore[method-assign]
        plan = SimpleNamespace(step=3, k=4)  # what generation reads of a plan
        batch = StepBatch(plan=plan, questions=questions, ground_truths=[""] * 4)  # type: ignore[arg-type]
        out = trainer.rollouts.generate(batch)
        assert calls == [4 + 3 + 4 + 3], "one call, one row per sample"
        assert [len(cs) for cs in out.samples] == [4, 3, 4, 3]
        assert out.versions is None and out.entropies is None  # the trainer's own weights
        for cs in out.samples:
            assert all(len(c.token_ids) >= 2 and c.logprobs == [] for c in cs)
    finally:
        trainer.close()


def test_generation_view_samples_what_the_plain_model_samples(tiny_model: Path, tmp_path: Path) -> None:
    trainer = Trainer(row_config(tiny_model, tmp_path / "out"))
    try:
        rows = fixed_rows(trainer.tokenizer, groups=3, k=2, replay=False)
        prompts = [rows[0].prompt_ids, rows[2].prompt_ids, rows[4].prompt_ids]
        sampling = SamplingConfig(n=2, temperature=0.8, max_new_tokens=6, min_new_tokens=6, seed=3)
        plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        reference = TransformersEngine(plain, trainer.tokenizer, record=False)
        for _ in range(2):  # the view follows the weights after an update
            with unsharded(trainer.learner.model) as view, torch.no_grad():
                assert view is trainer.rollouts.engine.model and not isinstance(view, FSDPModule)
                got = trainer.rollouts.engine.generate(prompts, sampling)
            plain.load_state_dict(full_state_dict(trainer.learner.model))
            want = reference.generate(prompts, sampling)
            assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in want]
            learn_rows(trainer, rows, mixed=False)
        # outside `unsharded` the gathered weights are freed: the view keeps no copy of its own
        view_bytes = sum(p.untyped_storage().nbytes() for p in trainer.rollouts.engine.model.parameters())
        assert view_bytes == 0
    finally:
        trainer.close()
