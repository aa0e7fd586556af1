"""Text helpers shared by the graders: think-block handling and ``\\boxed{}`` extraction."""

from __future__ import annotations

import re

__all__ = [
    "EOS_STRINGS",
    "THINK_CLOSE",
    "THINK_OPEN",
    "THINK_PREFIX",
    "after_first_think_close",
    "extract_last_boxed",
    "strip_trailing_eos",
    "think_solution",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
THINK_PREFIX = "<think>\n"

EOS_STRINGS: tuple[str, ...] = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek-R1 style
    "</s>",
)

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def strip_trailing_eos(text: str, eos_strings: tuple[str, ...] = EOS_STRINGS) -> str:
    """Remove end-of-sequence marker strings (and surrounding whitespace) from the end of ``text``."""
    changed = True
    while changed:
        changed = False
        stripped = text.rstrip()
        for eos in eos_strings:
            if stripped.endswith(eos):
                text = stripped[: -len(eos)]
                changed = True
                break
    return text


def think_solution(response: str) -> str | None:
    """Training-reward split (spec section 7, steps 2-4).

    Prepends ``"<think>\\n"``; returns ``None`` when the format gate fails (no ``<think>`` or no
    ``</think>``), else the text between the first ``</think>`` and the next ``</think>`` (or the end).
    """
    text = THINK_PREFIX + response
    if THINK_OPEN not in text or THINK_CLOSE not in text:
        return None
    return text.split(THINK_CLOSE, 2)[1]


def after_first_think_close(response: str) -> str:
    """Evaluation split (spec section 9.1): text after the first ``</think>``, else the whole text."""
    _, sep, rest = response.partition(THINK_CLOSE)
    return rest if sep else response


def _find_last_box(text: str) -> tuple[int, int] | None:
    """Start of the last box command that is a whole command name, and the index after its name."""
    best: tuple[int, int] | None = None
    for cmd in _BOX_COMMANDS:
        end = len(text)
        while True:
            pos = text.rfind(cmd, 0, end)
            if pos < 0:
                break
            after = pos + len(cmd)
            if after < len(text) and text[after].isalpha():
                end = pos  # e.g. "\boxedx" or "\fboxsep": not this command, keep looking left
                continue
            if best is None or pos > best[0]:
                best = (pos, after)
            break
    return best


_BARE_BOX_ARG = re.compile(r"[ \t]*([^\s$]+)")


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``.

    Braces are matched with nesting; a backslash escapes the next character (``\\{`` does not
    open a group). ``\\boxed 5`` (argument without braces) gives ``"5"``. Returns ``None`` when
    there is no box or the last box is not closed (a truncated response).
    """
    found = _find_last_box(text)
    if found is None:
        return None
    _, i = found
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        m = _BARE_BOX_ARG.match(text, found[1])
        return m.group(1) if m else None
    depth = 0
    start = i + 1
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None
