"""Group-relative advantages (spec 5.3).

ExGRPO uses the GRPO advantage without the standard-deviation division: ``A_i = r_i - mean(r)`` over
the rewards of one group (K sequences of one question; a replayed question's group holds the replayed
trajectory and K - 1 fresh rollouts). The scalar is later broadcast to every response token of the
sequence. Groups with identical rewards get ``A = 0`` and are not filtered out (quirk Q13).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def group_advantages(
    rewards: Sequence[float] | np.ndarray, *, use_std: bool = False, eps: float = 1e-6
) -> np.ndarray:
    """Advantages of one group of rewards.

    Args:
        rewards: ``[K]`` rewards of the sequences of one group.
        use_std: also divide by the unbiased standard deviation plus ``eps`` (off in the official run).
        eps: added to the standard deviation when ``use_std`` is set.

    Returns:
        ``[K]`` float64 advantages. A singleton group gets its reward back unchanged (mean 0, std 1
        by convention), whatever ``use_std`` says.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {r.shape}")
    if r.size == 1:
        return r.copy()
    adv = r - float(r.mean())
    if use_std:
        adv /= float(r.std(ddof=1)) + eps
    return adv


def batch_advantages(
    rewards: Sequence[Sequence[float]] | Sequence[np.ndarray],
    *,
    use_std: bool = False,
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """Advantages of several groups, one array per group in input order (see `group_advantages`)."""
    return [group_advantages(group, use_std=use_std, eps=eps) for group in rewards]
