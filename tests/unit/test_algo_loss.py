"""The ExGRPO policy loss (spec 6, quirks Q6/Q7, TV5-TV7) and its per-token inputs."""

from __future__ import annotations

import math

import pytest
import torch

from exgrpo_trainer.algo import ExGRPOLoss, LossConfig, token_entropy, token_logprobs

REQUIRED_METRICS = {
    "loss/total",
    "loss/pg",
    "loss/pg_fresh",
    "loss/pg_replay",
    "loss/entropy",
    "loss/kl",
    "actor/entropy",
    "is/w_mean",
    "is/w_max",
    "is/w_min",
    "is/fw_mean",
    "actor/ratio_clipped_frac",
    "actor/ratio_mean",
    "tokens/fresh",
    "tokens/replay",
}


def _loss(**overrides: object) -> ExGRPOLoss:
    settings: dict[str, object] = {"normalizer": 1.0, "entropy_coeff": 0.0}
    settings.update(overrides)
    return LossConfig(**settings).build()  # type: ignore[arg-type]  # LossConfig checks the values


def _scalar(value: float, *, grad: bool = False) -> torch.Tensor:
    return torch.tensor([[value]], dtype=torch.float64, requires_grad=grad)


# --------------------------------------------------------------------------- TV5: shaped replay weight


@pytest.mark.parametrize(
    ("pi", "pi_past", "w", "f", "multiplier"),
    [
        (0.3, 0.6, 0.5, 0.833333, 0.138889),
        (0.6, 0.6, 1.0, 0.909091, 0.082645),
        (0.9, 0.3, 3.0, 0.967742, 0.031217),
        (0.03, 0.3, 0.1, 0.5, 0.25),
    ],
    ids=["w=0.5", "w=1", "w=3", "w=beta"],
)
def test_tv5_shaped_weight_and_its_gradient(
    pi: float, pi_past: float, w: float, f: float, multiplier: float
) -> None:
    lp = _scalar(math.log(pi), grad=True)
    loss, metrics = _loss()(
        lp,
        old_logprobs=_scalar(0.0),  # ignored for replayed tokens when exp_is_correct
        past_logprobs=_scalar(math.log(pi_past)),
        advantages=torch.ones(1, dtype=torch.float64),
        loss_mask=torch.ones(1, 1, dtype=torch.bool),
        replay_mask=torch.ones(1, 1, dtype=torch.bool),
        mixed_phase=True,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-f, abs=1e-6)
    assert lp.grad is not None
    assert -float(lp.grad) == pytest.approx(multiplier, abs=1e-6)
    assert -float(lp.grad) == pytest.approx(0.1 * w / (w + 0.1) ** 2, rel=1e-12)
    assert metrics["is/w_mean"] == metrics["is/w_max"] == metrics["is/w_min"] == pytest.approx(w)
    assert metrics["is/fw_mean"] == pytest.approx(f, abs=1e-6)
    assert metrics["tokens/replay"] == 1.0 and metrics["tokens/fresh"] == 0.0
    assert metrics["loss/pg_replay"] == pytest.approx(-f, abs=1e-6) and metrics["loss/pg_fresh"] == 0.0


def test_replay_shaping_is_never_clipped_or_capped() -> None:
    lp = _scalar(math.log(0.9), grad=True)
    loss, _ = _loss(clip_after_switch=True, clip_before_switch=True)(
        lp,
        old_logprobs=_scalar(0.0),
        past_logprobs=_scalar(-200.0),  # w = e^200 * 0.9: the sigmoid form stays exact
        advantages=torch.ones(1, dtype=torch.float64),
        loss_mask=torch.ones(1, 1, dtype=torch.bool),
        replay_mask=torch.ones(1, 1, dtype=torch.bool),
        mixed_phase=False,
    )
    loss.backward()
    assert lp.grad is not None
    assert loss.item() == pytest.approx(-1.0) and torch.isfinite(lp.grad).all()


# --------------------------------------------------------------------------- TV6: fresh tokens per phase


