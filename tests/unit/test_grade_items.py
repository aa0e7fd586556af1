"""`grade_items`: one list of items graded in a `GradingPool` or in process, whichever is given."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from exgrpo_rollout.graders import Grade, GradingPool, grade_items

EXACT = "exgrpo_rollout.graders.examples:exact_match"
MISBEHAVING = "exgrpo_rollout.graders.examples:misbehaving"


class RecordingPool(GradingPool):
    """A pool that starts no process: it records its calls and answers fixed grades."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, str]], float]] = []

    def grade_many(
        self, grader_name: str, items: Sequence[tuple[str, str]], timeout_s: float = 5.0
    ) -> list[Grade]:
        self.calls.append((grader_name, list(items), timeout_s))
        return [Grade(0.5, "from-pool") for _ in items]


def test_in_process_keeps_the_order() -> None:
    items = [("4", "4"), ("5", "4"), (" 4 ", "4")]
    grades = grade_items(EXACT, items, timeout_s=5.0)
    assert [(g.reward, g.reason) for g in grades] == [
        (1.0, "correct"),
        (0.0, "wrong_answer"),
        (1.0, "correct"),
    ]
    assert grade_items(EXACT, [], timeout_s=5.0) == []


def test_in_process_limit_applies_on_the_main_thread() -> None:
    grades = grade_items(MISBEHAVING, [("HANG", "1"), ("1", "1")], timeout_s=0.2)
    assert [g.reason for g in grades] == ["timeout", "correct"]


def test_in_process_off_the_main_thread_grades_without_an_alarm() -> None:
    """`grade_one` refuses a time limit off the main thread; `grade_items` grades there anyway."""
    out: list[list[Grade]] = []
    thread = threading.Thread(target=lambda: out.append(grade_items(EXACT, [("7", "7")], timeout_s=5.0)))
    thread.start()
    thread.join(30)
    assert [[g.reason for g in grades] for grades in out] == [["correct"]]


def test_a_pool_grades_everything_with_the_limit() -> None:
    pool = RecordingPool()
    grades = grade_items(EXACT, [("a", "b"), ("c", "d")], timeout_s=3.0, pool=pool)
    assert [g.reason for g in grades] == ["from-pool", "from-pool"]
    assert pool.calls == [(EXACT, [("a", "b"), ("c", "d")], 3.0)]
    assert grade_items(EXACT, [], timeout_s=3.0, pool=pool) == [] and len(pool.calls) == 1
