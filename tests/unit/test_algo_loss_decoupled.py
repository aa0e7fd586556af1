"""The decoupled objective of asynchronous mode (`behaviour_logprobs`): fresh tokens are weighted by the
detached ``b = pi_prox / pi_behav`` and clipped against the proximal policy (``old_logprobs``)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from exgrpo_trainer.algo import ExGRPOLoss, LossConfig
from exgrpo_trainer.config import format_config_error, load_config

SETTINGS: dict[str, float] = {"normalizer": 8.0, "entropy_coeff": 0.01, "kl_coeff": 0.05, "beta": 0.1}
BEHAVIOUR_METRICS = {
    "actor/behav_weight_mean",
    "actor/behav_weight_max",
    "actor/behav_weight_min",
    "actor/behav_capped_frac",
}


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _batch() -> dict[str, torch.Tensor]:
    """Row 0 replayed (last position padding), rows 1-2 fresh (row 2 half padding). Literal values, so
    the recorded results below do not depend on a random generator. Fresh tokens: ratios 1.49 and 0.74
    (A < 0: the clip binds on the second), 1.42 (A > 0: binds), and three inside the clip range."""
    return {
        "logprobs": _t([[-1.25, -0.5, -2.0, -0.75], [-0.6, -1.4, -0.9, -2.2], [-0.3, -1.7, -1.1, -0.8]]),
        "old_logprobs": _t(
            [[-1.2, -0.55, -1.9, -0.7], [-1.0, -1.1, -0.95, -2.18], [-0.65, -1.6, -1.1, -0.8]]
        ),
        "past_logprobs": _t([[-2.0, -0.4, -3.5, -1.0], [-9.0] * 4, [-9.0] * 4]),
        "ref_logprobs": _t([[-1.0, -0.7, -1.8, -0.9], [-0.5, -1.2, -1.0, -2.0], [-0.4, -1.5, -1.3, -0.6]]),
        "entropy": _t([[0.9, 1.3, 0.4, 2.0], [1.1, 0.7, 1.6, 0.5], [0.8, 1.2, 0.3, 1.9]]),
        "advantages": torch.tensor([0.75, -0.5, 1.25], dtype=torch.float64),
        "loss_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool),
        "replay_mask": torch.tensor([[1] * 4, [0] * 4, [0] * 4], dtype=torch.bool),
    }


# log b = lp_prox - lp_behav on the fresh tokens: [0.2, -0.4, 1.1, 0.0] and [-0.6, 1.5]; the replayed
# row and the padding hold values the loss must ignore.
BEHAVIOUR = _t([[-5.0] * 4, [-1.2, -0.7, -2.05, -2.18], [-0.05, -3.1, -1.1, -0.8]])


def _run(
    loss_fn: ExGRPOLoss, batch: dict[str, torch.Tensor], *, mixed_phase: bool, **extra: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(loss, d loss / d lp, d loss / d entropy, metrics)``."""
    inputs = dict(batch)
    lp = inputs.pop("logprobs").clone().requires_grad_()
    entropy = inputs.pop("entropy").clone().requires_grad_()
    loss, metrics = loss_fn(lp, entropy=entropy, mixed_phase=mixed_phase, **inputs, **extra)  # type: ignore[arg-type]
    lp_grad, entropy_grad = torch.autograd.grad(loss, [lp, entropy], allow_unused=True)
    if entropy_grad is None:  # entropy_coeff = 0
        entropy_grad = torch.zeros_like(entropy)
    return loss.detach(), lp_grad, entropy_grad, metrics


