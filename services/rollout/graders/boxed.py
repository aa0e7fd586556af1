"""Evaluation graders (spec section 9.1): last ``\\boxed{}`` answer, and letter choices.

``boxed`` (math benchmarks):

1. If the response contains ``</think>``, only the text after the first ``</think>`` is graded;
   otherwise the whole response (the training think-format gate does not apply at evaluation).
2. The answer is the content of the **last** ``\\boxed{...}`` (or ``\\fbox{...}``); no box, an
   empty box or an unclosed box scores 0 (``no_answer``). A gold that itself contains a box is
   reduced to the box content.
3. Equivalence, first match wins:

   a. string equality after MATH-style normalisation (:func:`normalize_answer`): math delimiters,
      spacing commands, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, degree signs, percent signs,
      text wrappers and trailing units are removed; ``\\frac12`` / ``\\sqrt3`` get braces; ``a/b``
      becomes ``\\frac{a}{b}``; a one-symbol left-hand side (``x = 5``) is dropped; plain numbers are
      canonicalised (``025`` -> ``25``, ``142.0`` -> ``142``, ``1,234`` -> ``1234``);
   b. sympy: both sides converted from LaTeX and compared exactly (``simplify(a - b) == 0``, or a
      1e-9 relative difference for two numbers), element-wise for tuples / intervals with the same
      brackets; skipped for long or explosive inputs (large or nested exponents);
   c. Math-Verify: ``verify(parse("$gold$"), parse("$answer$"))``.

``choice`` (ARC-c, GPQA, MMLU-Pro style; gold ``"A"``..``"J"`` or an option number such as ``"2"``):
the same after-``</think>`` rule and last-box rule; the box content is reduced to an option label
(``C``, ``(C)``, ``C)``, ``\\text{(C)}``, ``C. Planetary days ...``, ``Option C``) and compared
case-insensitively with the gold. Unboxed answers score 0 (``no_answer``), as for ``boxed``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from exgrpo_rollout.graders.base import Grade, clip_extracted, math_verify_timeout, safe_grader
from exgrpo_rollout.graders.extract import after_first_think_close, extract_last_boxed

__all__ = [
    "answers_equivalent",
    "boxed",
    "choice",
    "label_grade",
    "normalize_answer",
    "normalize_choice",
]

_MAX_ANSWER_CHARS = 2_000
_MAX_SYMPY_CHARS = 160

_UNIT_WORDS = frozenset(
    [
        "unit",
        "units",
        "cm",
        "centimeter",
        "centimeters",
        "centimetre",
        "centimetres",
        "mm",
        "millimeter",
        "millimeters",
        "m",
        "meter",
        "meters",
        "metre",
        "metres",
        "km",
        "kilometer",
        "kilometers",
        "kilometres",
        "inch",
        "inches",
        "in",
        "ft",
        "foot",
        "feet",
        "yd",
        "yard",
        "yards",
        "mile",
        "miles",
        "mi",
        "mph",
        "kmh",
        "hour",
        "hours",
        "hr",
        "hrs",
        "minute",
        "minutes",
        "min",
        "mins",
        "second",
        "seconds",
        "sec",
        "secs",
        "s",
        "day",
        "days",
        "week",
        "weeks",
        "month",
        "months",
        "year",
        "years",
        "degree",
        "degrees",
        "deg",
        "radian",
        "radians",
        "dollar",
        "dollars",
        "cent",
        "cents",
        "g",
        "gram",
        "grams",
        "kg",
        "kilogram",
        "kilograms",
        "lb",
        "lbs",
        "pound",
        "pounds",
        "oz",
        "ounce",
        "ounces",
        "l",
        "liter",
        "liters",
        "litre",
        "litres",
        "ml",
        "sq",
        "square",
        "cubic",
        "cu",
        "people",
        "students",
        "ways",
        "points",
    ]
)
_TEXT_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|mathrm|mathbf|mathit|mathsf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_LEFT_RIGHT = re.compile(
    r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)(?![a-zA-Z])"
)
_DEGREE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![a-zA-Z])|°")
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_SIMPLE_FRACTION = re.compile(r"([+-]?)(\d+)/(\d+)")
_LHS_SYMBOL = re.compile(r"\\?[A-Za-z]+(?:_\{?[\w\\ ]*\}?)?(?:\^\{?\w*\}?)?")
_EXPLOSIVE = re.compile(r"\^\s*\{?\s*[+-]?\d{3,}|\^\s*\{[^{}]*\^|\^\s*\d\s*\^|!\s*!|\d{40,}")
_LATEX_COMMAND = re.compile(r"\\[a-zA-Z]+")


def _strip_enclosing_braces(s: str) -> str:
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _matching_close(s, 0) == len(s) - 1:
        s = s[1:-1].strip()
    return s


def _matching_close(s: str, open_idx: int) -> int:
    """Index of the brace closing the one at ``open_idx`` (backslash escapes), or -1."""
    depth = 0
    i = open_idx
    while i < len(s):
        ch = s[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _compact_spaces(s: str) -> str:
    """Drop all spaces except one between a command name and a following letter (``\\pi r``)."""
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x00", s)
    return re.sub(r"\s+", "", s).replace("\x00", " ")


def _read_arg(s: str, i: int) -> tuple[str, int] | None:
    """One LaTeX macro argument starting at ``i``: a braced group or a single character/command."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        j = _matching_close(s, i)
        if j < 0:
            return None
        return s[i + 1 : j], j + 1
    if s[i] == "\\":
        m = _LATEX_COMMAND.match(s, i)
        if m:
            return m.group(0), m.end()
        return None
    return s[i], i + 1


