"""Grader for synthetic integer-arithmetic tasks.

Same think-format gate as the training reward (``"<think>\\n"`` is prepended, ``</think>`` is
required, the solution is the text between the first and the next ``</think>``). The answer is the
last ``\\boxed{...}`` of the solution and must be an integer; it is compared exactly with the gold
integer. Accepted spellings: ``-5``, ``+5``, U+2212 minus, ``1,234`` / ``1{,}234`` /
``1\\,234`` (thousands groups of three digits), surrounding ``$``, spaces and a ``\\text{}``
wrapper. No ``\\boxed{}`` -> ``no_answer``; a non-integer box -> ``not_integer``.
"""

from __future__ import annotations

import re

from exgrpo_rollout.graders.base import Grade, clip_extracted, safe_grader
from exgrpo_rollout.graders.extract import extract_last_boxed, think_solution

__all__ = ["arithmetic", "parse_integer"]

_MAX_DIGITS = 1_000
_INTEGER = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)")
_WRAPPER = re.compile(r"\\(?:text|mathrm|mathbf|textbf|mbox)\s*\{([^{}]*)\}")


def parse_integer(text: str) -> int | None:
    """Integer written in ``text`` (see the module docstring for accepted forms), else ``None``."""
    s = text.strip()
    if len(s) > 4 * _MAX_DIGITS:
        return None
    s = _WRAPPER.sub(lambda m: m.group(1), s)
    s = s.replace("$", "").replace("\u2212", "-").replace("{,}", ",").replace("\\,", ",").replace("\\!", "")
    s = re.sub(r"\s+", "", s)
    m = _INTEGER.fullmatch(s)
    if not m:
        return None
    digits = m.group(2).replace(",", "")
    if len(digits) > _MAX_DIGITS:
        return None
    value = int(digits)
    return -value if m.group(1) == "-" else value


@safe_grader
def arithmetic(response: str, ground_truth: str) -> Grade:
    """Exact integer grading of a think-formatted response with a boxed answer."""
    if not response.strip():
        return Grade(0.0, "empty", None)
    solution = think_solution(response)
    if solution is None:
        return Grade(0.0, "no_think_close", None)
    answer = extract_last_boxed(solution)
    if answer is None or not answer.strip():
        return Grade(0.0, "no_answer", None)
    extracted = clip_extracted(answer.strip())
    pred = parse_integer(answer)
    if pred is None:
        return Grade(0.0, "not_integer", extracted)
    gold = parse_integer(ground_truth)
    if gold is None:
        return Grade(0.0, "bad_gold", extracted)
    if pred == gold:
        return Grade(1.0, "correct", extracted)
    return Grade(0.0, "wrong_answer", extracted)
