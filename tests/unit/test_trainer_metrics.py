"""How the trainer merges the metrics of micro-batches, ranks and mini-batches into one step, and
how far a step's samples were from the policy that learns from them."""

from __future__ import annotations

import pytest

from exgrpo_trainer.algo import Row
from exgrpo_trainer.step_metrics import logprob_gap, merge_update_metrics, policy_lag


def _mb(index: int, fresh: float, replay: float, **values: float) -> dict[str, float]:
    return {"_minibatch": float(index), "_tokens": fresh + replay, "tokens/fresh": fresh,
            "tokens/replay": replay, **values}  # fmt: skip


def test_additive_terms_sum_within_a_mini_batch_and_average_over_mini_batches() -> None:
    # each micro-batch reports its share of the mini-batch mean (token sum / mini-batch tokens)
    rank0 = [_mb(0, 30, 0, **{"actor/entropy": 1.5, "loss/total": 0.25}),
             _mb(1, 10, 0, **{"actor/entropy": 1.0, "loss/total": 0.5})]  # fmt: skip
    rank1 = [_mb(0, 10, 0, **{"actor/entropy": 0.5, "loss/total": 0.25}),
             _mb(1, 30, 0, **{"actor/entropy": 3.0, "loss/total": 0.5})]  # fmt: skip
    out = merge_update_metrics([rank0, rank1])
    assert out["actor/entropy"] == pytest.approx((2.0 + 4.0) / 2)
    assert out["loss/total"] == pytest.approx((0.5 + 1.0) / 2)
    assert out["tokens/fresh"] == 80.0 and out["tokens/replay"] == 0.0


def test_importance_weights_come_from_micro_batches_with_replayed_tokens() -> None:
    none = {"is/w_mean": 0.0, "is/w_max": 0.0, "is/w_min": 0.0, "actor/ratio_mean": 1.0}
    parts = [
        _mb(0, 20, 0, **none),
        _mb(0, 10, 10, **{"is/w_mean": 2.0, "is/w_max": 3.0, "is/w_min": 0.5, "actor/ratio_mean": 1.2}),
        _mb(0, 0, 30, **{"is/w_mean": 1.0, "is/w_max": 4.0, "is/w_min": 0.8, "actor/ratio_mean": 0.0}),
    ]
    out = merge_update_metrics([parts])
    assert out["is/w_min"] == 0.5 and out["is/w_max"] == 4.0
    assert out["is/w_mean"] == pytest.approx((2.0 * 10 + 1.0 * 30) / 40)
    assert out["actor/ratio_mean"] == pytest.approx((1.0 * 20 + 1.2 * 10) / 30)  # fresh tokens only
    assert "is/w_mean" not in merge_update_metrics([[parts[0]]])
    assert merge_update_metrics([[], []]) == {}


def test_behaviour_weights_are_means_over_fresh_tokens() -> None:
    # the decoupled loss reports its behaviour weights over fresh tokens only: a micro-batch of
    # replayed tokens must not pull the mean towards its value, nor count in the max / min
    parts = [
        _mb(0, 30, 0, **{"actor/behav_weight_mean": 1.0, "actor/behav_weight_max": 1.5,
                         "actor/behav_weight_min": 0.5, "actor/behav_capped_frac": 0.0}),
        _mb(0, 10, 50, **{"actor/behav_weight_mean": 2.0, "actor/behav_weight_max": 3.0,
                          "actor/behav_weight_min": 0.9, "actor/behav_capped_frac": 0.5}),
        _mb(1, 0, 40, **{"actor/behav_weight_mean": 0.0, "actor/behav_weight_max": 0.0,
                         "actor/behav_weight_min": 0.0, "actor/behav_capped_frac": 0.0}),
    ]  # fmt: skip
    out = merge_update_metrics([parts])
    assert out["actor/behav_weight_mean"] == pytest.approx((1.0 * 30 + 2.0 * 10) / 40)
    assert out["actor/behav_capped_frac"] == pytest.approx(0.5 * 10 / 40)
    assert out["actor/behav_weight_max"] == 3.0 and out["actor/behav_weight_min"] == 0.5


def _row(response: list[int], sampler: list[float] | None, *, replayed: bool = False) -> Row:
    return Row(group=0, question_id=1, prompt_ids=[5], response_ids=response, reward=1.0,
               behaviour_logprobs=sampler, replayed=replayed)  # fmt: skip


def test_logprob_gap_is_a_token_mean_over_the_generated_rows_given() -> None:
    rows = [
        _row([1, 2], [-1.0, -2.0]),
        _row([3, 4], [-0.5, -0.5], replayed=True),  # stored log-probs, not the sampler's
        _row([5], None),  # a worker that reported none
        _row([6, 7, 8], [-1.0, -1.0, -1.0]),
    ]
    old = [[-1.5, -2.0], [-9.0, -9.0], [-9.0], [-1.0, -1.25, -0.5]]
    # |0.5| + 0 + 0 + |0.25| + |0.5| over the 5 tokens of rows 0 and 3
    assert logprob_gap(rows, old, [0, 1, 2, 3]) == pytest.approx(1.25 / 5)
    assert logprob_gap(rows, old, [3]) == pytest.approx(0.75 / 3)  # only the rows given
    assert logprob_gap(rows, old, [1, 2]) is None


def test_policy_lag_counts_from_the_oldest_version() -> None:
    assert policy_lag(7, [7, 6, 7]) == 1.0
    assert policy_lag(7, [7]) == 0.0 and policy_lag(3, []) == 0.0