@pytest.mark.parametrize(
    ("advantage", "ratio", "mixed_phase", "expected"),
    [
        (1.0, 1.5, False, -1.2),
        (1.0, 1.5, True, -1.5),
        (-1.0, 0.5, False, 0.8),
        (-1.0, 0.5, True, 0.5),
        (1.0, 0.5, False, -0.5),
        (1.0, 0.5, True, -0.5),
    ],
    ids=["A+r1.5-clip", "A+r1.5-mixed", "A-r0.5-clip", "A-r0.5-mixed", "A+r0.5-clip", "A+r0.5-mixed"],
)
def test_tv6_fresh_token_clipping_follows_the_phase(
    advantage: float, ratio: float, mixed_phase: bool, expected: float
) -> None:
    loss, metrics = _loss()(
        _scalar(math.log(ratio)),
        old_logprobs=_scalar(0.0),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        loss_mask=torch.ones(1, 1, dtype=torch.bool),
        mixed_phase=mixed_phase,
    )
    assert loss.item() == pytest.approx(expected)
    assert metrics["actor/ratio_mean"] == pytest.approx(ratio)
    # the clip binds (or would bind, in the mixed phase) exactly in the first four cases
    assert metrics["actor/ratio_clipped_frac"] == (0.0 if advantage * (ratio - 1) < 0 else 1.0)


def test_phase_flags_and_upper_bound_are_configurable() -> None:
    def fresh_loss(loss: ExGRPOLoss, mixed_phase: bool) -> float:
        value, _ = loss(
            _scalar(math.log(1.5)),
            old_logprobs=_scalar(0.0),
            advantages=torch.ones(1),
            loss_mask=torch.ones(1, 1, dtype=torch.bool),
            mixed_phase=mixed_phase,
        )
        return value.item()

    assert fresh_loss(_loss(clip_after_switch=True), True) == pytest.approx(-1.2)
    assert fresh_loss(_loss(clip_before_switch=False), False) == pytest.approx(-1.5)
    assert fresh_loss(_loss(clip_upper_bound=1.4), False) == pytest.approx(-1.4)
    assert LossConfig(clip_eps=0.2, clip_upper_bound=1.4).clip_high == pytest.approx(1.4)
    assert LossConfig().clip_high == pytest.approx(1.2) and LossConfig().clip_low == pytest.approx(0.8)


