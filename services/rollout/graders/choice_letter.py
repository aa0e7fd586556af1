"""``choice_letter``: a multiple-choice grader that reads the final option letter the way letter-scored
multiple-choice evaluations do, with or without ``\\boxed{}``.

``choice`` (``boxed.py``) scores only a boxed label, which a small model asked a plain question
rarely writes. ``choice_letter`` reads, first rule that finds a label wins:

1. the text after the first ``</think>`` (the whole response when there is none), as ``choice``;
2. the last ``\\boxed{}``: its content reduced to an option label (:func:`normalize_choice`), as
   ``choice``; a box without a label scores ``no_answer``;
3. the last answer statement: ``the answer is C``, ``Answer: (C)``, ``correct option is C.``,
   ``answer would be C`` (the keyword in any case, the label an upper-case letter ``A``..``J``, a
   parenthesised letter in either case, or a number ``1``..``10``, followed by the end of the text,
   a space or punctuation);
4. a response that starts with an option label: ``C) ...``, ``(C) ...``, ``[C] ...``, ``C. ...``,
   ``C: ...``, or ``C`` alone on the first line. A response whose lines start with two or more
   different labels lists the options rather than choosing one and scores ``no_answer``.

The label is compared case-insensitively with the gold (``"A"``..``"J"`` or an option number);
a gold that is not a label scores ``bad_gold``. Reasons: ``correct``, ``wrong_answer``,
``no_answer``, ``empty``, ``bad_gold``.
"""

from __future__ import annotations

import re

from exgrpo_rollout.graders.base import Grade, clip_extracted, safe_grader
from exgrpo_rollout.graders.boxed import label_grade, normalize_choice
from exgrpo_rollout.graders.extract import after_first_think_close, extract_last_boxed

__all__ = ["choice_letter", "final_choice_label"]

_MAX_BOX_CHARS = 2_000

_LABEL = r"(?:\(\s*(?P<p>[A-Ja-j]|10|[1-9])\s*\)|\[\s*(?P<b>[A-Ja-j]|10|[1-9])\s*\]|(?P<u>[A-J]|10|[1-9]))"
_STATEMENT = re.compile(
    r"(?i:answer|option|choice)\s*(?:(?i:is|would\s+be|will\s+be|should\s+be)\s*)?[:=]?\s*"
    r"(?:(?i:option|choice)\s*)?" + _LABEL + r"(?=$|[\s.,:;!?)\]])"
)
_LEADING = re.compile(
    r"^\s*(?:[(\[]\s*(?P<p>[A-Ja-j]|10|[1-9])\s*[)\]]"
    r"|(?P<u>[A-J]|10|[1-9])(?:\)|[.:](?=\s|$)|[ \t]*(?=\n|$)))"
)
_LINE_LABEL = re.compile(r"^[ \t]*[(\[]?\s*([A-Ja-j]|10|[1-9])\s*(?:[)\]]|[.:](?=\s|$))", re.M)


def _label(m: re.Match[str]) -> str:
    return next(g for g in (m.group(k) for k in m.groupdict()) if g is not None).upper()


def final_choice_label(text: str) -> tuple[str | None, str | None]:
    """The option label ``text`` answers with (rules 2-4 of the module docstring) and the text it was
    read from (the box content for a box without a label); ``(None, None)`` when there is none."""
    box = extract_last_boxed(text)
    if box is not None and box.strip():
        if len(box) > _MAX_BOX_CHARS:
            return None, None
        return normalize_choice(box), box.strip()
    statements = list(_STATEMENT.finditer(text))
    if statements:
        last = statements[-1]
        return _label(last), last.group(0).strip()
    lead = _LEADING.match(text)
    if lead is None:
        return None, None
    listed = {m.group(1).upper() for m in _LINE_LABEL.finditer(text)}
    if len(listed) > 1:
        return None, None
    return _label(lead), lead.group(0).strip()


@safe_grader
def choice_letter(response: str, ground_truth: str) -> Grade:
    """Multiple-choice grader: the final option label, boxed or not, vs the gold label."""
    if not response.strip():
        return Grade(0.0, "empty", None)
    label, source = final_choice_label(after_first_think_close(response))
    if label is None:
        return Grade(0.0, "no_answer", None if source is None else clip_extracted(source))
    return label_grade(label, ground_truth)