def _reference(
    batch: dict[str, torch.Tensor],
    behaviour: torch.Tensor | None,
    config: LossConfig,
    *,
    mixed_phase: bool,
) -> tuple[float, list[list[float]], dict[str, float]]:
    """The loss, its gradient with respect to each token's log-prob, and the behaviour-weight metrics,
    computed token by token with the math module (spec 6 plus the decoupled fresh-token rule)."""
    lp, old, past = (batch[k].tolist() for k in ("logprobs", "old_logprobs", "past_logprobs"))
    ref, ent = batch["ref_logprobs"].tolist(), batch["entropy"].tolist()
    mask, replay = batch["loss_mask"].tolist(), batch["replay_mask"].tolist()
    adv = batch["advantages"].tolist()
    behav = behaviour.tolist() if behaviour is not None else None
    low, high = 1.0 - config.clip_eps, max(config.clip_upper_bound, 1.0 + config.clip_eps)
    clip = config.clip_after_switch if mixed_phase else config.clip_before_switch
    beta, cap, norm = config.beta, config.behaviour_weight_cap, config.effective_normalizer
    num_tokens = sum(sum(row) for row in mask)
    pg = entropy_sum = kl_sum = 0.0
    grads = [[0.0] * len(row) for row in lp]
    weights: list[float] = []
    capped = 0
    for i, row in enumerate(lp):
        a = adv[i]
        for t, x in enumerate(row):
            if not mask[i][t]:
                continue
            entropy_sum += ent[i][t]
            delta = ref[i][t] - x
            kl_sum += math.exp(delta) - delta - 1.0
            grads[i][t] += config.kl_coeff * (1.0 - math.exp(delta)) / num_tokens
            if replay[i][t]:
                w = math.exp(x - past[i][t])
                pg += -a * w / (w + beta)
                grads[i][t] += -a * beta * w / (w + beta) ** 2 / norm
                continue
            r = math.exp(x - old[i][t])
            b = 1.0 if behav is None else math.exp(old[i][t] - behav[i][t])
            weights.append(b)
            if cap is not None and b > cap:
                capped += 1
                continue
            r_clipped = min(max(r, low), high)
            if clip and -a * r_clipped > -a * r:  # the clipped branch is the max: no gradient
                pg += b * -a * r_clipped
            else:
                pg += b * -a * r
                grads[i][t] += b * -a * r / norm
    loss = pg / norm - config.entropy_coeff * entropy_sum / num_tokens + config.kl_coeff * kl_sum / num_tokens
    stats = {
        "actor/behav_weight_mean": sum(weights) / len(weights),
        "actor/behav_weight_max": max(weights),
        "actor/behav_weight_min": min(weights),
        "actor/behav_capped_frac": capped / len(weights),
    }
    return loss, grads, stats


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("cap", [None, 2.0], ids=["no-cap", "cap-2"])
@pytest.mark.parametrize("mixed_phase", [False, True], ids=["before-switch", "after-switch"])
@pytest.mark.parametrize("clip_after_switch", [False, True], ids=["official", "clip-after"])
def test_decoupled_loss_matches_a_token_by_token_reference(
    cap: float | None, mixed_phase: bool, clip_after_switch: bool
) -> None:
    config = LossConfig(**SETTINGS, behaviour_weight_cap=cap, clip_after_switch=clip_after_switch)
    batch = _batch()
    loss, lp_grad, _, metrics = _run(
        config.build(), batch, mixed_phase=mixed_phase, behaviour_logprobs=BEHAVIOUR
    )
    expected_loss, expected_grad, expected_stats = _reference(
        batch, BEHAVIOUR, config, mixed_phase=mixed_phase
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(lp_grad, _t(expected_grad), rtol=1e-12, atol=1e-15)
    for name, value in expected_stats.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12), name
    assert metrics["actor/behav_capped_frac"] == (0.0 if cap is None else 2 / 6)


def test_reference_without_behaviour_is_the_synchronous_loss() -> None:
    """The reference itself, checked on the path the rest of the suite pins (b = 1 everywhere)."""
    config = LossConfig(**SETTINGS)
    batch = _batch()
    for mixed_phase in (False, True):
        loss, lp_grad, _, _ = _run(config.build(), batch, mixed_phase=mixed_phase)
        expected_loss, expected_grad, _ = _reference(batch, None, config, mixed_phase=mixed_phase)
        assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
        torch.testing.assert_close(lp_grad, _t(expected_grad), rtol=1e-12, atol=1e-15)


