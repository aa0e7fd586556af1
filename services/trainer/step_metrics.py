"""A step's metrics: the timing split, the batch summary, and the merge of micro-batch metrics.

Pure bookkeeping over floats; the components record into one `StepTimer` per step, the learner's
micro-batch metrics are merged by `merge_update_metrics`, `batch_metrics` summarises the rows, and
`policy_lag` / `logprob_gap` say how far the samples were from the policy that learns from them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from exgrpo_trainer.algo import Row


class StepTimer:
    """Seconds spent per part of a step (`timing/<part>`), summed over repeated parts."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def reset(self) -> None:
        self.parts = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.parts.items()}


def batch_metrics(
    rows: Sequence[Row],
    finish: Sequence[str | None],
    slots: Sequence[bool],
    old_entropy: Sequence[Sequence[float]] | None,
    mixed: bool,
) -> dict[str, float]:
    """The step's `batch/*`, `response/*` and `actor/old_entropy` metrics (that one only with
    `old_entropy`, the entropies under pi_old). `slots` holds one `replayed` flag per question slot;
    `finish` one finish reason per row (None for replayed rows)."""
    rewards = [r.reward for r in rows]
    generated = [r for r in rows if not r.replayed]
    lengths = [len(r.response_ids) for r in generated]
    truncated = sum(1 for f in finish if f == "length")
    out = {
        "batch/solved": float(np.mean([x == 1.0 for x in rewards])) if rewards else 0.0,
        "batch/reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "batch/questions": float(len(slots)),
        "batch/replayed_questions": float(sum(slots)),
        "batch/rows": float(len(rows)),
        "batch/generated": float(len(generated)),
        "response/length_mean": float(np.mean(lengths)) if lengths else 0.0,
        "response/length_max": float(max(lengths)) if lengths else 0.0,
        "response/truncated_frac": truncated / max(1, len(generated)),
        "phase/mixed": float(mixed),
    }
    if old_entropy is not None:
        means = [np.mean(e) for e in old_entropy if e]
        out["actor/old_entropy"] = float(np.mean(means)) if means else 0.0
    return out


def policy_lag(trainer_version: int, versions: Sequence[int]) -> float:
    """`rollout/policy_lag_max`: the trainer's policy version at the update minus the oldest version
    the step's fresh rollouts were generated with (0 when every one used the trainer's weights)."""
    return float(trainer_version - min(versions)) if versions else 0.0


def logprob_gap(
    rows: Sequence[Row], old_logprobs: Sequence[Sequence[float]], indices: Sequence[int]
) -> float | None:
    """`rollout/logprob_gap`: the mean |sampler log-prob - trainer pi_old log-prob| over the generated
    tokens of the rows `indices` (the first mini-batch, whose pi_old is exact); None when none of them
    carries sampler log-probs."""
    total, count = 0.0, 0
    for i in indices:
        row = rows[i]
        if row.replayed or not row.behaviour_logprobs:
            continue
        n = min(len(row.behaviour_logprobs), len(old_logprobs[i]))
        total += float(np.abs(np.subtract(row.behaviour_logprobs[:n], old_logprobs[i][:n])).sum())
        count += n
    return total / count if count else None


def merge_update_metrics(per_rank: list[list[dict[str, float]]]) -> dict[str, float]:
    """One value per key from the metrics of every micro-batch of every rank.

    The loss terms and the entropy / KL token means of a micro-batch are its share of the
    mini-batch's value (token sums over the mini-batch's token count), so they add up within a
    mini-batch; the step reports their mean over mini-batches. Ratio statistics are weighted by
    fresh tokens, importance-weight statistics by replayed tokens (and left out when nothing was
    replayed), token counts are summed. Keys starting with `_` are bookkeeping (`_minibatch`,
    `_tokens`) and are not reported."""
    parts = [m for rank in per_rank for m in rank if m]
    if not parts:
        return {}
    keys = {k for m in parts for k in m if not k.startswith("_")}
    replay = [m.get("tokens/replay", 0.0) for m in parts]
    weights = {
        "fresh": [m.get("tokens/fresh", 0.0) for m in parts],
        "replay": replay,
        "tokens": [m.get("_tokens", 0.0) for m in parts],
    }
    has_replay = sum(replay) > 0
    out: dict[str, float] = {}
    for k in keys:
        if k.startswith("is/") and not has_replay:
            continue
        out[k] = _merge_key(k, parts, weights, replay)
    return out


def _merge_key(
    k: str, parts: list[dict[str, float]], weights: dict[str, list[float]], replay: list[float]
) -> float:
    def weighted(w: list[float]) -> float:
        total = sum(x for m, x in zip(parts, w, strict=True) if k in m)
        num = sum(m[k] * x for m, x in zip(parts, w, strict=True) if k in m)
        return num / total if total > 0 else 0.0

    if k.startswith("tokens/"):
        return float(sum(m.get(k, 0.0) for m in parts))
    if k.startswith("loss/") or k in ("actor/entropy", "actor/kl"):
        minibatches = sorted({m.get("_minibatch", 0.0) for m in parts})
        per_mb = [sum(m.get(k, 0.0) for m in parts if m.get("_minibatch", 0.0) == i) for i in minibatches]
        return float(sum(per_mb) / len(per_mb))
    if k.startswith("is/"):
        vals = [m[k] for m, n in zip(parts, replay, strict=True) if n > 0 and k in m]
        if k.endswith("_max"):
            return float(max(vals))
        if k.endswith("_min"):
            return float(min(vals))
        return float(weighted(weights["replay"]))
    if k.startswith("actor/behav"):  # the decoupled loss's behaviour weights, over fresh tokens
        vals = [m[k] for m, n in zip(parts, weights["fresh"], strict=True) if n > 0 and k in m]
        if k.endswith("_max"):
            return float(max(vals, default=0.0))
        if k.endswith("_min"):
            return float(min(vals, default=0.0))
        return float(weighted(weights["fresh"]))
    if k.startswith("actor/ratio"):
        return float(weighted(weights["fresh"]))
    if k.endswith("_max"):
        return float(max(m[k] for m in parts if k in m))
    if k.endswith("_min"):
        return float(min(m[k] for m in parts if k in m))
    return float(weighted(weights["tokens"]))
