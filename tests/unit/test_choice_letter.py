"""`choice_letter`: the final option letter of a multiple-choice response, boxed or not; `choice`
itself still needs a box."""

from __future__ import annotations

import pytest

from exgrpo_rollout.graders import BUILTIN_GRADERS, Grade, get_grader, grade_one
from exgrpo_rollout.graders.boxed import choice
from exgrpo_rollout.graders.choice_letter import choice_letter, final_choice_label


@pytest.mark.parametrize(
    "response",
    [
        "C) Planetary days will become shorter.",
        "(C) Planetary days will become shorter.",
        "[c] shorter days",
        "C. Planetary days",
        "C: shorter days",
        "C",
        "  C\nbecause the planet spins faster",
        "The answer is C.",
        "Answer: (C)",
        "the correct option is C, since days get shorter",
        "A) density\nB) years\nC) days\nD) gravity\nThe answer would be C!",
        "The answer is A. No wait, the answer is C",
        "reasoning </think> \\boxed{C}",
        "\\boxed{\\text{(C)}} and nothing else",
    ],
)
def test_reads_the_final_letter(response: str) -> None:
    assert choice_letter(response, "C") == Grade(1.0, "correct", "C")


@pytest.mark.parametrize(
    ("response", "label"),
    [
        ("B) Planetary years will become longer.", "B"),
        ("E) not an option of this question", "E"),
        ("The answer is D", "D"),
        ("\\boxed{A} is wrong, the answer is C", "A"),  # a box wins over a statement, as in `choice`
        ("The answer is C </think> The answer is B", "B"),  # only after the first </think>
    ],
)
def test_a_wrong_letter_is_wrong(response: str, label: str) -> None:
    assert choice_letter(response, "C") == Grade(0.0, "wrong_answer", label)


@pytest.mark.parametrize(
    "response",
    [
        "A planet that rotates faster has shorter days.",  # the article "A", no label
        "A.I. models cannot tell.",
        "the answer is a faster rotation",  # lower case after "answer is": a word, not a label
        "A) density\nB) years\nC) days",  # lists the options, chooses none
        "Planetary days will become shorter.",  # the option's text without its label
        "\\boxed{Apple}",  # a box without a label, as `choice`
    ],
)
def test_no_label_is_no_answer(response: str) -> None:
    grade = choice_letter(response, "C")
    assert grade.reward == 0.0 and grade.reason == "no_answer"


def test_numbered_options_empty_and_bad_gold() -> None:
    assert choice_letter("2) the second one", "2").reward == 1.0
    assert choice_letter("The correct option is 10.", "10").reward == 1.0
    assert choice_letter("The correct option is 1.", "10") == Grade(0.0, "wrong_answer", "1")
    assert choice_letter(" \n", "C") == Grade(0.0, "empty", None)
    assert choice_letter("C) days", "not a label") == Grade(0.0, "bad_gold", "C")
    assert final_choice_label("no letter here") == (None, None)


def test_choice_still_needs_a_box() -> None:
    for response in ("C) Planetary days", "The answer is C."):
        assert choice(response, "C") == Grade(0.0, "no_answer", None)
        assert choice_letter(response, "C").reward == 1.0


def test_registered_and_safe_on_bad_output() -> None:
    assert "choice_letter" in BUILTIN_GRADERS
    grader = get_grader("choice_letter")
    assert grader("The answer is B", "B").reward == 1.0
    assert grader(None, "B") == Grade(0.0, "error:TypeError", None)  # type: ignore[arg-type]  # on purpose
    assert grader("</think>" + "\\boxed{" * 2000, "B").reason == "no_answer"
    assert grader("ok </think> \\boxed{" + "C" * 100_000 + "}", "C").reason == "no_answer"
    assert grade_one("choice_letter", "x" * 100_000 + " The answer is C", "C", timeout_s=20.0).reward == 1.0
