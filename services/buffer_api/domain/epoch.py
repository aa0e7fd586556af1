"""Order of the fresh questions of a run (spec section 1 item 14, quirks Q10 and Q11).

Fresh questions are read epoch by epoch from a shuffled list of *active* question ids. The active
list drops retired questions only at an epoch start, and only while enough questions remain;
within an epoch the order is fixed, so a question retired mid-epoch can still be drawn fresh.
Batches are taken with ``drop_last``: a tail shorter than the batch size starts a new epoch.
"""

from __future__ import annotations

import numbers

import numpy as np

from .rules import ExperienceRules
from .sampler import make_rng


def _id_array(ids: np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integer ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_int(value: object, what: str, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _sorted_unique(ids: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting: numpy 2.4's hash-based ``np.unique`` takes ~2 s for 1M int64 ids,
    sorting takes ~30 ms."""
    ids = np.sort(ids)
    if ids.size > 1:
        ids = ids[np.concatenate(([True], ids[1:] != ids[:-1]))]
    return ids


def epoch_order(active_ids: np.ndarray, *, seed: int, epoch: int) -> np.ndarray:
    """Deterministic shuffle (``int64``) of the active ids for one epoch.

    The ids are sorted first, so the result depends only on the set of ids, ``seed`` and ``epoch``,
    not on the input order.

    Raises:
        ValueError: the ids are not 1-D integers or contain duplicates.
    """
    ids = np.sort(_id_array(active_ids, "active_ids"))
    if ids.size > 1 and np.any(ids[1:] == ids[:-1]):
        raise ValueError("active_ids must not contain duplicates")
    _check_int(epoch, "epoch", 0)
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rng = make_rng(int(seed), int(epoch), "epoch-order")
    return rng.permutation(ids)


def refresh_active(
    all_ids: np.ndarray,
    retired: np.ndarray,
    previous_active: np.ndarray | None,
    rules: ExperienceRules,
) -> np.ndarray:
    """Active fresh-question ids for a new epoch.

    The candidate set is ``all_ids`` minus ``retired``. It becomes the new active set only when it
    holds more than ``batch_size + active_refresh_margin`` ids (148 with the defaults); otherwise the
    previous active set is kept, or all ids when there is none yet. The result is a sorted ``int64``
    array without duplicates (``previous_active`` is returned sorted and de-duplicated as well).
    """
    everything = _sorted_unique(_id_array(all_ids, "all_ids"))
    candidate = everything[~np.isin(everything, _id_array(retired, "retired"))]
    if candidate.size > rules.batch_size + rules.active_refresh_margin:
        return candidate.astype(np.int64, copy=False)
    if previous_active is not None:
        return _sorted_unique(_id_array(previous_active, "previous_active"))
    return everything


def take_fresh(order: np.ndarray, cursor: int, batch_size: int) -> tuple[np.ndarray, int] | None:
    """The next ``batch_size`` ids of ``order`` starting at ``cursor``, and the advanced cursor.

    Returns ``None`` when fewer than ``batch_size`` ids remain (drop_last): the caller starts a new
    epoch. The returned ids are a copy.

    Raises:
        ValueError: ``cursor < 0``, ``cursor`` past the end of ``order``, or ``batch_size < 1``.
    """
    ids = _id_array(order, "order")
    cursor = _check_int(cursor, "cursor", 0)
    batch_size = _check_int(batch_size, "batch_size", 1)
    if cursor > ids.size:
        raise ValueError(f"cursor {cursor} is past the end of an order of {ids.size} ids")
    end = cursor + batch_size
    if end > ids.size:
        return None
    return ids[cursor:end].copy(), end
