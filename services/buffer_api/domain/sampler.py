"""Replay question sampler (spec 4.1, steps 3-5).

The sampler works on bucket sizes only: a bucket ``k`` of size ``s`` is addressed by the positions
``0 .. s-1`` of its questions, and the caller maps a ``(bucket, index)`` pair back to a question id.
All randomness comes from an explicit :class:`numpy.random.Generator`, so a draw is reproducible from
its seed (see :func:`make_rng`).
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .buckets import bucket_probs
from .rules import ExperienceRules


def _as_count(value: object, what: str) -> int:
    if type(value) is int and value >= 0:  # the common case, without the ABC check
        return value
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return int(value)


def _bucket_key(key: object) -> int:
    if type(key) is int:
        return key
    if not isinstance(key, numbers.Integral) or isinstance(key, bool):
        raise ValueError(f"bucket key must be an integer, got {key!r}")
    return int(key)


#: Counts per bucket: a list of ints or an integer array.
IntVector = Sequence[int] | npt.NDArray[np.integer[Any]]


def _int_vector(values: IntVector, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=True)
    if np.any(arr < 0):
        raise ValueError(f"{what} must be >= 0")
    return arr


def allocate_counts(
    counts: IntVector,
    sizes: IntVector,
    probs: Sequence[float],
    rng: np.random.Generator,
) -> list[int]:
    """Cap per-bucket counts at the bucket sizes and hand the excess back to buckets with room.

    Each count is cut to its bucket's size. The total excess is then re-assigned one unit at a time;
    every unit goes to a bucket that still has spare capacity, chosen with probability proportional to
    its original ``probs`` entry renormalised over the buckets that still have room (spec 4.1 step 4).

    The unit-by-unit procedure is the same as drawing units i.i.d. from the renormalised ``probs`` and
    rejecting any unit that lands in a full bucket. Among ``m`` such draws with ``hits[b]`` landing in
    bucket ``b``, exactly ``min(hits[b], room[b])`` are accepted, so it is sampled in rounds:
    ``hits ~ Multinomial(excess, p renormalised over buckets with room)``, accept ``min(hits, room)``,
    and draw the rejected remainder again in the next round. Every round that leaves a remainder fills
    at least one bucket, so there are at most ``len(sizes)`` rounds whatever the size of the excess.

    If every bucket that still has room has probability zero, the remaining units are spread
    uniformly over the remaining spare slots (multivariate hypergeometric), so the call still
    succeeds whenever ``sum(counts) <= sum(sizes)``.

    Raises:
        ValueError: the sequences differ in length, hold negative values or non-finite probabilities,
            or ``sum(counts) > sum(sizes)``.
    """
    c = _int_vector(counts, "counts")
    s = _int_vector(sizes, "sizes")
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or not len(c) == len(s) == len(p):
        raise ValueError(
            f"counts, sizes and probs must be 1-D of equal length, got {len(c)}, {len(s)}, {p.size}"
        )
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("probs must be finite and >= 0")
    if int(c.sum()) > int(s.sum()):
        raise ValueError(f"cannot place {int(c.sum())} draws in buckets holding {int(s.sum())} questions")
    return _allocate(c, s, p, rng)


def _allocate(c: np.ndarray, s: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> list[int]:
    """`allocate_counts` on inputs it has checked (int64 counts and sizes, float64 probabilities)."""
    adj = np.minimum(c, s)
    excess = int(c.sum() - adj.sum())
    while excess > 0:
        avail = np.flatnonzero(adj < s)
        room = s[avail] - adj[avail]
        q = p[avail]
        q_total = q.sum()
        if not q_total > 0.0:
            adj[avail] += rng.multivariate_hypergeometric(room, excess)
            break
        accepted = np.minimum(rng.multinomial(excess, q / q_total), room)
        adj[avail] += accepted
        excess -= int(accepted.sum())
    return [int(x) for x in adj]


def sample_bucket_counts(
    sizes: Mapping[int, int],
    n: int,
    rules: ExperienceRules,
    rng: np.random.Generator,
) -> dict[int, int]:
    """Number of questions to draw from each non-empty bucket.

    Only buckets with size > 0 take part and the request is cut to ``min(n, total size)``. With
    ``weighting == "uniform"`` the questions are uniform over all eligible questions (multivariate
    hypergeometric over the bucket sizes); otherwise the counts are ``Multinomial(n, p)`` with the bucket
    probabilities of :func:`~.buckets.bucket_probs`, followed by :func:`allocate_counts`.

    Returns:
        A dict keyed by every non-empty bucket in ascending order (a count may be 0); the values sum
        to exactly ``min(n, total)`` and never exceed the bucket size. Buckets are processed in
        ascending key order, so the mapping's own order does not affect the result.
    """
    n = _as_count(n, "n")
    counts, _ = _bucket_counts(_checked_sizes(sizes), n, rules, rng)
    return counts


def _checked_sizes(sizes: Mapping[int, int]) -> dict[int, int]:
    """`sizes` with every key and size checked (integers, sizes >= 0), as plain ints."""
    out: dict[int, int] = {}
    for k, v in sizes.items():
        key = _bucket_key(k)
        out[key] = v if type(v) is int and v >= 0 else _as_count(v, f"size of bucket {k}")
    return out


def _bucket_counts(
    sizes: dict[int, int], n: int, rules: ExperienceRules, rng: np.random.Generator
) -> tuple[dict[int, int], dict[int, float]]:
    """`sample_bucket_counts` on checked sizes, with the non-empty buckets' probabilities."""
    items = sorted((k, v) for k, v in sizes.items() if v > 0)
    if not items:
        return {}, {}
    keys = [k for k, _ in items]
    sz = np.array([v for _, v in items], dtype=np.int64)
    n = min(n, int(sz.sum()))
    probs = bucket_probs(keys, rules)
    if rules.weighting == "uniform":
        counts = [int(x) for x in rng.multivariate_hypergeometric(sz, n)]
    else:
        pv = [probs[k] for k in keys]
        multinomial = rng.multinomial(n, pv)
        counts = _allocate(multinomial.astype(np.int64, copy=True), sz, np.asarray(pv, dtype=np.float64), rng)
    return dict(zip(keys, counts, strict=True)), probs


