"""How the trainer merges the metrics of micro-batches, ranks and mini-batches into one step."""

from __future__ import annotations

import pytest

from exgrpo_trainer.step_metrics import merge_update_metrics


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
