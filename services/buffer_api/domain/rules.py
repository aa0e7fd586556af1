"""Configuration of the experience pool: bucket bounds, bucket weighting and batch mixing.

The defaults reproduce the official ExGRPO run (spec sections 3, 4.1, 5.1 and 5.4):
K = 8 rollouts per question, eligibility interval ``(0, 7]``, a Gaussian bucket weight with
mean K/2 and standard deviation 1 in success-count units, half of the 128 question slots
replayed, and the switch to the mixed phase once the batch accuracy exceeds 0.35.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal, get_args

Weighting = Literal["normal", "linear", "sqrt", "linear_clip", "uniform"]
"""How buckets are weighted when replayed questions are sampled (spec 4.1)."""

Phase = Literal["on_policy", "mixed"]
"""Training phase: purely on-policy before the delayed start, mixed (fresh + replay) after it."""

Unit = Literal["count", "accuracy"]
"""Axis of the Gaussian bucket weight: success count ``k`` or accuracy ``k / K``."""

WEIGHTINGS: tuple[str, ...] = get_args(Weighting)
PHASES: tuple[str, ...] = get_args(Phase)
UNITS: tuple[str, ...] = get_args(Unit)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExperienceRules:
    """Validated, immutable settings of the experience pool.

    Attributes:
        k: rollouts per question (group size K).
        lbound: exclusive lower bound of the success counts that are collected.
        rbound: inclusive upper bound of the success counts that are collected; ``None`` means K - 1.
        weighting: bucket weighting used by the replay sampler.
        mu: centre of the Gaussian weight; ``None`` means K/2 (count unit) or 0.5 (accuracy unit).
        sigma: standard deviation of the Gaussian weight, in the chosen unit.
        unit: whether the Gaussian is over the success count ``k`` or the accuracy ``k / K``.
        experience_ratio: fraction of the question slots of a mixed-phase batch that are replayed.
        batch_size: questions per training step (B).
        start_threshold: batch accuracy that must be strictly exceeded to enter the mixed phase.
        active_refresh_margin: the active fresh-question set is rebuilt at an epoch start only when it
            would keep more than ``batch_size + active_refresh_margin`` questions.
        max_replay_age: a stored trajectory collected more than this many steps before the run's
            current step is not replayed (it stays stored); ``None``: no limit (the spec's).
    """

    k: int = 8
    lbound: int = 0
    rbound: int | None = None
    weighting: Weighting = "normal"
    mu: float | None = None
    sigma: float = 1.0
    unit: Unit = "count"
    experience_ratio: float = 0.5
    batch_size: int = 128
    start_threshold: float = 0.35
    active_refresh_margin: int = 20
    max_replay_age: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.k) or self.k < 2:
            raise ValueError(f"k must be an integer >= 2, got {self.k!r}")
        if not _is_int(self.lbound) or self.lbound < 0:
            raise ValueError(f"lbound must be an integer >= 0, got {self.lbound!r}")
        if self.rbound is not None and not _is_int(self.rbound):
            raise ValueError(f"rbound must be an integer or None, got {self.rbound!r}")
        rbound = self.rbound_eff
        if not self.lbound < rbound <= self.k - 1:
            raise ValueError(
                f"rbound must satisfy lbound < rbound <= k - 1 (lbound={self.lbound}, "
                f"rbound={rbound}, k={self.k})"
            )
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if self.mu is not None and not (_is_real(self.mu) and math.isfinite(self.mu)):
            raise ValueError(f"mu must be a finite number or None, got {self.mu!r}")
        if not (_is_real(self.sigma) and math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"sigma must be a finite number > 0, got {self.sigma!r}")
        if not (_is_real(self.experience_ratio) and 0.0 <= self.experience_ratio <= 1.0):
            raise ValueError(f"experience_ratio must be in [0, 1], got {self.experience_ratio!r}")
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not (_is_real(self.start_threshold) and 0.0 <= self.start_threshold <= 1.0):
            raise ValueError(f"start_threshold must be in [0, 1], got {self.start_threshold!r}")
        if not _is_int(self.active_refresh_margin) or self.active_refresh_margin < 0:
            raise ValueError(
                f"active_refresh_margin must be an integer >= 0, got {self.active_refresh_margin!r}"
            )
        if self.max_replay_age is not None and not (
            _is_int(self.max_replay_age) and self.max_replay_age >= 1
        ):
            raise ValueError(f"max_replay_age must be an integer >= 1 or None, got {self.max_replay_age!r}")

    @property
    def rbound_eff(self) -> int:
        """The inclusive upper bound of collected success counts (K - 1 when ``rbound`` is None)."""
        return self.k - 1 if self.rbound is None else self.rbound

    @property
    def mu_eff(self) -> float:
        """The centre of the Gaussian weight in the configured unit."""
        if self.mu is not None:
            return float(self.mu)
        return self.k / 2.0 if self.unit == "count" else 0.5
