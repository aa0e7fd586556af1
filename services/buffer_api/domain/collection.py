"""Experience collection decisions for one question group (spec sections 2 and 3.2).

For a group of K rewards with ``k`` correct rollouts:

* ``k == K``: the question is retired (in every phase, whether or not collection is on);
* ``lbound < k <= rbound`` and collection is on (mixed phase): the question moves to bucket ``k``
  and its correct rollouts are stored (after deduplication);
* anything else, including ``k == 0``: nothing changes; the question keeps its previous bucket.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from .rules import ExperienceRules


class GroupAction(StrEnum):
    """What happens to a question after one of its groups has been rewarded."""

    RETIRE = "retire"
    COLLECT = "collect"
    IGNORE = "ignore"


@dataclass(frozen=True, slots=True)
class GroupDecision:
    """Outcome of :func:`decide_group`.

    Attributes:
        action: retire, collect or ignore.
        num_correct: number of correct rollouts ``k`` in the group.
        bucket: the question's new bucket (``k``) for ``COLLECT``; ``None`` otherwise (a retired
            question leaves its bucket, an ignored one keeps whatever bucket it had).
        store: positions of the rollouts to store (the correct ones, ascending); empty unless ``COLLECT``.
    """

    action: GroupAction
    num_correct: int
    bucket: int | None
    store: tuple[int, ...]


def is_correct(reward: float) -> bool:
    """A rollout is correct when its reward is exactly 1 (rewards are 0/1)."""
    return reward == 1.0


def decide_group(rewards: Sequence[float], rules: ExperienceRules, *, collect: bool) -> GroupDecision:
    """Decide retirement, collection or nothing for one group of ``rules.k`` rewards.

    ``collect`` is true in the mixed phase. Retirement of an all-correct group does not depend on it.

    Raises:
        ValueError: the group does not hold exactly ``rules.k`` rewards.
    """
    if len(rewards) != rules.k:
        raise ValueError(f"expected {rules.k} rewards per group, got {len(rewards)}")
    correct = tuple(i for i, r in enumerate(rewards) if is_correct(r))
    k = len(correct)
    if k == rules.k:
        return GroupDecision(action=GroupAction.RETIRE, num_correct=k, bucket=None, store=())
    if collect and rules.lbound < k <= rules.rbound_eff:
        return GroupDecision(action=GroupAction.COLLECT, num_correct=k, bucket=k, store=correct)
    return GroupDecision(action=GroupAction.IGNORE, num_correct=k, bucket=None, store=())


_INT32_MIN = np.iinfo(np.int32).min
_INT32_MAX = np.iinfo(np.int32).max


def trajectory_key(token_ids: np.ndarray | bytes) -> bytes:
    """Deduplication key of a trajectory: SHA-256 (32 bytes) of its token ids as little-endian int32.

    ``token_ids`` is a 1-D integer array (or any 1-D integer sequence), or ``bytes`` that already hold
    the little-endian int32 encoding; both forms of the same ids give the same key.

    Raises:
        ValueError: the ids are empty, not 1-D integers, outside the int32 range, or the byte
            string's length is not a multiple of 4.
    """
    if isinstance(token_ids, bytes | bytearray | memoryview):
        # hashed where the bytes lie (a view into a frame's buffer too; a strided one copied first)
        view = memoryview(token_ids)
        if view.nbytes == 0 or view.nbytes % 4:
            raise ValueError(f"token bytes must be a non-empty multiple of 4 bytes, got {view.nbytes}")
        return hashlib.sha256(view if view.c_contiguous else view.tobytes()).digest()
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"token ids must be a non-empty 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX:
        raise ValueError("token ids must fit in int32")
    return hashlib.sha256(arr.astype("<i4", copy=False).tobytes()).digest()


def dedup(keys: Sequence[bytes], existing: Collection[bytes]) -> list[int]:
    """Positions of the keys to keep: not in ``existing`` and not seen earlier in ``keys``.

    The first occurrence of a repeated key wins; positions are returned in ascending order.
    """
    seen: set[bytes] = set()
    keep: list[int] = []
    for i, key in enumerate(keys):
        if key in existing or key in seen:
            continue
        seen.add(key)
        keep.append(i)
    return keep
