"""Fresh-question order: epoch shuffles, active-set refresh (Q10) and drop_last batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pool.domain import ExperienceRules, epoch_order, refresh_active, take_fresh

RULES = ExperienceRules()  # batch 128, margin 20 -> refresh needs more than 148 remaining ids


# --------------------------------------------------------------------------- epoch_order


def test_epoch_order_is_a_permutation_of_the_active_ids() -> None:
    ids = np.arange(100, 400, 3)
    order = epoch_order(ids, seed=47, epoch=0)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == ids.tolist()
    assert order.tolist() != ids.tolist()


def test_epoch_order_does_not_depend_on_input_order() -> None:
    ids = np.arange(500)
    shuffled = np.random.default_rng(0).permutation(ids)
    assert epoch_order(ids, seed=1, epoch=2).tolist() == epoch_order(shuffled, seed=1, epoch=2).tolist()


def test_epoch_order_is_reproducible() -> None:
    ids = np.arange(1000)
    assert epoch_order(ids, seed=5, epoch=3).tolist() == epoch_order(ids, seed=5, epoch=3).tolist()


def test_epoch_order_changes_with_epoch_and_seed() -> None:
    ids = np.arange(1000)
    base = epoch_order(ids, seed=5, epoch=0).tolist()
    assert epoch_order(ids, seed=5, epoch=1).tolist() != base
    assert epoch_order(ids, seed=6, epoch=0).tolist() != base


def test_epoch_order_of_no_ids_is_empty() -> None:
    order = epoch_order(np.array([], dtype=np.int64), seed=0, epoch=0)
    assert order.size == 0 and order.dtype == np.int64


def test_epoch_order_rejects_duplicate_ids() -> None:
    with pytest.raises(ValueError, match="duplicates"):
        epoch_order(np.array([1, 2, 2]), seed=0, epoch=0)


def test_epoch_order_rejects_negative_epoch() -> None:
    with pytest.raises(ValueError, match="epoch"):
        epoch_order(np.arange(3), seed=0, epoch=-1)


# --------------------------------------------------------------------------- refresh_active


def test_refresh_drops_retired_ids_when_enough_remain() -> None:
    all_ids = np.arange(200)
    retired = np.arange(51)  # 149 remain > 148
    active = refresh_active(all_ids, retired, all_ids, RULES)
    assert active.tolist() == list(range(51, 200))
    assert active.dtype == np.int64


def test_refresh_keeps_previous_active_set_when_too_few_would_remain() -> None:
    all_ids = np.arange(200)
    previous = np.arange(10, 200)
    retired = np.arange(52)  # exactly 148 remain, not more than 148
    assert refresh_active(all_ids, retired, previous, RULES).tolist() == list(range(10, 200))


def test_refresh_without_previous_set_falls_back_to_all_ids() -> None:
    all_ids = np.array([5, 3, 9, 1])
    assert refresh_active(all_ids, np.array([3]), None, RULES).tolist() == [1, 3, 5, 9]


def test_refresh_threshold_follows_batch_size_and_margin() -> None:
    rules = ExperienceRules(batch_size=4, active_refresh_margin=1)
    all_ids = np.arange(10)
    assert refresh_active(all_ids, np.arange(4), None, rules).tolist() == [4, 5, 6, 7, 8, 9]
    assert refresh_active(all_ids, np.arange(5), None, rules).tolist() == list(range(10))


def test_refresh_ignores_retired_ids_unknown_to_the_dataset() -> None:
    all_ids = np.arange(300)
    active = refresh_active(all_ids, np.array([0, 1, 10_000]), None, RULES)
    assert active.tolist() == list(range(2, 300))


def test_question_retired_mid_epoch_stays_in_that_epoch_and_leaves_at_the_next() -> None:
    all_ids = np.arange(400)
    active = refresh_active(all_ids, np.array([], dtype=np.int64), None, RULES)
    order = epoch_order(active, seed=47, epoch=0)
    first = take_fresh(order, 0, 128)
    assert first is not None
    retired_id = int(order[200])  # retired after the first batch, still later in this epoch's order
    second = take_fresh(order, first[1], 128)
    assert second is not None and retired_id in second[0]
    next_active = refresh_active(all_ids, np.array([retired_id]), active, RULES)
    assert retired_id not in epoch_order(next_active, seed=47, epoch=1)


# --------------------------------------------------------------------------- take_fresh


def test_take_fresh_walks_the_order_in_batches_and_drops_the_tail() -> None:
    order = np.arange(10, 20)
    first = take_fresh(order, 0, 4)
    assert first is not None
    assert first[0].tolist() == [10, 11, 12, 13] and first[1] == 4
    second = take_fresh(order, first[1], 4)
    assert second is not None
    assert second[0].tolist() == [14, 15, 16, 17] and second[1] == 8
    assert take_fresh(order, second[1], 4) is None


def test_take_fresh_returns_a_copy() -> None:
    order = np.arange(8)
    taken = take_fresh(order, 0, 4)
    assert taken is not None
    taken[0][0] = 99
    assert order[0] == 0


def test_take_fresh_at_exact_end_signals_new_epoch() -> None:
    assert take_fresh(np.arange(8), 8, 4) is None


@pytest.mark.parametrize(("cursor", "batch_size"), [(-1, 4), (9, 4), (0, 0)])
def test_take_fresh_rejects_invalid_cursor_or_batch_size(cursor: int, batch_size: int) -> None:
    with pytest.raises(ValueError):
        take_fresh(np.arange(8), cursor, batch_size)


@given(n=st.integers(0, 300), batch_size=st.integers(1, 50), seed=st.integers(0, 2**31))
def test_one_epoch_yields_floor_n_over_b_disjoint_full_batches(n: int, batch_size: int, seed: int) -> None:
    order = epoch_order(np.arange(n), seed=seed, epoch=0)
    cursor, seen = 0, []
    while (taken := take_fresh(order, cursor, batch_size)) is not None:
        ids, cursor = taken
        assert len(ids) == batch_size
        seen.extend(ids.tolist())
    assert len(seen) == (n // batch_size) * batch_size
    assert len(set(seen)) == len(seen)