def test_gradcheck_of_the_decoupled_loss_in_both_phases() -> None:
    torch.manual_seed(5)
    old = torch.randn(3, 5, dtype=torch.float64) - 1
    # ratios away from the clip bounds and weights away from the cap: the loss is smooth there
    lp = (old + 0.05 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_()
    entropy = torch.rand(3, 5, dtype=torch.float64).requires_grad_()
    log_b = _t([[0.0] * 5, [0.3, -0.5, 1.6, 0.1, -1.2], [2.0, 0.7, -0.2, 0.4, 0.0]])
    inputs = {
        "old_logprobs": old,
        "behaviour_logprobs": old - log_b,
        "past_logprobs": old - 1.0,
        "ref_logprobs": old + 0.3,
        "advantages": torch.tensor([0.5, -0.25, 1.0], dtype=torch.float64),
        "loss_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5, [1, 1, 1, 1, 0]], dtype=torch.bool),
        "replay_mask": torch.tensor([[1] * 5, [0] * 5, [0] * 5], dtype=torch.bool),
    }
    loss_fn = LossConfig(**SETTINGS, behaviour_weight_cap=3.0).build()  # masks b = e^1.6 and e^2
    for mixed_phase in (False, True):
        assert torch.autograd.gradcheck(
            lambda lp_, ent_, phase=mixed_phase: loss_fn(lp_, entropy=ent_, mixed_phase=phase, **inputs)[0],
            (lp, entropy),
        )


# --------------------------------------------------------------------------- the synchronous loss is kept

# Recorded with the loss before `behaviour_logprobs` existed (float64, hex for exactness).
RECORDED_LOSS = {False: "-0x1.54e7441f98933p-2", True: "-0x1.7bbde83c48799p-2"}
RECORDED_LP_GRAD_BEFORE_SWITCH = [
    ["-0x1.700a9df3a4ab0p-8", "-0x1.e4981e8cda8dfp-8", "-0x1.a7909ddbd1f05p-9", "0x0.0p+0"],
    ["0x1.7b838ef2142a5p-4", "-0x1.4270ee586adccp-10", "0x1.0f4a76fc985d4p-4", "0x1.ebc912481b6ecp-5"],
    ["0x1.152e5d370d130p-11", "-0x1.241129df04862p-3", "0x0.0p+0", "0x0.0p+0"],
]
RECORDED_PG_FRESH = {False: "-0x1.e0aa45d109e01p-5", True: "-0x1.8bafb35b44898p-4"}


@pytest.mark.parametrize("mixed_phase", [False, True], ids=["before-switch", "after-switch"])
def test_without_behaviour_logprobs_the_loss_is_bit_identical_to_the_recorded_one(mixed_phase: bool) -> None:
    loss_fn = LossConfig(**SETTINGS, behaviour_weight_cap=2.0).build()  # the cap alone changes nothing
    loss, lp_grad, _, metrics = _run(loss_fn, _batch(), mixed_phase=mixed_phase, behaviour_logprobs=None)
    assert loss.item() == float.fromhex(RECORDED_LOSS[mixed_phase])
    assert metrics["loss/pg_fresh"] == float.fromhex(RECORDED_PG_FRESH[mixed_phase])
    if not mixed_phase:
        expected = [[float.fromhex(x) for x in row] for row in RECORDED_LP_GRAD_BEFORE_SWITCH]
        assert lp_grad.tolist() == expected
    assert not BEHAVIOUR_METRICS & set(metrics)


@pytest.mark.parametrize("cap", [None, 1.0], ids=["no-cap", "cap-1"])
@pytest.mark.parametrize("mixed_phase", [False, True], ids=["before-switch", "after-switch"])
def test_behaviour_equal_to_the_proximal_policy_gives_the_synchronous_loss_exactly(
    cap: float | None, mixed_phase: bool
) -> None:
    batch = _batch()
    loss_fn = LossConfig(**SETTINGS, behaviour_weight_cap=cap).build()
    sync = _run(loss_fn, batch, mixed_phase=mixed_phase)
    decoupled = _run(
        loss_fn, batch, mixed_phase=mixed_phase, behaviour_logprobs=batch["old_logprobs"].clone()
    )
    assert torch.equal(sync[0], decoupled[0])
    assert torch.equal(sync[1], decoupled[1]) and torch.equal(sync[2], decoupled[2])
    assert {k: v for k, v in decoupled[3].items() if k not in BEHAVIOUR_METRICS} == sync[3]
    assert decoupled[3]["actor/behav_weight_mean"] == decoupled[3]["actor/behav_weight_max"] == 1.0
    assert decoupled[3]["actor/behav_weight_min"] == 1.0 and decoupled[3]["actor/behav_capped_frac"] == 0.0


# --------------------------------------------------------------------------- the behaviour weight and its cap


def _one_token(
    log_b: float, *, cap: float | None, advantage: float = 1.0
) -> tuple[float, float, dict[str, float]]:
    """Loss and gradient of one fresh token with r = 1.5 after the switch (no clip)."""
    lp = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = LossConfig(normalizer=1.0, entropy_coeff=0.0, behaviour_weight_cap=cap).build()(
        lp,
        old_logprobs=torch.zeros(1, 1, dtype=torch.float64),
        behaviour_logprobs=torch.tensor([[-log_b]], dtype=torch.float64),
        advantages=torch.tensor([advantage], dtype=torch.float64),
        loss_mask=torch.ones(1, 1, dtype=torch.bool),
        mixed_phase=True,
    )
    loss.backward()
    assert lp.grad is not None
    return loss.item(), float(lp.grad), metrics


def test_one_fresh_token_is_weighted_by_b_times_r() -> None:
    loss, grad, metrics = _one_token(math.log(2.5), cap=None)
    assert loss == pytest.approx(-2.5 * 1.5, rel=1e-12) and grad == pytest.approx(-2.5 * 1.5, rel=1e-12)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.5)  # r is against the proximal policy
    assert metrics["actor/behav_weight_mean"] == pytest.approx(2.5)