def test_clipped_tokens_have_zero_gradient_before_the_switch() -> None:
    lp = torch.tensor([[math.log(1.5), math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = _loss()(
        lp,
        old_logprobs=torch.zeros(1, 2, dtype=torch.float64),
        advantages=torch.ones(1),
        loss_mask=torch.ones(1, 2, dtype=torch.bool),
        mixed_phase=False,
    )
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1.1])
    assert metrics["actor/ratio_clipped_frac"] == 0.5


# --------------------------------------------------------------------------- TV7: normalisation

TV7_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
TV7_ADV = torch.tensor([0.5, -0.25])  # ratio 1 -> token losses -0.5 and 0.25


def _tv7(config: dict[str, object]) -> float:
    loss, _ = _loss(**config)(
        torch.zeros(2, 4),
        old_logprobs=torch.zeros(2, 4),
        advantages=TV7_ADV,
        loss_mask=TV7_MASK,
        mixed_phase=True,
    )
    return loss.item()


def test_tv7_sum_over_tokens_divided_by_the_constant() -> None:
    assert _tv7({"normalizer": 4.0}) == pytest.approx(-0.25)  # a token mean would give -0.2


def test_default_normalizer_is_max_response_len_times_eight() -> None:
    assert LossConfig().effective_normalizer == 8192 * 8
    assert _tv7({"normalizer": None, "max_response_len": 4}) == pytest.approx(-0.25 / 8)


def test_micro_batch_gradients_sum_to_the_mini_batch_gradient() -> None:
    torch.manual_seed(0)
    lp = (torch.randn(4, 5, dtype=torch.float64) - 1).requires_grad_()
    entropy = torch.rand(4, 5, dtype=torch.float64).requires_grad_()
    inputs = {
        "old_logprobs": lp.detach() + 0.1 * torch.randn(4, 5, dtype=torch.float64),
        "past_logprobs": lp.detach() - torch.rand(4, 5, dtype=torch.float64),
        "advantages": torch.tensor([0.625, -0.375, 0.5, -0.5], dtype=torch.float64),
        "loss_mask": torch.tensor(
            [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
        ).bool(),
        "replay_mask": torch.tensor([[1] * 5, [0] * 5, [0] * 5, [1] * 5]).bool(),
    }
    loss_fn = _loss(entropy_coeff=0.01, normalizer=16.0)
    full, _ = loss_fn(lp, entropy=entropy, mixed_phase=True, **inputs)
    full_grads = torch.autograd.grad(full, [lp, entropy])
    num_tokens = int(inputs["loss_mask"].sum())
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 4)):
        part = {name: tensor[rows] for name, tensor in inputs.items()}
        value, _ = loss_fn(
            lp[rows], entropy=entropy[rows], mixed_phase=True, num_loss_tokens=num_tokens, **part
        )
        total = total + value
    split_grads = torch.autograd.grad(total, [lp, entropy])
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    for a, b in zip(full_grads, split_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_gradcheck_of_the_whole_loss_in_both_phases() -> None:
    torch.manual_seed(3)
    old = torch.randn(3, 4, dtype=torch.float64) - 1
    # ratios kept away from the clip boundaries, where the clipped surrogate has kinks
    lp = (old + 0.05 * torch.randn(3, 4, dtype=torch.float64)).requires_grad_()
    entropy = torch.rand(3, 4, dtype=torch.float64).requires_grad_()
    inputs = {
        "old_logprobs": old,
        "past_logprobs": old - 1.0,
        "ref_logprobs": old + 0.3,
        "advantages": torch.tensor([0.5, -0.25, 1.0], dtype=torch.float64),
        "loss_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool),
        "replay_mask": torch.tensor([[1] * 4, [0] * 4, [0] * 4], dtype=torch.bool),
    }
    loss_fn = _loss(entropy_coeff=0.01, kl_coeff=0.1, normalizer=3.0)
    for mixed_phase in (False, True):
        assert torch.autograd.gradcheck(
            lambda lp_, ent_, phase=mixed_phase: loss_fn(lp_, entropy=ent_, mixed_phase=phase, **inputs)[0],
            (lp, entropy),
        )


# --------------------------------------------------------------------------- behaviour policy, masks, extras


def test_exp_is_correct_false_divides_by_the_old_logprobs() -> None:
    kwargs = {
        "old_logprobs": _scalar(math.log(0.6)),
        "advantages": torch.ones(1),
        "loss_mask": torch.ones(1, 1, dtype=torch.bool),
        "replay_mask": torch.ones(1, 1, dtype=torch.bool),
        "mixed_phase": True,
    }
    lp = _scalar(math.log(0.3))
    loss, metrics = _loss(exp_is_correct=False)(lp, past_logprobs=_scalar(math.log(0.03)), **kwargs)
    assert loss.item() == pytest.approx(-0.5 / 0.6) and metrics["is/w_mean"] == pytest.approx(0.5)
    no_past, _ = _loss(exp_is_correct=False)(lp, past_logprobs=None, **kwargs)
    assert no_past.item() == loss.item()
    stored, _ = _loss()(lp, past_logprobs=_scalar(math.log(0.03)), **kwargs)
    assert stored.item() == pytest.approx(-10 / 10.1)  # w = 10 with the stored log-probs
    with pytest.raises(ValueError, match="past_logprobs is required"):
        _loss()(lp, past_logprobs=None, **kwargs)


def test_masked_tokens_contribute_nothing_even_when_they_hold_garbage() -> None:
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    replay = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    base = {
        "lp": torch.randn(2, 4, dtype=torch.float64) - 1,
        "old_logprobs": torch.randn(2, 4, dtype=torch.float64) - 1,
        "past_logprobs": torch.randn(2, 4, dtype=torch.float64) - 1,
        "advantages": torch.tensor([[0.5] * 4, [-0.5] * 4], dtype=torch.float64),
        "entropy": torch.rand(2, 4, dtype=torch.float64),
        "ref_logprobs": torch.randn(2, 4, dtype=torch.float64) - 1,
    }
    garbage = {
        name: t.masked_fill(~mask, value) for (name, t), value in zip(base.items(), _GARBAGE, strict=True)
    }
    loss_fn = _loss(entropy_coeff=0.01, kl_coeff=0.1)
    results = []
    for inputs in (base, garbage):
        lp = inputs["lp"].clone().requires_grad_()
        entropy = inputs["entropy"].clone().requires_grad_()
        others = {k: v for k, v in inputs.items() if k not in ("lp", "entropy")}
        loss, metrics = loss_fn(
            lp, entropy=entropy, loss_mask=mask, replay_mask=replay, mixed_phase=True, **others
        )
        loss.backward()
        assert lp.grad is not None and entropy.grad is not None
        assert (
            torch.isfinite(loss)
            and bool((lp.grad[~mask] == 0).all())
            and bool((entropy.grad[~mask] == 0).all())
        )
        results.append((loss.item(), lp.grad, metrics))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]
    assert results[0][2]["tokens/replay"] == 2.0 and results[0][2]["tokens/fresh"] == 3.0


