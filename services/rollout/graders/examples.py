"""Example user graders, loadable by dotted path (``exgrpo_rollout.graders.examples:exact_match``).

``misbehaving`` exists to exercise the grading pool's fault handling: it hangs, crashes its
process, raises or returns garbage on request. Never use it for real grading.
"""

from __future__ import annotations

import os
import time

from exgrpo_rollout.graders.base import Grade

__all__ = ["NOT_A_GRADER", "exact_match", "misbehaving"]


def exact_match(response: str, ground_truth: str) -> Grade:
    """Reward 1 when the stripped response equals the stripped ground truth."""
    answer = response.strip()
    if answer == ground_truth.strip():
        return Grade(1.0, "correct", answer[:200])
    return Grade(0.0, "wrong_answer", answer[:200])


def misbehaving(response: str, ground_truth: str) -> Grade:
    """``exact_match``, except: ``HANG`` in the response sleeps forever, ``CRASH`` ends the process
    with ``os._exit``, ``RAISE`` raises ``RuntimeError``, ``GARBAGE`` returns a non-grade object and
    ``SPIN`` burns CPU forever."""
    if "HANG" in response:
        while True:
            time.sleep(3600)
    if "SPIN" in response:
        x = 0
        while True:
            x += 1
    if "CRASH" in response:
        os._exit(13)
    if "RAISE" in response:
        raise RuntimeError("grader failure requested")
    if "GARBAGE" in response:
        return object()  # type: ignore[return-value]  # garbage on request, see the docstring
    return exact_match(response, ground_truth)


NOT_A_GRADER = 42
"""A non-callable attribute (the registry must refuse it)."""