def test_tokens_above_the_cap_are_masked_not_truncated() -> None:
    kept_loss, kept_grad, kept = _one_token(math.log(2.5), cap=3.0)
    assert kept_loss == pytest.approx(-3.75) and kept_grad == pytest.approx(-3.75)
    assert kept["actor/behav_capped_frac"] == 0.0
    loss, grad, metrics = _one_token(math.log(4.0), cap=3.0)
    assert loss == 0.0 and grad == 0.0  # truncation would give -3 * 1.5
    assert metrics["actor/behav_capped_frac"] == 1.0
    assert metrics["actor/behav_weight_max"] == pytest.approx(4.0)  # reported before the cap
    at_cap_loss, _, at_cap = _one_token(0.0, cap=1.0)  # b == cap exactly: kept
    assert at_cap_loss == -1.5 and at_cap["actor/behav_capped_frac"] == 0.0


def test_capped_tokens_drop_out_and_every_other_token_keeps_its_exact_weight() -> None:
    batch = _batch()
    settings = {**SETTINGS, "entropy_coeff": 0.0, "kl_coeff": 0.0}  # token means would see the mask change
    capped = _run(
        LossConfig(**settings, behaviour_weight_cap=2.0).build(),
        batch,
        mixed_phase=False,
        behaviour_logprobs=BEHAVIOUR,
    )
    dropped = dict(batch, loss_mask=batch["loss_mask"].clone())
    dropped["loss_mask"][1, 2] = dropped["loss_mask"][2, 1] = False  # b = e^1.1 and e^1.5
    uncapped = _run(LossConfig(**settings).build(), dropped, mixed_phase=False, behaviour_logprobs=BEHAVIOUR)
    assert capped[0].item() == pytest.approx(uncapped[0].item(), rel=1e-14)
    torch.testing.assert_close(capped[1], uncapped[1], rtol=1e-14, atol=0.0)
    assert capped[1][1, 2] == 0.0 and capped[1][2, 1] == 0.0
    assert capped[3]["actor/behav_capped_frac"] == pytest.approx(2 / 6)


