"""Common types and helpers of the answer graders.

A grader is a plain function ``(response_text, ground_truth) -> Grade``. It must never raise for
bad model output: empty, truncated, garbage or enormous responses get ``reward = 0`` and a short,
stable ``reason`` string.

Reasons used by the built-in graders:

``correct``          the answer matches the gold answer (reward 1)
``wrong_answer``     an answer was found and does not match
``no_think_close``   think-format gate failed (no ``</think>``)
``no_answer``        no answer could be extracted (no ``\\boxed{}``, nothing parseable)
``not_integer``      (arithmetic) the boxed answer is not an integer
``bad_gold``         the ground truth itself could not be parsed
``empty``            the response is empty or only whitespace
``too_long``         the response (or gold) exceeds the size cap and was rejected
``timeout``          grading ran past its time limit
``error:<Type>``     an exception of that type was raised while grading (``error:crash`` when a
                     pool worker process died)

Math-Verify time limits: Math-Verify enforces its own limits with ``signal.alarm``, which only works
on the main thread. :func:`math_verify_timeout` tells the graders which value to pass: the library
default when running on a main thread with no outer deadline, ``None`` (no alarm) on other threads
or when an outer hard deadline is in force (:func:`external_deadline`, used by ``grade_one`` and
the pool workers).
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Literal

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_GOLD_CHARS",
    "MATH_VERIFY_DEFAULT_TIMEOUT_S",
    "Grade",
    "GradeTimeout",
    "Grader",
    "Overlong",
    "call_grader",
    "cap_inputs",
    "coerce_grade",
    "error_grade",
    "external_deadline",
    "math_verify_timeout",
    "safe_grader",
]


@dataclass(frozen=True)
class Grade:
    """Outcome of grading one response."""

    reward: float
    reason: str
    extracted: str | None = None

    @property
    def correct(self) -> bool:
        return self.reward > 0


Grader = Callable[[str, str], Grade]
"""``grader(response_text, ground_truth) -> Grade``."""

Overlong = Literal["tail", "reject"]

DEFAULT_MAX_CHARS = 50_000
"""Responses longer than this are graded on their last ``DEFAULT_MAX_CHARS`` characters (``tail``)
or rejected with reason ``too_long`` (``reject``), see :func:`cap_inputs`."""

DEFAULT_MAX_GOLD_CHARS = 10_000
"""Ground-truth strings longer than this are always rejected (``too_long``)."""

MATH_VERIFY_DEFAULT_TIMEOUT_S = 5
"""Math-Verify's own default for ``parsing_timeout`` / ``timeout_seconds`` (0.6 to 0.9)."""

EXTRACTED_MAX_CHARS = 200


class GradeTimeout(BaseException):
    """Raised inside a grader when an outer deadline (``grade_one``) expires.

    Derives from ``BaseException`` so that broad ``except Exception`` blocks in third-party code
    (Math-Verify, sympy) cannot swallow it.
    """


_outer_deadline: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "exgrpo_grader_outer_deadline", default=False
)


@contextmanager
def external_deadline() -> Iterator[None]:
    """Declare that a caller enforces a hard time limit: graders then disable Math-Verify alarms."""
    token = _outer_deadline.set(True)
    try:
        yield
    finally:
        _outer_deadline.reset(token)


def math_verify_timeout() -> int | None:
    """Value for Math-Verify's ``parsing_timeout`` / ``timeout_seconds`` in the current context."""
    if _outer_deadline.get():
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    return MATH_VERIFY_DEFAULT_TIMEOUT_S


def error_grade(exc: BaseException) -> Grade:
    return Grade(0.0, f"error:{type(exc).__name__}", None)


def clip_extracted(text: str | None) -> str | None:
    if text is None:
        return None
    return text if len(text) <= EXTRACTED_MAX_CHARS else text[:EXTRACTED_MAX_CHARS] + "..."


def coerce_grade(value: object) -> Grade:
    """Turn a grader's return value into a plain :class:`Grade`.

    User graders may return a ``Grade``, a bool or a finite number (taken as the reward, reason
    ``user``). Anything else, NaN or an infinite reward becomes ``error:BadReturn``.
    """
    bad = Grade(0.0, "error:BadReturn", None)
    if isinstance(value, Grade):
        reward_obj: object = value.reward
        reason = value.reason if isinstance(value.reason, str) else "user"
        extracted = value.extracted if isinstance(value.extracted, str) else None
    elif isinstance(value, bool | int | float):
        reward_obj, reason, extracted = value, "user", None
    else:
        return bad
    if not isinstance(reward_obj, bool | int | float):
        return bad
    reward = float(reward_obj)
    if not math.isfinite(reward):
        return bad
    return Grade(reward, reason, clip_extracted(extracted))


def call_grader(grader: Callable[[str, str], object], response: str, ground_truth: str) -> Grade:
    """Run ``grader`` and turn exceptions, Math-Verify's own timeout and odd return values into
    zero-reward grades. :class:`GradeTimeout`, ``KeyboardInterrupt`` and ``SystemExit`` propagate."""
    try:
        return coerce_grade(grader(response, ground_truth))
    except GradeTimeout:
        raise
    except Exception as exc:
        return error_grade(exc)
    except BaseException as exc:
        if _is_math_verify_timeout(exc):
            return Grade(0.0, "timeout", None)
        raise


def safe_grader(func: Grader) -> Grader:
    """Decorator: the wrapped grader never raises for bad input (see :func:`call_grader`);
    non-string inputs give ``error:TypeError``."""

    @wraps(func)
    def wrapper(response: str, ground_truth: str) -> Grade:
        if not isinstance(response, str) or not isinstance(ground_truth, str):
            return Grade(0.0, "error:TypeError", None)
        return call_grader(func, response, ground_truth)

    return wrapper


def _is_math_verify_timeout(exc: BaseException) -> bool:
    try:
        from math_verify.errors import TimeoutException
    except ImportError:  # pragma: no cover - math-verify is a dependency of the rollout extra
        return False
    return isinstance(exc, TimeoutException)


def cap_inputs(
    response: str,
    ground_truth: str,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    overlong: Overlong = "tail",
    max_gold_chars: int = DEFAULT_MAX_GOLD_CHARS,
) -> tuple[str, str] | Grade:
    """Apply the input size caps used by ``grade_one`` and :class:`GradingPool`.

    * ``overlong="tail"`` (default): a response longer than ``max_chars`` is graded on its last
      ``max_chars`` characters (final answers sit at the end of a response). Note that for the
      think-format graders the ``</think>`` split then happens inside that tail.
    * ``overlong="reject"``: such a response gets ``Grade(0, "too_long")``.

    A ground truth longer than ``max_gold_chars`` is always rejected. Non-string inputs give
    ``error:TypeError``. Returns the (possibly cut) inputs or the final grade.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        return Grade(0.0, "error:TypeError", None)
    if len(ground_truth) > max_gold_chars:
        return Grade(0.0, "too_long", None)
    if len(response) > max_chars:
        if overlong == "reject":
            return Grade(0.0, "too_long", None)
        response = response[-max_chars:]
    return response, ground_truth
