"""Group-relative advantages (spec 5.3, TV4)."""

from __future__ import annotations

import numpy as np
import pytest

from exgrpo_trainer.algo import batch_advantages, group_advantages


def test_tv4a_fresh_group_is_mean_centred() -> None:
    adv = group_advantages([1, 0, 0, 1, 0, 0, 0, 1])
    np.testing.assert_allclose(adv, [0.625, -0.375, -0.375, 0.625, -0.375, -0.375, -0.375, 0.625])
    assert adv.dtype == np.float64


def test_tv4b_replayed_trajectory_gets_the_same_advantage_as_correct_fresh_rows() -> None:
    adv = group_advantages([1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(adv, [0.625] * 3 + [-0.375] * 5)


def test_tv4c_unbiased_std_normalisation_when_asked() -> None:
    adv = group_advantages(np.array([1, 1, 1, 0, 0, 0, 0, 0]), use_std=True)
    np.testing.assert_allclose(adv, [1.207612] * 3 + [-0.724567] * 5, atol=1e-6)


@pytest.mark.parametrize("value", [0.0, 1.0], ids=["all-wrong", "all-correct"])
@pytest.mark.parametrize("use_std", [False, True], ids=["mean", "std"])
def test_tv4d_identical_rewards_give_zero(value: float, use_std: bool) -> None:
    assert group_advantages([value] * 8, use_std=use_std).tolist() == [0.0] * 8


@pytest.mark.parametrize("use_std", [False, True])
def test_singleton_group_keeps_its_reward(use_std: bool) -> None:
    assert group_advantages([0.7], use_std=use_std).tolist() == [0.7]


def test_input_is_not_modified_and_empty_groups_are_refused() -> None:
    rewards = np.array([1.0, 0.0])
    group_advantages(rewards)
    assert rewards.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="non-empty"):
        group_advantages([])
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(np.zeros((2, 2)))


def test_batch_advantages_keeps_group_order() -> None:
    out = batch_advantages([[1, 0], [0, 0, 0], [1]])
    assert [a.tolist() for a in out] == [[0.5, -0.5], [0.0, 0.0, 0.0], [1.0]]
