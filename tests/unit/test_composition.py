"""Batch composition and the delayed start (TV9)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pool.domain import (
    Composition,
    ExperienceRules,
    Phase,
    compose_batch,
    next_phase,
    replay_target,
    solved_fraction,
)

RULES = ExperienceRules()


def test_tv9_forty_eligible_questions_are_all_replayed() -> None:
    assert compose_batch(40, RULES, phase="mixed") == Composition(
        num_replay=40,
        num_fresh=88,
        replay_rows=40,
        fresh_rollouts=984,
        total_rows=1024,
        skipped_fresh=40,
    )


def test_tv9_large_pool_replays_half_of_the_question_slots() -> None:
    c = compose_batch(500, RULES, phase="mixed")
    assert (c.num_replay, c.num_fresh) == (64, 64)
    assert c.fresh_rollouts == 960 == 64 * 7 + 64 * 8
    assert c.replay_rows == 64 and c.total_rows == 1024 and c.skipped_fresh == 64


def test_on_policy_phase_uses_only_fresh_questions() -> None:
    assert compose_batch(500, RULES, phase="on_policy") == Composition(
        num_replay=0,
        num_fresh=128,
        replay_rows=0,
        fresh_rollouts=1024,
        total_rows=1024,
        skipped_fresh=0,
    )


def test_first_mixed_step_with_empty_pool_is_fully_fresh() -> None:
    c = compose_batch(0, RULES, phase="mixed")
    assert (c.num_replay, c.num_fresh, c.fresh_rollouts, c.skipped_fresh) == (0, 128, 1024, 0)


def test_overrides_take_precedence_over_rules() -> None:
    c = compose_batch(1000, RULES, phase="mixed", batch_size=10, experience_ratio=0.3)
    assert (c.num_replay, c.num_fresh, c.total_rows) == (3, 7, 80)


def test_ratio_one_replays_every_slot_when_the_pool_is_large() -> None:
    c = compose_batch(1000, ExperienceRules(experience_ratio=1.0, batch_size=16), phase="mixed")
    assert (c.num_replay, c.num_fresh, c.fresh_rollouts) == (16, 0, 16 * 7)


def test_replay_target_floors_the_decimal_product() -> None:
    assert replay_target(128, 0.5) == 64
    assert replay_target(100, 0.29) == 29  # binary float product is 28.999999999999996
    assert replay_target(10, 0.35) == 3
    assert replay_target(7, 0.5) == 3
    assert replay_target(128, 0.0) == 0


@given(
    eligible=st.integers(0, 10_000),
    batch_size=st.integers(1, 512),
    ratio=st.floats(0.0, 1.0),
    k=st.integers(2, 16),
    phase=st.sampled_from(["on_policy", "mixed"]),
)
def test_composition_always_fills_the_batch(
    eligible: int, batch_size: int, ratio: float, k: int, phase: Phase
) -> None:
    rules = ExperienceRules(k=k)
    c = compose_batch(eligible, rules, phase=phase, batch_size=batch_size, experience_ratio=ratio)
    assert c.num_replay + c.num_fresh == batch_size
    assert c.replay_rows + c.fresh_rollouts == c.total_rows == batch_size * k
    assert 0 <= c.num_replay <= min(eligible, batch_size)
    assert c.num_replay <= batch_size * ratio + 1e-9
    assert c.skipped_fresh == c.num_replay
    if phase == "on_policy":
        assert c.num_replay == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_eligible": -1, "phase": "mixed"}, "num_eligible"),
        ({"num_eligible": 5, "phase": "warmup"}, "phase"),
        ({"num_eligible": 5, "phase": "mixed", "batch_size": 0}, "batch_size"),
        ({"num_eligible": 5, "phase": "mixed", "experience_ratio": 1.5}, "experience_ratio"),
    ],
)
def test_compose_batch_rejects_invalid_arguments(kwargs: dict[str, object], match: str) -> None:
    eligible = kwargs.pop("num_eligible")
    with pytest.raises(ValueError, match=match):
        compose_batch(eligible, RULES, **kwargs)  # type: ignore[arg-type]  # bad arguments on purpose


# --------------------------------------------------------------------------- delayed start


def test_tv9_solved_exactly_at_threshold_does_not_switch() -> None:
    assert next_phase("on_policy", 0.35, RULES) == "on_policy"


def test_tv9_solved_above_threshold_switches_to_mixed() -> None:
    assert next_phase("on_policy", 0.3505, RULES) == "mixed"


def test_mixed_phase_never_switches_back() -> None:
    assert next_phase("mixed", 0.0, RULES) == "mixed"


def test_solved_fraction_counts_correct_sequences_over_all_sequences() -> None:
    assert solved_fraction([1.0, 0.0, 1.0, 0.0]) == 0.5
    assert solved_fraction(iter([1, 1, 1, 0.5])) == 0.75


def test_switch_decision_from_a_full_step_of_rewards() -> None:
    at_threshold = [1.0] * 358 + [0.0] * 666  # 0.3496 -> stays on-policy
    just_above = [1.0] * 359 + [0.0] * 665  # 0.3506 -> switches
    assert next_phase("on_policy", solved_fraction(at_threshold), RULES) == "on_policy"
    assert next_phase("on_policy", solved_fraction(just_above), RULES) == "mixed"


def test_solved_fraction_of_no_rewards_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        solved_fraction([])


@pytest.mark.parametrize("solved", [-0.1, 1.1, float("nan")])
def test_next_phase_rejects_a_solved_value_outside_zero_one(solved: float) -> None:
    with pytest.raises(ValueError, match="solved"):
        next_phase("on_policy", solved, RULES)


def test_next_phase_rejects_unknown_phase() -> None:
    with pytest.raises(ValueError, match="phase"):
        next_phase("warmup", 0.5, RULES)  # type: ignore[arg-type]  # an unknown phase on purpose