def draw_indices(size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct indices drawn uniformly without replacement from ``range(size)``.

    Returns an ``int64`` array sorted in ascending order. For ``count`` much smaller than ``size``
    numpy's generator uses a hash-set (Floyd-style) method, so memory and time scale with ``count``
    rather than ``size`` (sizes of 10^7 with a few thousand draws take well under a millisecond).

    Raises:
        ValueError: ``size`` or ``count`` is negative, or ``count > size``.
    """
    size = _as_count(size, "size")
    count = _as_count(count, "count")
    if count > size:
        raise ValueError(f"cannot draw {count} distinct indices from {size}")
    if count == 0:
        return np.empty(0, dtype=np.int64)
    return _draw_sorted(size, count, rng)


def _draw_sorted(size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`draw_indices` on a checked `0 < count <= size`."""
    picked = rng.choice(size, size=count, replace=False, shuffle=False)
    return np.sort(np.asarray(picked, dtype=np.int64))


@dataclass(frozen=True, slots=True)
class Draw:
    """One sampled question: position ``index`` inside bucket ``bucket``.

    ``probability`` is the probability that one draw lands in this bucket: ``p(k)`` of
    :func:`~.buckets.bucket_probs` for the weighted methods, and the bucket's share of the eligible
    questions (size / total) for ``uniform``, where questions rather than buckets are drawn uniformly.
    """

    bucket: int
    index: int
    probability: float


def sample_replay(
    sizes: Mapping[int, int],
    n: int,
    rules: ExperienceRules,
    rng: np.random.Generator,
) -> list[Draw]:
    """Sample ``min(n, total)`` distinct questions for replay.

    Combines :func:`sample_bucket_counts` and :func:`draw_indices`. The draws are ordered by bucket
    (ascending) and by index inside a bucket; slot order is shuffled later, at batch assembly.
    The result depends only on ``sizes``, ``n``, ``rules`` and the generator's state.
    """
    checked = _checked_sizes(sizes)
    counts, probs = _bucket_counts(checked, _as_count(n, "n"), rules, rng)
    if not counts:
        return []
    if rules.weighting == "uniform":
        total = sum(checked[k] for k in counts)
        share = {k: checked[k] / total for k in counts}
    else:
        share = probs  # `bucket_probs` of the same non-empty buckets
    draws: list[Draw] = []
    for k, c in counts.items():
        if c == 0:
            continue
        prob = float(share[k])
        draws += [Draw(k, i, prob) for i in _draw_sorted(checked[k], c, rng).tolist()]
    return draws


def _encode_key(key: int | str) -> bytes:
    if isinstance(key, bool) or not isinstance(key, int | str | numbers.Integral):
        raise TypeError(f"rng keys must be int or str, got {type(key).__name__}")
    if isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    else:
        tag, payload = b"i", str(int(key)).encode("ascii")
    return tag + len(payload).to_bytes(8, "little") + payload


def make_rng(*keys: int | str) -> np.random.Generator:
    """A generator seeded deterministically from a tuple of keys, e.g. ``(run_seed, step, "replay")``.

    The keys are encoded unambiguously (type tag, length, payload), hashed with SHA-256 and the
    digest seeds a :class:`numpy.random.SeedSequence`, so the stream is stable across processes and
    Python versions (no dependence on ``hash()`` randomisation) and distinct key tuples give
    independent streams. Negative integers are allowed.

    Raises:
        ValueError: no key is given.
        TypeError: a key is neither an integer nor a string (``bool`` is rejected).
    """
    if not keys:
        raise ValueError("make_rng needs at least one key")
    digest = hashlib.sha256(b"".join(_encode_key(k) for k in keys)).digest()
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(digest, "little"))))
