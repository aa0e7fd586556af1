"""Collection decisions (TV8), trajectory keys and deduplication."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pool.domain import (
    ExperienceRules,
    GroupAction,
    GroupDecision,
    decide_group,
    dedup,
    is_correct,
    trajectory_key,
)

RULES = ExperienceRules()

# --------------------------------------------------------------------------- TV8


def test_tv8_all_correct_group_is_retired_and_not_stored() -> None:
    decision = decide_group([1.0] * 8, RULES, collect=True)
    assert decision == GroupDecision(action=GroupAction.RETIRE, num_correct=8, bucket=None, store=())


def test_tv8_all_wrong_group_is_ignored_and_keeps_its_bucket() -> None:
    decision = decide_group([0.0] * 8, RULES, collect=True)
    assert decision == GroupDecision(action=GroupAction.IGNORE, num_correct=0, bucket=None, store=())


def test_tv8_three_correct_goes_to_bucket_three_and_stores_the_correct_rollouts() -> None:
    decision = decide_group([1, 0, 1, 0, 0, 1, 0, 0], RULES, collect=True)
    assert decision.action is GroupAction.COLLECT
    assert decision.num_correct == 3
    assert decision.bucket == 3
    assert decision.store == (0, 2, 5)


def test_tv8_single_correct_goes_to_bucket_one() -> None:
    decision = decide_group([1, 0, 0, 0, 0, 0, 0, 0], RULES, collect=True)
    assert (decision.action, decision.bucket, decision.store) == (GroupAction.COLLECT, 1, (0,))


def test_tv8_duplicate_correct_texts_are_stored_once() -> None:
    tokens = {0: [5, 6, 7], 2: [5, 6, 7], 5: [9, 9]}
    decision = decide_group([1, 0, 1, 0, 0, 1, 0, 0], RULES, collect=True)
    keys = [trajectory_key(np.array(tokens[i])) for i in decision.store]
    kept = [decision.store[j] for j in dedup(keys, existing=set())]
    assert kept == [0, 5]


def test_seven_correct_is_still_collected_with_default_bounds() -> None:
    decision = decide_group([1, 1, 1, 1, 1, 1, 1, 0], RULES, collect=True)
    assert (decision.action, decision.bucket) == (GroupAction.COLLECT, 7)
    assert decision.store == tuple(range(7))


def test_replayed_group_counts_the_replayed_trajectory() -> None:
    # row 0 = replayed trajectory (correct) + 7 fresh with 2 correct -> k = 3
    decision = decide_group([1, 1, 1, 0, 0, 0, 0, 0], RULES, collect=True)
    assert (decision.action, decision.num_correct, decision.bucket) == (GroupAction.COLLECT, 3, 3)


def test_on_policy_phase_retires_all_correct_groups() -> None:
    assert decide_group([1.0] * 8, RULES, collect=False).action is GroupAction.RETIRE


def test_on_policy_phase_collects_nothing() -> None:
    decision = decide_group([1, 0, 1, 0, 0, 1, 0, 0], RULES, collect=False)
    assert decision == GroupDecision(action=GroupAction.IGNORE, num_correct=3, bucket=None, store=())


@pytest.mark.parametrize(
    ("k", "action"),
    [
        (0, GroupAction.IGNORE),
        (1, GroupAction.IGNORE),
        (2, GroupAction.IGNORE),
        (3, GroupAction.COLLECT),
        (5, GroupAction.COLLECT),
        (6, GroupAction.IGNORE),
        (7, GroupAction.IGNORE),
        (8, GroupAction.RETIRE),
    ],
)
def test_custom_bounds_collect_only_inside_the_half_open_interval(k: int, action: GroupAction) -> None:
    rules = ExperienceRules(lbound=2, rbound=5)
    rewards = [1.0] * k + [0.0] * (8 - k)
    decision = decide_group(rewards, rules, collect=True)
    assert decision.action is action
    assert decision.num_correct == k
    assert decision.bucket == (k if action is GroupAction.COLLECT else None)


def test_group_of_wrong_size_is_rejected_with_expected_and_actual_size() -> None:
    with pytest.raises(ValueError, match=r"expected 8 .* got 7"):
        decide_group([1.0] * 7, RULES, collect=True)


def test_only_a_reward_of_exactly_one_is_correct() -> None:
    assert is_correct(1.0) and is_correct(1)
    assert not is_correct(0.0)
    assert not is_correct(0.5)
    assert not is_correct(-1.0)
    assert not is_correct(float("nan"))


def test_partial_rewards_do_not_count_as_correct() -> None:
    decision = decide_group([1.0, 0.5, 0.99, 0, 0, 0, 0, 1.0], RULES, collect=True)
    assert (decision.num_correct, decision.store) == (2, (0, 7))


@given(rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=8, max_size=8), collect=st.booleans())
def test_decision_is_consistent_with_the_rewards(rewards: list[float], collect: bool) -> None:
    decision = decide_group(rewards, RULES, collect=collect)
    k = int(sum(rewards))
    assert decision.num_correct == k
    if decision.action is GroupAction.COLLECT:
        assert collect and 1 <= k <= 7
        assert decision.bucket == k
        assert [rewards[i] for i in decision.store] == [1.0] * k
    else:
        assert decision.bucket is None and decision.store == ()
        assert decision.action is (GroupAction.RETIRE if k == 8 else GroupAction.IGNORE)


def test_group_action_values_are_strings() -> None:
    assert [a.value for a in GroupAction] == ["retire", "collect", "ignore"]
    assert GroupAction("collect") is GroupAction.COLLECT


# --------------------------------------------------------------------------- trajectory_key


def test_trajectory_key_is_sha256_of_little_endian_int32_ids() -> None:
    ids = np.array([1, 2, 151645], dtype=np.int64)
    expected = hashlib.sha256(np.array([1, 2, 151645], dtype="<i4").tobytes()).digest()
    assert trajectory_key(ids) == expected
    assert len(trajectory_key(ids)) == 32


def test_trajectory_key_from_bytes_equals_key_from_array() -> None:
    ids = np.array([7, 8, 9], dtype=np.int32)
    assert trajectory_key(ids.astype("<i4").tobytes()) == trajectory_key(ids)


def test_trajectory_key_from_a_view_equals_key_from_bytes() -> None:
    """A view into a frame's buffer (how a frame's payload reaches the key), of any format, and a
    strided one, hash the bytes they show."""
    ids = np.array([7, 8, 9, 10], dtype="<i4")
    raw = ids.tobytes()
    frame = b"head" + raw + b"tail"
    assert trajectory_key(memoryview(frame)[4 : 4 + len(raw)]) == trajectory_key(raw)
    assert trajectory_key(memoryview(ids)) == trajectory_key(raw)
    every_other = memoryview(np.array([7, 0, 8, 0, 9, 0, 10, 0], dtype="<i4"))[::2]
    assert trajectory_key(every_other) == trajectory_key(raw)
    for bad in (memoryview(frame)[4:7], memoryview(b"")):
        with pytest.raises(ValueError):
            trajectory_key(bad)


def test_trajectory_key_does_not_depend_on_integer_dtype() -> None:
    ids = [3, 1, 4, 1, 5]
    keys = {
        trajectory_key(np.array(ids, dtype=dt)) for dt in (np.int16, np.int32, np.int64, np.uint32, ">i8")
    }
    assert len(keys) == 1


def test_trajectory_key_depends_on_order_and_content() -> None:
    assert trajectory_key(np.array([1, 2])) != trajectory_key(np.array([2, 1]))
    assert trajectory_key(np.array([1, 2])) != trajectory_key(np.array([1, 2, 0]))


@pytest.mark.parametrize(
    "bad",
    [
        np.array([], dtype=np.int64),
        np.array([[1, 2]]),
        np.array([1.0, 2.0]),
        np.array([2**31], dtype=np.int64),
        b"",
        b"\x00\x01\x02",
    ],
)
def test_trajectory_key_rejects_invalid_input(bad: np.ndarray | bytes) -> None:
    with pytest.raises(ValueError):
        trajectory_key(bad)


# --------------------------------------------------------------------------- dedup


def test_dedup_skips_keys_already_stored() -> None:
    assert dedup([b"a", b"b", b"c"], existing={b"b"}) == [0, 2]


def test_dedup_keeps_first_occurrence_of_repeated_keys() -> None:
    assert dedup([b"x", b"y", b"x", b"z", b"y"], existing=frozenset()) == [0, 1, 3]


def test_dedup_of_all_known_keys_is_empty() -> None:
    assert dedup([b"a", b"a"], existing=[b"a"]) == []


@given(
    keys=st.lists(st.binary(min_size=1, max_size=2), max_size=30),
    existing=st.sets(st.binary(min_size=1, max_size=2), max_size=10),
)
def test_dedup_keeps_each_new_key_exactly_once_in_order(keys: list[bytes], existing: set[bytes]) -> None:
    kept = dedup(keys, existing)
    assert kept == sorted(kept)
    kept_keys = [keys[i] for i in kept]
    assert len(set(kept_keys)) == len(kept_keys)
    assert not set(kept_keys) & existing
    assert set(kept_keys) == set(keys) - existing
    for i in kept:
        assert keys[i] not in keys[:i]
