"""The update on given rows in one process: the skip rule for large gradient norms."""

from __future__ import annotations

from pathlib import Path

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
