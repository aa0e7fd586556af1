"""Parser warm-up for grading workers.

Math-Verify parses LaTeX with an ANTLR parser whose prediction tables are built lazily and cached
per process: a fresh process grades noticeably slower for its first few hundred answers.
:func:`warm_up` parses a spread of typical answer shapes once. The grading pool runs it in the fork
server (by preloading :mod:`exgrpo_rollout.graders.warm_preload`), so every worker forked from it,
including replacements for killed workers, starts warm.
"""

from __future__ import annotations

import logging

__all__ = ["WARMUP_ANSWERS", "is_warm", "warm_up"]

logger = logging.getLogger(__name__)

WARMUP_ANSWERS: tuple[str, ...] = (
    "204",
    "-4",
    "0.5",
    "3.14",
    "1,234",
    "4.5e33",
    "\\frac{1}{2}",
    "-\\frac{14}{3}",
    "\\dfrac{3}{56}",
    "3\\sqrt{13}",
    "\\sqrt{51}",
    "11\\sqrt2",
    "\\frac{\\sqrt{3}}{2}",
    "\\sqrt[3]{2}",
    "2^{1009}",
    "n^{2}+1",
    "\\frac{n(n+1)(2 n+1)}{6}",
    "2n-2",
    "p - q",
    "6 - 5i",
    "\\pi",
    "2\\pi r",
    "\\frac{\\pi}{4}",
    "90^\\circ",
    "45^{\\circ}",
    "\\left( 3, \\frac{\\pi}{2} \\right)",
    "(1,8,19), (2,7,13)",
    "[-2, 7)",
    "(-\\infty, 0] \\cup [3, \\infty)",
    "\\{1, 2, 3\\}",
    "1,-2",
    "3, 5, 7",
    "x=5",
    "y = 2x + 3",
    "f(x)=\\frac{1}{x}",
    "k=1",
    "x^2 + 3x - 4",
    "\\binom{2n}{n}",
    "\\frac{100!}{2^{50}}",
    "\\left\\lfloor\\log _{2} n\\right\\rfloor+1",
    "\\lceil x \\rceil",
    "|a - b|",
    "\\sin \\theta",
    "\\cos^2 x",
    "\\arcsin{1.3 \\sin{\\theta_w}}",
    "\\log_2 8",
    "\\ln 2",
    "e^{-x}",
    "\\sum_{k=1}^{n} k",
    "\\text{Evelyn}",
    "10\\text{ cm}",
    "25\\%",
    "\\$18.90",
    "a_{n}=2^{n}",
    "m_{\\max }=n^{2}-n-1",
    "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
    "x \\le 3",
    "0 < x < 1",
    "\\frac{a M^{1 / 3}}{G M^{2 / 3}+b}",
)

_warm = False


def is_warm() -> bool:
    return _warm


def warm_up() -> None:
    """Parse and compare the warm-up answers (no time limits; a few seconds at most)."""
    global _warm
    if _warm:
        return
    try:
        from math_verify import parse, verify
    except ImportError:
        return
    for answer in WARMUP_ANSWERS:
        try:
            gold = parse("$" + answer + "$", parsing_timeout=None)
            pred = parse("The final answer is \\boxed{" + answer + "}.", parsing_timeout=None)
            verify(gold, pred, timeout_seconds=None)
        except Exception:  # a failed warm-up only costs time later
            logger.debug("warm-up failed for %r", answer, exc_info=True)
    _warm = True
