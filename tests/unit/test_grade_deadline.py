"""``grade_one``'s in-process time limit holds against graders that touch the process's alarm timer
themselves, or swallow the first interrupt, and leaves nothing behind when it returns."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest

from exgrpo_rollout.graders import Grade, grade_one

TIMEOUT = Grade(0.0, "timeout", None)
DONE = Grade(1.0, "finished", None)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def arms_and_cancels_its_own_alarm(_response: str, _ground_truth: str) -> Grade:
    """What a library with its own ``signal.alarm`` limit does around each call (Math-Verify's
    ``timeout`` decorator): its own handler, ``alarm(5)``, the work, ``alarm(0)``, the old handler."""
    previous = signal.signal(signal.SIGALRM, lambda _signum, _frame: None)
    signal.alarm(5)
    try:
        pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    _spin(3.0)
    return DONE


def calls_math_verify_with_its_defaults(_response: str, _ground_truth: str) -> Grade:
    """A plug-in grader that calls Math-Verify with its default limits, then runs long."""
    from math_verify import parse

    assert parse("$1$")
    _spin(3.0)
    return DONE


class _SlowFinalizer:
    def __del__(self) -> None:
        _spin(1.0)


def interrupted_inside_a_finalizer(_response: str, _ground_truth: str) -> Grade:
    """The limit first fires inside ``__del__``, where Python swallows any exception."""
    obj = _SlowFinalizer()
    del obj
    _spin(3.0)
    return DONE


def quick(_response: str, _ground_truth: str) -> Grade:
    return DONE


@pytest.fixture
def swallowed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[type[BaseException]]]:
    seen: list[type[BaseException]] = []

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        seen.append(unraisable.exc_type)

    monkeypatch.setattr(sys, "unraisablehook", hook)
    yield seen


def _alarms_after(seconds: float) -> list[int]:
    """SIGALRMs that reach this process in the next ``seconds``."""
    seen: list[int] = []

    def record(signum: int, _frame: FrameType | None) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGALRM, record)
    try:
        time.sleep(seconds)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return seen


def test_a_grader_that_cancels_the_alarm_timer_is_still_stopped() -> None:
    assert grade_one(arms_and_cancels_its_own_alarm, "x", "x", timeout_s=0.3) == TIMEOUT


def test_a_grader_calling_math_verify_with_its_own_limits_is_still_stopped() -> None:
    from math_verify import parse

    assert parse("$1$")  # imported and warm: the grader's own call is quick, well inside the limit
    assert grade_one(calls_math_verify_with_its_defaults, "x", "x", timeout_s=0.3) == TIMEOUT


def test_an_interrupt_swallowed_by_a_finalizer_is_repeated(swallowed: list[type[BaseException]]) -> None:
    # the first interrupt lands inside __del__ unless this process is held off the CPU for the
    # limit's 0.2 s before the grader reaches it (then the grade is stopped anyway): a few tries
    for _ in range(3):
        assert grade_one(interrupted_inside_a_finalizer, "x", "x", timeout_s=0.2) == TIMEOUT
        if swallowed:
            break
    # the scenario happened as designed: an interrupt was raised inside __del__ and lost there
    assert swallowed and {kind.__name__ for kind in swallowed} == {"GradeTimeout"}


@pytest.mark.parametrize("grader", [quick, arms_and_cancels_its_own_alarm])
def test_nothing_is_left_behind(grader: object) -> None:
    before_handler = signal.getsignal(signal.SIGALRM)
    before_threads = set(threading.enumerate())
    result = grade_one(grader, "x", "x", timeout_s=0.2)  # type: ignore[arg-type]  # a grader
    assert result == (DONE if grader is quick else TIMEOUT)
    assert signal.getsignal(signal.SIGALRM) == before_handler
    new = [thread.name for thread in set(threading.enumerate()) - before_threads]
    assert new in ([], ["exgrpo-grade-limit"])  # at most the one watchdog, started on first use
    assert [t.name for t in threading.enumerate()].count("exgrpo-grade-limit") == 1
    assert _alarms_after(0.4) == []


def spins(_response: str, _ground_truth: str) -> Grade:
    _spin(3.0)
    return DONE


def test_the_process_alarm_timer_is_left_alone() -> None:
    """A timer the application armed (pytest-timeout arms one per test) keeps running through a
    grade that finishes and one that is stopped."""
    before = signal.getitimer(signal.ITIMER_REAL)
    previous = None
    if before[0] == 0.0:
        previous = signal.signal(signal.SIGALRM, lambda _signum, _frame: None)
        signal.setitimer(signal.ITIMER_REAL, 600.0)
        before = signal.getitimer(signal.ITIMER_REAL)
    try:
        assert grade_one(quick, "x", "x", timeout_s=0.2) == DONE
        assert grade_one(spins, "x", "x", timeout_s=0.2) == TIMEOUT
        after = signal.getitimer(signal.ITIMER_REAL)
        assert 0.0 < after[0] < before[0]
    finally:
        if previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, previous)


def grades_inside(_response: str, _ground_truth: str) -> Grade:
    """A grader that itself grades with a (longer) limit, then runs long."""
    assert grade_one(quick, "x", "x", timeout_s=30.0) == DONE
    _spin(3.0)
    return DONE


def test_an_inner_grade_gives_the_outer_limit_back() -> None:
    assert grade_one(grades_inside, "x", "x", timeout_s=0.3) == TIMEOUT


def _grade_in_child(results: multiprocessing.queues.Queue[Grade]) -> None:
    results.put(grade_one(spins, "x", "x", timeout_s=0.2))
    results.put(grade_one(quick, "x", "x", timeout_s=0.2))


def test_a_forked_child_has_its_own_limit() -> None:
    assert grade_one(quick, "x", "x", timeout_s=0.2) == DONE  # the parent's watchdog is running
    context = multiprocessing.get_context("fork")
    results: multiprocessing.queues.Queue[Grade] = context.Queue()
    child = context.Process(target=_grade_in_child, args=(results,))
    child.start()
    try:
        assert results.get(timeout=60) == TIMEOUT
        assert results.get(timeout=60) == DONE
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0


def test_an_enclosing_limit_holds_inside_an_inner_grade_with_a_longer_one() -> None:
    finished: list[str] = []

    def spins_then_notes(_response: str, _ground_truth: str) -> Grade:
        _spin(3.0)
        finished.append("inner")
        return DONE

    def grades_longer_inside(_response: str, _ground_truth: str) -> Grade:
        grade_one(spins_then_notes, "x", "x", timeout_s=30.0)
        finished.append("outer")
        return DONE

    assert grade_one(grades_longer_inside, "x", "x", timeout_s=0.3) == TIMEOUT
    assert finished == []  # the inner grader was stopped at the enclosing limit, not after its 3 s