def _brace_macro_args(s: str, macro: str, nargs: int) -> str:
    """Rewrite ``\\frac12`` as ``\\frac{1}{2}`` (and ``\\sqrt3`` as ``\\sqrt{3}``)."""
    out: list[str] = []
    i = 0
    while True:
        j = s.find(macro, i)
        if j < 0:
            out.append(s[i:])
            break
        k = j + len(macro)
        if k < len(s) and s[k].isalpha():  # a longer command name, e.g. \fracx is not \frac
            out.append(s[i:k])
            i = k
            continue
        out.append(s[i:k])
        if macro == "\\sqrt" and k < len(s) and s[k] == "[":  # \sqrt[3]{x}
            close = s.find("]", k)
            if close < 0:
                out.append(s[k:])
                break
            out.append(s[k : close + 1])
            k = close + 1
        args: list[str] = []
        pos = k
        for _ in range(nargs):
            got = _read_arg(s, pos)
            if got is None:
                break
            args.append(got[0])
            pos = got[1]
        if len(args) != nargs:
            i = k
            continue
        out.append("".join("{" + a + "}" for a in args))
        i = pos
    return "".join(out)


def _canonical_number(s: str) -> str | None:
    if not _NUMBER.fullmatch(s):
        return None
    try:
        value = Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    text = format(value.normalize(), "f")
    return text


def _strip_units(s: str) -> str:
    # "10\text{ cm}" style: a text group that starts with a space after the value is a unit.
    s = re.sub(r"(?<=[\d}])\s*\\(?:text|mbox|mathrm)\s*\{\s+[^{}]*\}\s*$", "", s)
    # "10\text{cm}", "10\mbox{inches}^2", "5 \text{ sq units}"
    m = re.search(r"\\(?:text|mbox|mathrm)\s*\{([^{}]*)\}(?:\^\{?\d\}?)?\s*$", s)
    if m and s[: m.start()].strip() and all(w.lower() in _UNIT_WORDS for w in m.group(1).split() or ["?"]):
        s = s[: m.start()]
    # plain trailing unit words after a number: "10 cm", "3 units", "12 dollars"
    m = re.fullmatch(r"(.*\d)\s*((?:[A-Za-z]+\s*)+)(?:\^\{?\d\}?)?", s.strip())
    if m:
        words = m.group(2).split()
        if all(len(w) > 1 and w.lower() in _UNIT_WORDS for w in words):
            s = m.group(1)
    return s


