"""The KL term to a reference model, and activation checkpointing, on the real trainer.

- kl_coeff = 0 loads no reference model; kl_coeff > 0 loads `model.reference_path` frozen and the
  step's KL is the k3 estimator between the policy and that model, token mean over the mini-batch,
  added to the loss with its coefficient.
- With activation checkpointing the update computes the same losses and weights, and autograd
  keeps far fewer activations for backward.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from exgrpo_trainer.model import full_state_dict, pad_rows, response_forward
from exgrpo_trainer.trainer import Trainer

from ._equivalence_worker import fixed_rows, learn_rows, row_config


def _perturbed_copy(src: Path, dst: Path, scale: float = 0.05) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    noisy = {
        k: v + scale * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
        for k, v in weights.items()
    }
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_no_reference_model_without_kl(tiny_model: Path, tmp_path: Path) -> None:
    trainer = Trainer(row_config(tiny_model, tmp_path / "out", "optim.mini_batches=1"))
    try:
        assert trainer.learner.ref_model is None
        _, _, metrics = learn_rows(trainer, fixed_rows(trainer.tokenizer, replay=False), mixed=False)
        assert metrics["loss/kl"] == 0.0
    finally:
        trainer.close()


def test_kl_to_the_reference_model_is_the_k3_estimator(tiny_model: Path, tmp_path: Path) -> None:
    ref = _perturbed_copy(tiny_model, tmp_path / "ref")
    cfg = row_config(
        tiny_model,
        tmp_path / "out",
        "optim.mini_batches=1",
        "optim.micro_batch_tokens=100000",  # one micro-batch: the step's KL is one token mean
        "loss.kl_coeff=0.5",
        f"model.reference_path={ref}",
    )
    trainer = Trainer(cfg)
    try:
        assert trainer.learner.ref_model is not None
        assert not any(p.requires_grad for p in trainer.learner.ref_model.parameters())
        ref_before = {k: v.clone() for k, v in full_state_dict(trainer.learner.ref_model).items()}
        rows = fixed_rows(trainer.tokenizer, replay=False)
        prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
        lp, _ = trainer.learner.score(prompts, responses, with_entropy=False)
        ref_lp, _ = trainer.learner.score(
            prompts, responses, with_entropy=False, model=trainer.learner.ref_model
        )
        expected = []
        for a, b in zip(lp, ref_lp, strict=True):
            d = torch.tensor(b, dtype=torch.float64) - torch.tensor(a, dtype=torch.float64)
            expected.append(d.exp() - d - 1.0)
        kl = float(torch.cat(expected).mean())
        assert kl > 1e-3  # the perturbed reference differs

        _, _, metrics = learn_rows(trainer, rows, mixed=False)
        assert abs(metrics["actor/kl"] - kl) < 1e-5 * max(1.0, kl)
        assert abs(metrics["loss/kl"] - 0.5 * kl) < 1e-5
        assert "timing/ref_logprob" not in metrics  # timings are reported by train_step, not learn
        assert trainer.timer.parts["ref_logprob"] > 0
        # the reference stays frozen while the policy moves
        for k, v in full_state_dict(trainer.learner.ref_model).items():
            torch.testing.assert_close(v, ref_before[k], rtol=0, atol=0)
    finally:
        trainer.close()


def _update_once(
    model_dir: Path, out: Path, checkpointing: bool
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    flag = f"model.activation_checkpointing={str(checkpointing).lower()}"
    trainer = Trainer(row_config(model_dir, out, flag, "optim.mini_batches=2"))
    try:
        _, _, metrics = learn_rows(trainer, fixed_rows(trainer.tokenizer, replay=True), mixed=True)
        return metrics, {k: v.clone() for k, v in full_state_dict(trainer.learner.model).items()}
    finally:
        trainer.close()


def test_activation_checkpointing_same_update(tiny_model: Path, tmp_path: Path) -> None:
    m_plain, w_plain = _update_once(tiny_model, tmp_path / "plain", False)
    m_ckpt, w_ckpt = _update_once(tiny_model, tmp_path / "ckpt", True)
    for key in ("loss/total", "loss/pg", "actor/entropy", "optim/grad_norm"):
        assert abs(m_plain[key] - m_ckpt[key]) <= 1e-6 * max(1.0, abs(m_plain[key])), key
    for k, v in w_plain.items():
        torch.testing.assert_close(w_ckpt[k], v, rtol=1e-5, atol=1e-6)


def _saved_bytes(trainer: Trainer) -> int:
    """Bytes autograd keeps for backward during one training forward of a fixed micro-batch."""
    rows = fixed_rows(trainer.tokenizer, replay=False)
    ids, att, rids, _mask, pos = pad_rows(
        [r.prompt_ids for r in rows], [r.response_ids for r in rows], trainer.learner.pad_id, trainer.device
    )
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = response_forward(trainer.learner.model, ids, att, rids, pos, with_entropy=True)
    lp.sum().backward()
    trainer.learner.optimizer.zero_grad(set_to_none=True)
    return total


def test_activation_checkpointing_keeps_fewer_activations(tiny_model: Path, tmp_path: Path) -> None:
    sizes = {}
    for flag in (False, True):
        trainer = Trainer(
            row_config(
                tiny_model, tmp_path / str(flag), f"model.activation_checkpointing={str(flag).lower()}"
            )
        )
        try:
            sizes[flag] = _saved_bytes(trainer)
        finally:
            trainer.close()
    assert sizes[True] < 0.5 * sizes[False], sizes
