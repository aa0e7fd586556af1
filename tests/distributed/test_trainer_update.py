"""The update on given rows in one process: the skip rule for large gradient norms, and the
decoupled update of asynchronous generation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from exgrpo_trainer.model import full_state_dict
from exgrpo_trainer.trainer import Trainer

from ._equivalence_worker import fixed_rows, learn_rows, row_config


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in full_state_dict(trainer.learner.model).items()}


def test_gradient_norm_above_the_bound_skips_the_step(tiny_model: Path, tmp_path: Path) -> None:
    trainer = Trainer(row_config(tiny_model, tmp_path / "out", "optim.skip_grad_above=1e-9"))
    try:
        rows = fixed_rows(trainer.tokenizer, replay=True)
        before = _weights(trainer)
        _, _, metrics = learn_rows(trainer, rows, mixed=True)
        assert metrics["optim/skipped"] == 3.0  # every mini-batch
        assert metrics["optim/grad_norm"] > 1e-9
        after = _weights(trainer)
        assert all(torch.equal(before[k], after[k]) for k in before), "skipped steps change nothing"
        assert not trainer.learner.optimizer.state, "no optimizer step was taken"
        assert all(p.grad is None for p in trainer.learner.model.parameters()), "gradients are cleared"

        trainer.cfg.optim.skip_grad_above = 500.0
        _, _, metrics = learn_rows(trainer, rows, mixed=True)
        assert metrics["optim/skipped"] == 0.0
        moved = _weights(trainer)
        assert any(not torch.equal(after[k], moved[k]) for k in after)
    finally:
        trainer.close()


def test_decoupled_update_with_the_samplers_log_probs_equal_to_pi_old_is_the_synchronous_one(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Asynchronous mode's update (`decoupled`): the fresh rows' sampler log-probs reach the loss as
    the behaviour policy; when they equal pi_old (a sampler on the trainer's own weights) every
    behaviour weight is 1 and the update is the synchronous one, weight for weight."""
    plain, decoupled = (Trainer(row_config(tiny_model, tmp_path / name)) for name in ("plain", "decoupled"))
    try:
        rows = fixed_rows(plain.tokenizer, replay=True)
        with pytest.raises(ValueError, match="generated rows have no sampler log-probs"):
            decoupled.learner.learn(rows, mixed=True, step=1, decoupled=True)
        assert not decoupled.learner.optimizer.state, "nothing was updated"

        reference = plain.learner.learn(rows, mixed=True, step=1)
        sampled = [
            row if row.replayed else dataclasses.replace(row, behaviour_logprobs=lp)
            for row, lp in zip(rows, reference.old_logprobs, strict=True)
        ]
        learned = decoupled.learner.learn(sampled, mixed=True, step=1, decoupled=True)
        assert learned.old_logprobs == reference.old_logprobs
        assert learned.metrics["actor/behav_weight_mean"] == 1.0 == learned.metrics["actor/behav_weight_max"]
        assert learned.metrics["loss/total"] == reference.metrics["loss/total"]
        after, expected = _weights(decoupled), _weights(plain)
        assert all(torch.equal(after[k], expected[k]) for k in expected)
        assert "actor/behav_weight_mean" not in reference.metrics  # the synchronous call has none
    finally:
        plain.close()
        decoupled.close()