def normalize_answer(answer: str) -> str:
    """MATH-style string normalisation of a final answer (see the module docstring)."""
    s = answer.strip()
    if "\\boxed" in s or "\\fbox" in s:
        inner = extract_last_boxed(s)
        if inner is not None:
            s = inner
    s = s.replace("\n", " ").replace("\r", " ").replace("\t", " ")
    s = s.replace("\u2212", "-").replace("\u221e", "\\infty")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)  # \( \) \[ \]
    s = s.replace("\\!", "")
    for spacing in ("\\,", "\\;", "\\:", "\\ ", "~", "\\qquad", "\\quad"):
        s = s.replace(spacing, " ")
    s = s.replace("\\displaystyle", "")
    s = s.replace("\\left.", "").replace("\\right.", "")
    s = _LEFT_RIGHT.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _DEGREE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _strip_units(s.strip())
    for _ in range(3):  # unwrap nested \text{\textbf{...}}
        s = _TEXT_WRAPPERS.sub(lambda m: m.group(1), s)
    s = s.strip()
    s = s.rstrip(".").strip()
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if _LHS_SYMBOL.fullmatch(lhs.strip()) and len(lhs.strip()) <= 16 and rhs.strip():
            s = rhs
    s = _compact_spaces(s)
    s = _strip_enclosing_braces(s)
    s = _brace_macro_args(s, "\\frac", 2)
    s = _brace_macro_args(s, "\\sqrt", 1)
    m = _SIMPLE_FRACTION.fullmatch(s)
    if m:
        s = f"{m.group(1)}\\frac{{{m.group(2)}}}{{{m.group(3)}}}".lstrip("+")
    s = re.sub(r"(^|[{(\[,=+\-])\.(\d)", r"\g<1>0.\2", s)
    number = _canonical_number(s)
    if number is not None:
        s = number
    return s


# ----------------------------------------------------------------------------------------------
# sympy comparison
# ----------------------------------------------------------------------------------------------


_OPEN_TO_CLOSE = {"(": ")", "[": "]", "\\{": "\\}"}


