"""Batch composition and the delayed start (spec 5.1 and 5.4)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from .collection import is_correct
from .rules import PHASES, ExperienceRules, Phase


@dataclass(frozen=True, slots=True)
class Composition:
    """Question and row counts of one training step.

    Attributes:
        num_replay: replayed questions (``n_exp``).
        num_fresh: fresh questions used (``B - n_exp``).
        replay_rows: replayed trajectories, one per replayed question.
        fresh_rollouts: freshly generated sequences: ``(K - 1)`` per replayed question, ``K`` per fresh one.
        total_rows: all sequences of the step, always ``B * K``.
        skipped_fresh: questions the loader drew but the step does not use (``n_exp``, spec Q11).
    """

    num_replay: int
    num_fresh: int
    replay_rows: int
    fresh_rollouts: int
    total_rows: int
    skipped_fresh: int


def replay_target(batch_size: int, experience_ratio: float) -> int:
    """``floor(batch_size * experience_ratio)``, computed on the ratio's decimal value.

    The official code evaluates ``int(B * ratio)`` in binary floating point, which can land one
    below the intended value (``100 * 0.29 == 28.999999999999996``). Here the ratio is read as the
    shortest decimal that round-trips (``Fraction(repr(ratio))``) and the product is floored
    exactly, so ``100 * 0.29`` gives 29. For the official configuration (128 x 0.5 = 64) both agree.
    """
    return math.floor(batch_size * Fraction(repr(float(experience_ratio))))


def compose_batch(
    num_eligible: int,
    rules: ExperienceRules,
    *,
    phase: Phase,
    batch_size: int | None = None,
    experience_ratio: float | None = None,
) -> Composition:
    """How many replayed and fresh questions the next step uses.

    On-policy: ``B`` fresh questions and no replay. Mixed:
    ``n_exp = min(num_eligible, floor(B * ratio))`` replayed questions and ``B - n_exp`` fresh ones;
    the loader still draws ``B`` fresh questions and the last ``n_exp`` are skipped. ``batch_size`` and
    ``experience_ratio`` default to the rules' values.

    Raises:
        ValueError: negative ``num_eligible``, unknown phase, ``batch_size < 1`` or a ratio outside [0, 1].
    """
    if not isinstance(num_eligible, numbers.Integral) or isinstance(num_eligible, bool) or num_eligible < 0:
        raise ValueError(f"num_eligible must be an integer >= 0, got {num_eligible!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    big_b = rules.batch_size if batch_size is None else batch_size
    ratio = rules.experience_ratio if experience_ratio is None else experience_ratio
    if not isinstance(big_b, numbers.Integral) or isinstance(big_b, bool) or big_b < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {big_b!r}")
    if not (isinstance(ratio, numbers.Real) and 0.0 <= ratio <= 1.0):
        raise ValueError(f"experience_ratio must be in [0, 1], got {ratio!r}")
    big_b = int(big_b)
    k = rules.k
    n_exp = 0 if phase == "on_policy" else min(int(num_eligible), replay_target(big_b, ratio))
    n_fresh = big_b - n_exp
    return Composition(
        num_replay=n_exp,
        num_fresh=n_fresh,
        replay_rows=n_exp,
        fresh_rollouts=n_exp * (k - 1) + n_fresh * k,
        total_rows=big_b * k,
        skipped_fresh=n_exp,
    )


def solved_fraction(rewards: Iterable[float]) -> float:
    """Fraction of correct sequences among all sequences of a step (``batch/solved``).

    Raises:
        ValueError: no rewards.
    """
    total = 0
    correct = 0
    for r in rewards:
        total += 1
        correct += is_correct(r)
    return solved_fraction_of(correct, total)


def solved_fraction_of(correct: int, total: int) -> float:
    """`solved_fraction` of `total` rewards of which `correct` are correct (counted elsewhere).

    Raises:
        ValueError: no rewards.
    """
    if total == 0:
        raise ValueError("solved_fraction needs at least one reward")
    return correct / total


def next_phase(phase: Phase, solved: float, rules: ExperienceRules) -> Phase:
    """Phase of the next step: switch to ``mixed`` once ``solved > start_threshold`` (strict), never back.

    Raises:
        ValueError: unknown phase, or ``solved`` is not a number in [0, 1].
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if not (isinstance(solved, numbers.Real) and 0.0 <= solved <= 1.0):
        raise ValueError(f"solved must be a fraction in [0, 1], got {solved!r}")
    if phase == "mixed" or solved > rules.start_threshold:
        return "mixed"
    return "on_policy"