_GARBAGE = (float("nan"), float("inf"), -float("inf"), float("nan"), float("nan"), 1e30)


def test_entropy_bonus_is_a_token_mean_subtracted_from_the_loss() -> None:
    entropy = torch.tensor([[1.0, 3.0, 100.0]], requires_grad=True)
    loss, metrics = _loss(entropy_coeff=0.5)(
        torch.zeros(1, 3),
        old_logprobs=torch.zeros(1, 3),
        advantages=torch.zeros(1),
        loss_mask=torch.tensor([[True, True, False]]),
        entropy=entropy,
        mixed_phase=True,
    )
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["actor/entropy"] == pytest.approx(2.0) and metrics["loss/entropy"] == pytest.approx(-1.0)
    loss.backward()
    assert entropy.grad is not None and entropy.grad[0].tolist() == pytest.approx([-0.25, -0.25, 0.0])


def test_kl_penalty_uses_the_k3_estimator() -> None:
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    loss, metrics = _loss(kl_coeff=0.2)(
        lp,
        old_logprobs=lp,
        advantages=torch.zeros(1),
        loss_mask=torch.ones(1, 2, dtype=torch.bool),
        ref_logprobs=ref,
        mixed_phase=True,
    )
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    assert metrics["actor/kl"] == pytest.approx(sum(k3) / 2)
    assert loss.item() == pytest.approx(0.2 * sum(k3) / 2) == metrics["loss/kl"]


def test_metrics_have_the_documented_names_and_zeros_without_replay() -> None:
    loss, metrics = ExGRPOLoss()(
        torch.full((2, 3), -1.0),
        old_logprobs=torch.full((2, 3), -1.0),
        advantages=torch.tensor([1.0, -1.0]),
        loss_mask=torch.ones(2, 3, dtype=torch.bool),
        entropy=torch.ones(2, 3),
        mixed_phase=False,
    )
    assert set(metrics) >= REQUIRED_METRICS
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["is/w_mean"] == metrics["is/fw_mean"] == metrics["loss/pg_replay"] == 0.0
    assert metrics["tokens/fresh"] == 6.0 and metrics["actor/ratio_mean"] == 1.0
    assert metrics["loss/total"] == pytest.approx(loss.item()) == pytest.approx(-0.001)
    assert metrics["loss/total"] == pytest.approx(
        metrics["loss/pg"] + metrics["loss/entropy"] + metrics["loss/kl"]
    )