def _split_top_level(s: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    start = 0
    i = 0
    while i < len(s):
        ch = s[i]
        if ch == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
        i += 1
    parts.append(s[start:])
    return parts


def _as_sequence(s: str) -> tuple[str, str, list[str]] | None:
    """``(open, close, elements)`` for a bracketed comma list such as ``(1,2)`` or ``[-1,3)``."""
    for opener in ("\\{", "(", "["):
        if s.startswith(opener):
            break
    else:
        return None
    for closer in ("\\}", ")", "]"):
        if s.endswith(closer) and len(s) > len(opener) + len(closer):
            break
    else:
        return None
    inner = s[len(opener) : len(s) - len(closer)]
    parts = _split_top_level(inner)
    if len(parts) < 2:
        return None
    return opener, closer, parts


def _sympy_allowed(s: str) -> bool:
    if not s or len(s) > _MAX_SYMPY_CHARS or _EXPLOSIVE.search(s):
        return False
    letters = set(re.findall(r"[a-zA-Z]", _LATEX_COMMAND.sub("", s)))
    return len(letters) <= 3


def _to_sympy(s: str) -> object:
    from latex2sympy2_extended import latex2sympy

    return latex2sympy(s)


def _sympy_scalar_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    na, nb = _canonical_number(a), _canonical_number(b)
    if na is not None and nb is not None:
        return na == nb
    if not (_sympy_allowed(a) and _sympy_allowed(b)):
        return False
    import sympy

    try:
        ea, eb = _to_sympy(a), _to_sympy(b)
        if not isinstance(ea, sympy.Expr) or not isinstance(eb, sympy.Expr):
            return False
        diff = ea - eb
        if not diff.free_symbols:
            va, vb = complex(sympy.N(ea, 30)), complex(sympy.N(eb, 30))
            return abs(va - vb) <= 1e-9 * max(1.0, abs(vb))
        return bool(sympy.simplify(diff) == 0)
    except Exception:
        return False


def _sympy_equal(pred: str, gold: str) -> bool:
    seq_p, seq_g = _as_sequence(pred), _as_sequence(gold)
    if seq_p is not None and seq_g is not None:
        if seq_p[:2] != seq_g[:2] or len(seq_p[2]) != len(seq_g[2]):
            return False
        return all(_sympy_scalar_equal(p, g) for p, g in zip(seq_p[2], seq_g[2], strict=True))
    if seq_p is not None or seq_g is not None:
        return False
    return _sympy_scalar_equal(pred, gold)


def _math_verify_equal(pred_raw: str, gold_raw: str) -> bool:
    from math_verify import parse, verify

    timeout = math_verify_timeout()
    gold_text = gold_raw.replace("$", "")
    pred_text = pred_raw.replace("$", "")
    if not gold_text.strip() or not pred_text.strip():
        return False
    gold = parse("$" + gold_text + "$", parsing_timeout=timeout)
    pred = parse("$" + pred_text + "$", parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def answers_equivalent(pred: str, gold: str, *, use_math_verify: bool = True) -> bool:
    """Whether the extracted answer ``pred`` matches ``gold`` (normalisation, sympy, Math-Verify)."""
    if len(pred) > _MAX_ANSWER_CHARS or len(gold) > _MAX_ANSWER_CHARS:
        return False
    norm_pred, norm_gold = normalize_answer(pred), normalize_answer(gold)
    if not norm_pred or not norm_gold:
        return False
    if norm_pred == norm_gold:
        return True
    if _sympy_equal(norm_pred, norm_gold):
        return True
    return use_math_verify and _math_verify_equal(pred, gold)


def _gold_answer(ground_truth: str) -> str:
    if "\\boxed" in ground_truth or "\\fbox" in ground_truth:
        inner = extract_last_boxed(ground_truth)
        if inner is not None:
            return inner
    return ground_truth


@safe_grader
def boxed(response: str, ground_truth: str) -> Grade:
    """Evaluation grader: last boxed answer vs gold (spec section 9.1)."""
    if not response.strip():
        return Grade(0.0, "empty", None)
    answer = extract_last_boxed(after_first_think_close(response))
    if answer is None or not answer.strip():
        return Grade(0.0, "no_answer", None)
    answer = answer.strip()
    gold = _gold_answer(ground_truth).strip()
    if not normalize_answer(gold):
        return Grade(0.0, "bad_gold", clip_extracted(answer))
    if answers_equivalent(answer, gold):
        return Grade(1.0, "correct", clip_extracted(answer))
    return Grade(0.0, "wrong_answer", clip_extracted(answer))


# ----------------------------------------------------------------------------------------------
# multiple choice
# ----------------------------------------------------------------------------------------------

_CHOICE_PREFIX = re.compile(
    r"^(?:the\s+)?(?:correct\s+)?(?:final\s+)?(?:answer|option|choice)\s*(?:is)?\s*[:.]?\s*", re.I
)
_CHOICE_LABEL = re.compile(r"^[(\[]?\s*([A-Za-z]|\d{1,2})\s*[)\]]?(?=$|[\s.:,)\]])")


def normalize_choice(text: str) -> str | None:
    """Option label in ``text`` (upper-cased letter or a number), or ``None``."""
    s = text.replace("$", "").strip()
    for _ in range(3):
        s = _TEXT_WRAPPERS.sub(lambda m: m.group(1), s)
    s = s.replace("\\(", "").replace("\\)", "").replace("{", "").replace("}", "").strip()
    s = _CHOICE_PREFIX.sub("", s).strip()
    m = _CHOICE_LABEL.match(s)
    if not m:
        return None
    return m.group(1).upper()


@safe_grader
def choice(response: str, ground_truth: str) -> Grade:
    """Multiple-choice grader: boxed option label vs gold label."""
    if not response.strip():
        return Grade(0.0, "empty", None)
    answer = extract_last_boxed(after_first_think_close(response))
    if answer is None or not answer.strip():
        return Grade(0.0, "no_answer", None)
    label = normalize_choice(answer) if len(answer) <= _MAX_ANSWER_CHARS else None
    if label is None:
        return Grade(0.0, "no_answer", clip_extracted(answer.strip()))
    return label_grade(label, ground_truth)


def label_grade(label: str, ground_truth: str) -> Grade:
    """An extracted option label against the gold one (normalised the same way)."""
    gold = normalize_choice(ground_truth)
    if gold is None:
        return Grade(0.0, "bad_gold", label)
    if label == gold:
        return Grade(1.0, "correct", label)
    return Grade(0.0, "wrong_answer", label)
