"""The example questions shipped with the CLI (the demo pool's default, the README's first import):
installed with the package, readable by the importer, distinct, and with right answers."""

from __future__ import annotations

import math
import re
import tomllib
from fractions import Fraction
from importlib import resources
from pathlib import Path

import pytest

from exgrpo_client.io import read_questions
from exgrpo_client.schemas import QuestionCreate
from exgrpo_rollout.graders import grade_one

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "clients" / "exgrpo_cli" / "examples" / "questions.jsonl"
SOURCES = {"arithmetic", "fractions", "algebra", "percent", "powers", "word"}


def _questions() -> list[QuestionCreate]:
    return [q for batch in read_questions(EXAMPLE) for q in batch]


def _gold(text: str) -> Fraction:
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", text)
    if m:
        return Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
    return Fraction(int(text))


def _frac(num: str, den: str) -> Fraction:
    return Fraction(int(num), int(den))


def _solve(source: str, text: str) -> Fraction | None:
    """The answer worked out from the question's own numbers (None: a word problem)."""
    if source == "arithmetic":
        if m := re.match(r"What is (\d+) divided by (\d+)\?", text):
            return _frac(m.group(1), m.group(2))
        m = re.match(r"What is (\d+) ([-+*]) (\d+)\?", text)
        assert m, text
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return Fraction({"+": a + b, "-": a - b, "*": a * b}[op])
    if source == "fractions":
        m = re.search(r"\\frac\{(\d+)\}\{(\d+)\} ([-+]) \\frac\{(\d+)\}\{(\d+)\}", text)
        assert m, text
        a, b = _frac(m.group(1), m.group(2)), _frac(m.group(4), m.group(5))
        return a + b if m.group(3) == "+" else a - b
    if source == "algebra":
        m = re.search(r"\$(\d+)x \+ (\d+) = (-?\d+)\$", text)
        assert m, text
        return Fraction(int(m.group(3)) - int(m.group(2)), int(m.group(1)))
    if source == "percent":
        m = re.match(r"What is (\d+)% of (\d+)\?", text)
        assert m, text
        return Fraction(int(m.group(1)) * int(m.group(2)), 100)
    if source == "powers":
        if m := re.search(r"\$2\^\{(\d+)\}\$", text):
            return Fraction(2 ** int(m.group(1)))
        m = re.search(r"square root of (\d+)\?", text)
        assert m, text
        root = math.isqrt(int(m.group(1)))
        assert root * root == int(m.group(1)), text
        return Fraction(root)
    assert source == "word", source
    return None


def test_the_example_is_package_data_of_the_cli() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folder = ROOT / setup["package-dir"]["exgrpo_cli"]
    assert any(EXAMPLE in folder.glob(pattern) for pattern in setup["package-data"]["exgrpo_cli"])
    shipped = resources.files("exgrpo_cli") / "examples" / "questions.jsonl"
    assert shipped.read_bytes() == EXAMPLE.read_bytes()


def test_example_questions_are_distinct_and_labelled() -> None:
    questions = _questions()
    assert len(questions) == 48
    assert len({q.external_id for q in questions}) == 48
    assert len({(q.prompt[-1].content, q.ground_truth) for q in questions}) == 48
    assert {q.data_source.removeprefix("example/") for q in questions} == SOURCES
    for q in questions:
        assert [m.role for m in q.prompt] == ["user"]
        assert q.prompt[0].content.endswith("Put the final answer in \\boxed{}.")


def test_example_answers_follow_from_the_questions() -> None:
    checked = 0
    for q in _questions():
        expected = _solve(q.data_source.removeprefix("example/"), q.prompt[0].content)
        if expected is not None:
            assert _gold(q.ground_truth) == expected, (q.external_id, q.ground_truth)
            checked += 1
    assert checked == 40  # all but the 8 word problems


def _response(answer: object) -> str:
    return f"Working it out.\n</think>\nSo the answer is \\boxed{{{answer}}}."


@pytest.mark.parametrize("grader", ["math_think", "boxed"])
def test_graders_accept_the_gold_answers_and_refuse_others(grader: str) -> None:
    for q in _questions():
        right = grade_one(grader, _response(q.ground_truth), q.ground_truth)
        assert right.reward == 1.0, (q.external_id, right)
        wrong = grade_one(grader, _response(_gold(q.ground_truth) + 1), q.ground_truth)
        assert wrong.reward == 0.0, (q.external_id, wrong)
