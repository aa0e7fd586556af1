"""GradingPool: per-item hard timeouts, crash isolation, worker replacement, caps, ordering."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from exgrpo_rollout.graders import Grade, GradingPool

USER = "exgrpo_rollout.graders.examples:misbehaving"
TOWER = "a </think> \\boxed{2^{2^{2^{2^{2^{2}}}}}}"  # Math-Verify/sympy run "forever" on this


@pytest.fixture(scope="module")
def pool() -> Iterator[GradingPool]:
    with GradingPool(2) as p:
        p.warmup()
        yield p


def test_hang_and_crash_do_not_stall_the_pool(pool: GradingPool) -> None:
    items = [
        ("a", "a"),
        ("HANG please", "x"),
        ("b", "b"),
        ("CRASH now", "x"),
        ("c", "c"),
        ("SPIN", "x"),
        ("RAISE", "x"),
        ("GARBAGE", "x"),
        ("d", "wrong"),
        ("e", "e"),
    ]
    before = pool.stats.workers_started
    t0 = time.monotonic()
    grades = pool.grade_many(USER, items, timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert [g.reason for g in grades] == [
        "correct",
        "timeout",
        "correct",
        "error:crash",
        "correct",
        "timeout",
        "error:RuntimeError",
        "error:BadReturn",
        "wrong_answer",
        "correct",
    ]
    assert [g.reward for g in grades] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert elapsed < 10.0
    assert pool.stats.workers_started - before == 3  # two timeouts and one crash replaced
    # the pool stays usable afterwards, at full size
    assert pool.grade_many(USER, [("ok", "ok")] * 6, timeout_s=5.0) == [Grade(1.0, "correct", "ok")] * 6
    assert pool.grade("math_think", "x </think> \\boxed{3}", "3") == Grade(1.0, "correct", "3")


def test_pathological_math_answer_times_out(pool: GradingPool) -> None:
    items = [(TOWER, "5"), ("ok </think> \\boxed{\\frac{1}{2}}", "0.5"), ("ok </think> \\boxed{7}", "8")]
    grades = pool.grade_many("math_think", items, timeout_s=2.0)
    assert grades[0] == Grade(0.0, "timeout", None)
    assert grades[1].reward == 1.0
    assert grades[2].reason == "wrong_answer"


def test_results_keep_input_order(pool: GradingPool) -> None:
    items = [(f"x </think> \\boxed{{{i}}}", str(i if i % 3 else i + 1)) for i in range(40)]
    grades = pool.grade_many("arithmetic", items, timeout_s=5.0)
    assert [g.reward for g in grades] == [0.0 if i % 3 == 0 else 1.0 for i in range(40)]
    assert [g.extracted for g in grades] == [str(i) for i in range(40)]


def test_tv11_in_the_pool(pool: GradingPool) -> None:
    items = [
        ("Let me think.\n</think>\n\nThe answer is \\boxed{204}.<|im_end|>", "204"),
        ("Let me think. The answer is \\boxed{204}.<|im_end|>", "204"),
        ("thinking </think> so x = 3, and \\boxed{\\frac{1}{2}}", "0.5"),
        ("thinking </think> \\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("a </think> b </think> \\boxed{5}", "5"),
        ("a </think> The answer is 204", "204"),
        ("a </think> \\boxed{205}", "204"),
    ]
    grades = pool.grade_many("math_think", items)
    assert [g.reward for g in grades] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]


def test_bad_output_and_caps(pool: GradingPool) -> None:
    long_ok = "x" * 80_000 + " </think> \\boxed{7}"
    items = [
        ("", "7"),
        ("\x00\x01\x02\ud800 garbage", "7"),
        ("ok </think> \\boxed{" + "9" * 100_000 + "}", "7"),
        (long_ok, "7"),
        ("ok", "7" * 20_000),
    ]
    grades = pool.grade_many("boxed", items)
    assert [g.reason for g in grades] == ["empty", "no_answer", "no_answer", "correct", "too_long"]
    assert [g.reward for g in grades] == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_reject_mode_and_single_worker() -> None:
    with GradingPool(1, overlong="reject", max_chars=1_000) as p:
        grades = p.grade_many("boxed", [("x" * 2_000 + "\\boxed{1}", "1"), ("\\boxed{1}", "1")])
    assert grades == [Grade(0.0, "too_long", None), Grade(1.0, "correct", "1")]


def test_errors_and_edge_cases(pool: GradingPool) -> None:
    assert pool.grade_many("boxed", []) == []
    with pytest.raises(ValueError, match="unknown grader"):
        pool.grade_many("no_such_grader", [("a", "b")])
    with pytest.raises(ValueError, match="cannot import"):
        pool.grade_many("no_such_pkg.mod:fn", [("a", "b")])
    with pytest.raises(ValueError):
        pool.grade_many("boxed", [("a", "b")], timeout_s=0)
    bad_items = [None, ("a",), ("\\boxed{1}", "1")]
    grades = pool.grade_many("boxed", bad_items)  # type: ignore[arg-type]  # malformed items on purpose
    assert [g.reason for g in grades] == ["error:TypeError", "error:TypeError", "correct"]
    assert pool.grade_many("boxed", [(1, "1")]) == [Grade(0.0, "error:TypeError", None)]  # type: ignore[list-item]  # an int response


def test_concurrent_callers_are_serialised(pool: GradingPool) -> None:
    out: dict[int, list[Grade]] = {}

    def run(k: int) -> None:
        out[k] = pool.grade_many("arithmetic", [(f"</think> \\boxed{{{k}}}", str(k))] * 5)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g == Grade(1.0, "correct", str(k)) for k in range(3) for g in out[k])


def test_close_is_idempotent_and_final() -> None:
    p = GradingPool(1)
    assert p.grade("arithmetic", "</think> \\boxed{2}", "2").reward == 1.0
    p.close()
    p.close()
    assert p.closed
    with pytest.raises(RuntimeError, match="closed"):
        p.grade("arithmetic", "</think> \\boxed{2}", "2")


def test_spawn_start_method() -> None:
    with GradingPool(1, start_method="spawn", preload=("exgrpo_rollout.graders.arithmetic",)) as p:
        grades = p.grade_many(USER, [("CRASH", "x"), ("ok", "ok")], timeout_s=30.0)
    assert [g.reason for g in grades] == ["error:crash", "correct"]


def test_constructor_validation() -> None:
    with pytest.raises(ValueError):
        GradingPool(0)
    with pytest.raises(ValueError):
        GradingPool(1, start_method="fork")  # type: ignore[arg-type]  # refused on purpose
    with pytest.raises(ValueError):
        GradingPool(1, overlong="cut")  # type: ignore[arg-type]  # refused on purpose


def test_idle_worker_killed_from_outside_is_replaced(pool: GradingPool) -> None:
    victim = pool._workers[0].proc  # an idle worker, e.g. taken by the OOM killer
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(5.0)
    items = [(f"</think> \\boxed{{{i}}}", str(i)) for i in range(6)]
    assert all(g.reward == 1.0 for g in pool.grade_many("arithmetic", items))
    assert len([w for w in pool._workers if not w.dead]) == pool.num_workers
