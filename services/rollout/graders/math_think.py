"""Training reward (spec section 7, ``reward_impl_version = 3``): think format + Math-Verify.

1. ``"<think>\\n"`` is prepended to the decoded response (the response is assumed to start inside
   the think block).
2. Format gate: the text must contain ``<think>`` and ``</think>``; otherwise reward 0
   (reason ``no_think_close``).
3. Solution part = text between the first ``</think>`` and the next ``</think>`` (or the end).
4. Gold = Math-Verify parse of ``"$" + ground_truth + "$"``; prediction = Math-Verify parse of the
   solution part (default extraction configs: LaTeX incl. ``\\boxed{}``, and plain expressions, so
   an unboxed final number is accepted). Reward = 1 if ``verify(gold, prediction)`` else 0; any
   exception gives 0.

The decoded response keeps its trailing EOS string (e.g. ``<|im_end|>``) as in the reference
recipe; ``grade_math_think(..., strip_eos=True)`` removes it first. All seven rows of the spec's
reference vectors (TV11, established with math-verify 0.6.0) give the same rewards with the
installed math-verify 0.9.0, with and without the EOS string; ``tests/unit/test_graders.py``
checks them.

Math-Verify time limits: the library defaults (5 s per parse / comparison, via ``signal.alarm``)
when called directly on a main thread; disabled under an outer hard deadline (``grade_one``, the
grading pool) or off the main thread, see :func:`exgrpo_rollout.graders.base.math_verify_timeout`.
"""

from __future__ import annotations

from exgrpo_rollout.graders.base import Grade, clip_extracted, math_verify_timeout, safe_grader
from exgrpo_rollout.graders.extract import strip_trailing_eos, think_solution

__all__ = ["grade_math_think", "math_think", "math_think_strip_eos"]


def _extracted_text(parsed: list[object]) -> str | None:
    # parse() returns [sympy_object, matched_string] on success; never str() a sympy object here
    # (printing huge expressions can take arbitrarily long).
    for item in reversed(parsed):
        if isinstance(item, str):
            return clip_extracted(item)
    return None


def grade_math_think(response: str, ground_truth: str, *, strip_eos: bool = False) -> Grade:
    """Grade one response with the training reward. Never raises for bad output."""
    return (math_think_strip_eos if strip_eos else math_think)(response, ground_truth)


def _grade(response: str, ground_truth: str, strip_eos: bool) -> Grade:
    from math_verify import parse, verify

    if not response.strip():
        return Grade(0.0, "empty", None)
    if strip_eos:
        response = strip_trailing_eos(response)
    solution = think_solution(response)
    if solution is None:
        return Grade(0.0, "no_think_close", None)
    timeout = math_verify_timeout()
    gold = parse("$" + ground_truth + "$", parsing_timeout=timeout)
    pred = parse(solution, parsing_timeout=timeout)
    extracted = _extracted_text(pred)
    if not pred:
        return Grade(0.0, "no_answer", None)
    if not gold:
        return Grade(0.0, "bad_gold", extracted)
    if verify(gold, pred, timeout_seconds=timeout):
        return Grade(1.0, "correct", extracted)
    return Grade(0.0, "wrong_answer", extracted)


@safe_grader
def math_think(response: str, ground_truth: str) -> Grade:
    """Training reward v3 exactly as specified (EOS string kept)."""
    return _grade(response, ground_truth, strip_eos=False)


@safe_grader
def math_think_strip_eos(response: str, ground_truth: str) -> Grade:
    """Variant of :func:`math_think` that removes a trailing EOS string before grading."""
    return _grade(response, ground_truth, strip_eos=True)