def test_replayed_and_padded_positions_ignore_the_behaviour_logprobs() -> None:
    batch = _batch()
    garbage = BEHAVIOUR.clone()
    garbage[0] = float("nan")  # the replayed row
    garbage[1:, :][~batch["loss_mask"][1:]] = float("inf")  # padding of the fresh rows
    loss_fn = LossConfig(**SETTINGS, behaviour_weight_cap=2.0).build()
    clean = _run(loss_fn, batch, mixed_phase=True, behaviour_logprobs=BEHAVIOUR)
    dirty = _run(loss_fn, batch, mixed_phase=True, behaviour_logprobs=garbage)
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
    assert clean[3] == dirty[3]
    assert clean[3]["is/w_mean"] == _run(loss_fn, batch, mixed_phase=True)[3]["is/w_mean"]


def test_the_behaviour_weight_carries_no_gradient() -> None:
    batch = _batch()
    old = batch["old_logprobs"].clone().requires_grad_()
    behaviour = BEHAVIOUR.clone().requires_grad_()
    lp = batch["logprobs"].clone().requires_grad_()
    loss, _ = LossConfig(**{**SETTINGS, "entropy_coeff": 0.0}).build()(
        lp,
        old_logprobs=old,
        behaviour_logprobs=behaviour,
        past_logprobs=batch["past_logprobs"],
        ref_logprobs=batch["ref_logprobs"],
        advantages=batch["advantages"],
        loss_mask=batch["loss_mask"],
        replay_mask=batch["replay_mask"],
        mixed_phase=True,
    )
    loss.backward()
    assert behaviour.grad is None  # b is detached; only r = pi_theta / pi_prox depends on lp_prox
    assert old.grad is not None and lp.grad is not None
    pg_grad = lp.grad - _kl_grad(batch, lp)
    torch.testing.assert_close(old.grad, -torch.where(batch["replay_mask"], 0.0, pg_grad))


def _kl_grad(batch: dict[str, torch.Tensor], lp: torch.Tensor) -> torch.Tensor:
    delta = batch["ref_logprobs"] - lp.detach()
    mask = batch["loss_mask"]
    return torch.where(mask, SETTINGS["kl_coeff"] * (1.0 - delta.exp()) / mask.sum(), 0.0)


def test_behaviour_logprobs_must_have_the_shape_of_logprobs() -> None:
    with pytest.raises(ValueError, match="behaviour_logprobs must have the shape"):
        ExGRPOLoss()(
            torch.zeros(1, 3),
            old_logprobs=torch.zeros(1, 3),
            behaviour_logprobs=torch.zeros(1, 2),
            advantages=torch.zeros(1),
            loss_mask=torch.ones(1, 3, dtype=torch.bool),
            entropy=torch.zeros(1, 3),
            mixed_phase=True,
        )


@pytest.mark.parametrize("cap", [0.5, 0.0, -1.0, float("inf"), float("nan")])
def test_the_cap_must_be_a_finite_number_of_at_least_one(cap: float) -> None:
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        LossConfig(behaviour_weight_cap=cap)


def test_the_trainer_config_takes_the_cap_in_its_loss_section() -> None:
    assert load_config(None, ["loss.behaviour_weight_cap=5"]).loss.behaviour_weight_cap == 5.0
    assert load_config(None, []).loss.behaviour_weight_cap is None
    with pytest.raises(ValidationError) as info:
        load_config(None, ["loss.behaviour_weight_cap=0.5"])
    assert "behaviour_weight_cap" in format_config_error(info.value)