def test_low_precision_inputs_are_computed_in_float32() -> None:
    loss, _ = _loss()(
        torch.zeros(1, 2, dtype=torch.bfloat16),
        old_logprobs=torch.zeros(1, 2, dtype=torch.bfloat16),
        advantages=torch.ones(1, dtype=torch.bfloat16),
        loss_mask=torch.ones(1, 2, dtype=torch.bool),
        mixed_phase=True,
    )
    assert loss.dtype == torch.float32 and loss.item() == -2.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"old_logprobs": torch.zeros(2, 2)}, "old_logprobs must have the shape"),
        ({"advantages": torch.zeros(3)}, "advantages must be"),
        ({"loss_mask": torch.ones(1, 2, dtype=torch.bool)}, "loss_mask must have the shape"),
        ({"entropy": None}, "entropy is required"),
        ({"num_loss_tokens": 0}, "num_loss_tokens"),
    ],
    ids=["old-shape", "adv-shape", "mask-shape", "entropy", "num-tokens"],
)
def test_call_refuses_inconsistent_inputs(kwargs: dict[str, object], match: str) -> None:
    inputs: dict[str, object] = {
        "old_logprobs": torch.zeros(1, 3),
        "advantages": torch.zeros(1),
        "loss_mask": torch.ones(1, 3, dtype=torch.bool),
        "entropy": torch.zeros(1, 3),
        "mixed_phase": True,
    }
    inputs.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ExGRPOLoss()(torch.zeros(1, 3), **inputs)  # type: ignore[arg-type]  # bad inputs on purpose
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        ExGRPOLoss()(torch.zeros(3), **inputs)  # type: ignore[arg-type]  # bad inputs on purpose


def test_kl_coeff_needs_reference_logprobs() -> None:
    with pytest.raises(ValueError, match="ref_logprobs is required"):
        _loss(kl_coeff=0.1)(
            torch.zeros(1, 1),
            old_logprobs=torch.zeros(1, 1),
            advantages=torch.zeros(1),
            loss_mask=torch.ones(1, 1, dtype=torch.bool),
            mixed_phase=True,
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_eps", 0.0),
        ("clip_eps", 1.0),
        ("clip_upper_bound", 0.0),
        ("beta", 0.0),
        ("beta", float("inf")),
        ("max_response_len", 0),
        ("max_response_len", 8.5),
        ("normalizer", -1.0),
        ("entropy_coeff", -0.1),
        ("kl_coeff", float("nan")),
    ],
)
def test_config_refuses_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})  # type: ignore[arg-type]  # bad values on purpose


# --------------------------------------------------------------------------- per-token inputs from logits


def test_token_logprobs_and_entropy_match_log_softmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 4
    ids = torch.randint(0, 11, (3, 5))
    log_p = torch.log_softmax(logits, dim=-1)
    expected_lp = log_p.gather(-1, ids[..., None]).squeeze(-1)
    expected_h = -(log_p.exp() * log_p).sum(-1)
    for chunk_size in (1, 4, 1024):
        torch.testing.assert_close(token_logprobs(logits, ids, chunk_size=chunk_size), expected_lp)
        torch.testing.assert_close(token_entropy(logits, chunk_size=chunk_size), expected_h)


def test_token_entropy_is_finite_for_masked_and_peaked_logits() -> None:
    logits = torch.tensor(
        [[[0.0, 0.0, -float("inf"), -float("inf")], [1e4, 0.0, 0.0, 0.0]]], requires_grad=True
    )
    entropy = token_entropy(logits)
    assert entropy[0].tolist() == pytest.approx([math.log(2), 0.0], abs=1e-6)
    entropy.sum().backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())


def test_low_precision_logits_are_upcast_and_shapes_checked() -> None:
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert token_logprobs(logits, ids).dtype == torch.float32
    assert token_entropy(logits).dtype == torch.float32
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(logits, ids[:, :2])
    with pytest.raises(ValueError, match="logits"):
        token_entropy(logits[0])
    with pytest.raises(ValueError, match="chunk_size"):
        token_entropy(logits, chunk_size=0)
