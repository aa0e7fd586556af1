"""Bucket weights and bucket probabilities of the replay sampler (spec 4.1, steps 1-2).

A bucket is the set of eligible questions whose latest collected group had exactly ``k`` correct
rollouts. The sampler first picks buckets with probability proportional to a weight ``w(k)`` and then
picks questions uniformly inside a bucket, so ``p(k)`` is a per-bucket probability that does not
depend on how many questions a bucket holds.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

from .rules import ExperienceRules


def _check_bucket(k: int, rules: ExperienceRules) -> int:
    if not isinstance(k, numbers.Integral) or isinstance(k, bool):
        raise ValueError(f"bucket key must be an integer, got {k!r}")
    if not 0 <= k <= rules.k:
        raise ValueError(f"bucket key must be in [0, {rules.k}], got {k}")
    return int(k)


def _gaussian_x(k: int, rules: ExperienceRules) -> float:
    return float(k) if rules.unit == "count" else k / rules.k


def _log_weight(k: int, rules: ExperienceRules) -> float:
    """Log of the unnormalised Gaussian weight of bucket ``k``, without the constant factor."""
    sigma = rules.sigma
    return -((_gaussian_x(k, rules) - rules.mu_eff) ** 2) / (2.0 * sigma * sigma)


def bucket_weight(k: int, rules: ExperienceRules) -> float:
    """Unnormalised weight ``w(k)`` of bucket ``k`` under ``rules.weighting``.

    * ``normal``: Gaussian density ``exp(-(x - mu)^2 / (2 sigma^2)) / sqrt(2 pi sigma^2)`` with
      ``x = k`` (count unit, default ``mu = K/2``) or ``x = k / K`` (accuracy unit, default ``mu = 0.5``).
    * ``linear``: ``k / K``.  ``sqrt``: ``sqrt(k / K)``.
    * ``linear_clip``: ``k / K`` if ``k <= K/2`` else ``0.5``.
    * ``uniform``: ``1.0``.
    """
    k = _check_bucket(k, rules)
    big_k = rules.k
    match rules.weighting:
        case "normal":
            sigma = rules.sigma
            z = _gaussian_x(k, rules) - rules.mu_eff
            return math.exp(-(z * z) / (2.0 * sigma * sigma)) / math.sqrt(2.0 * math.pi * sigma * sigma)
        case "linear":
            return k / big_k
        case "sqrt":
            return math.sqrt(k / big_k)
        case "linear_clip":
            return k / big_k if k <= big_k / 2 else 0.5
        case "uniform":
            return 1.0
    raise ValueError(f"unknown weighting {rules.weighting!r}")  # pragma: no cover - rules validate it


def bucket_probs(nonempty: Iterable[int], rules: ExperienceRules) -> dict[int, float]:
    """Bucket probabilities ``p(k) = w(k) / sum_k' w(k')`` normalised over the given buckets.

    ``nonempty`` lists the keys of the buckets that hold at least one eligible question (duplicates
    are ignored). The result is keyed by bucket in ascending order. The Gaussian weighting is
    normalised in log space, so a narrow ``sigma`` cannot underflow every weight to zero; the
    result equals ``w(k) / sum w`` up to rounding.

    Raises:
        ValueError: no bucket is given, a key is outside ``[0, K]``, or every weight is zero
            (e.g. only bucket 0 under ``linear``).
    """
    keys = sorted({_check_bucket(k, rules) for k in nonempty})
    if not keys:
        raise ValueError("bucket_probs needs at least one non-empty bucket")
    if rules.weighting == "normal":
        log_w = [_log_weight(k, rules) for k in keys]
        top = max(log_w)
        weights = [math.exp(lw - top) for lw in log_w]
    else:
        weights = [bucket_weight(k, rules) for k in keys]
    total = math.fsum(weights)
    if not total > 0.0:
        raise ValueError(f"all bucket weights are zero for buckets {keys} under {rules.weighting!r}")
    return {k: w / total for k, w in zip(keys, weights, strict=True)}


def check_weights(rules: ExperienceRules) -> None:
    """Raise ``ValueError`` unless the replay sampler can weight every set of buckets.

    Eligible questions sit in buckets ``1 .. K-1``. Each of them must get a finite, positive
    weight (for ``normal``, a finite log-weight, since the probabilities are normalised in log
    space): then every non-empty set of buckets has a positive, finite total and
    :func:`bucket_probs` works for it. Finite ``mu`` and ``sigma`` are not enough on their own:
    ``sigma = 1e-200`` divides by zero and ``mu = 1e308`` overflows.
    """
    keys = list(range(1, rules.k))
    what = f"weighting {rules.weighting!r}"
    if rules.weighting == "normal":
        what += f" (mu = {rules.mu_eff!r}, sigma = {rules.sigma!r}, unit {rules.unit!r})"
    try:
        if rules.weighting == "normal":
            bad = [k for k in keys if not math.isfinite(_log_weight(k, rules))]
        else:
            bad = [k for k in keys if not (math.isfinite(w := bucket_weight(k, rules)) and w > 0.0)]
        if not bad:
            probs = bucket_probs(keys, rules)
            bad = [k for k, p in probs.items() if not math.isfinite(p)]
    except ArithmeticError as e:  # ZeroDivisionError, OverflowError
        raise ValueError(
            f"{what} gives no usable bucket weights ({e}): choose mu and sigma so that "
            "(k - mu)^2 / (2 sigma^2) stays finite for k in 1..K-1"
        ) from e
    if bad:
        raise ValueError(
            f"{what} gives buckets {bad} no finite positive weight: choose mu and sigma so that "
            "(k - mu)^2 / (2 sigma^2) stays finite for k in 1..K-1"
        )
