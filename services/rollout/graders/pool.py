"""Grading with hard per-item time limits: a process pool (:class:`GradingPool`) and an
in-process variant (:func:`grade_one`); :func:`grade_items` grades a list with either.

Why a hand-rolled pool rather than ``concurrent.futures.ProcessPoolExecutor``: an executor gives no
way to learn when a queued task *starts*, and no way to stop one task without tearing down the
whole executor. Here every worker process holds at most one item; the parent sends it over a
private pipe, so the deadline runs from the moment the worker receives it. A worker that overruns
is killed (SIGKILL) and replaced; only its item is marked ``timeout``. A worker that dies while
grading (``os._exit``, a segfault, the OOM killer) gives ``error:crash`` for its item. Other items
keep being graded by the other workers throughout.

Workers are started with the ``forkserver`` method (default) or ``spawn``. With ``forkserver`` the
grader modules and Math-Verify are imported, and the LaTeX parser warmed up
(:mod:`~exgrpo_rollout.graders.warm_preload`), once in the fork server, so a replacement worker is
ready within milliseconds; with ``spawn`` each worker does this itself (a few seconds). User graders
given by dotted path must be importable by that path in a fresh process.
Inside workers Math-Verify's own ``signal.alarm`` limits are disabled: the pool's deadline is the
only limit.

Input caps (see :func:`~exgrpo_rollout.graders.base.cap_inputs`): responses longer than
``max_chars`` (50,000 by default) are graded on their **last** ``max_chars`` characters
(``overlong="tail"``, default) or rejected with reason ``too_long`` (``overlong="reject"``);
ground truths longer than 10,000 characters are rejected.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType, TracebackType
from typing import Any, Literal, Self

from exgrpo_rollout.graders.base import (
    DEFAULT_MAX_CHARS,
    Grade,
    Grader,
    GradeTimeout,
    Overlong,
    call_grader,
    cap_inputs,
    coerce_grade,
    error_grade,
    external_deadline,
)
from exgrpo_rollout.graders.registry import get_grader

__all__ = ["DEFAULT_PRELOAD", "GradingPool", "PoolStats", "grade_items", "grade_one"]

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD: tuple[str, ...] = (
    "math_verify",
    "latex2sympy2_extended",
    "exgrpo_rollout.graders.math_think",
    "exgrpo_rollout.graders.boxed",
    "exgrpo_rollout.graders.arithmetic",
    "exgrpo_rollout.graders.warm_preload",
)

StartMethod = Literal["forkserver", "spawn"]

_CRASH = Grade(0.0, "error:crash", None)
_TIMEOUT = Grade(0.0, "timeout", None)


# ----------------------------------------------------------------------------------------------
# in-process grading
# ----------------------------------------------------------------------------------------------


def grade_one(
    grader: str | Grader,
    response: str,
    ground_truth: str,
    *,
    timeout_s: float | None = 5.0,
    max_chars: int = DEFAULT_MAX_CHARS,
    overlong: Overlong = "tail",
) -> Grade:
    """Grade one item in this process.

    With ``timeout_s`` set, the limit interrupts the grader with ``SIGALRM``, so this must run on the
    main thread (``RuntimeError`` otherwise); Math-Verify's own alarms are disabled meanwhile. The
    signal comes from the process's alarm timer (``setitimer``; a timer the caller had armed runs on
    afterwards) and from a watchdog thread: a grader that arms or cancels the timer itself (a plug-in
    calling Math-Verify with its default limits: ``alarm(5)``, then ``alarm(0)``) does not cancel
    the limit, and past the limit the signal is repeated every ``20 ms`` until the grader has
    stopped, so an interrupt lost where Python swallows exceptions (inside ``__del__``, a weakref
    callback) is not the last. With ``timeout_s=None`` no outer limit
    is applied (Math-Verify keeps its defaults on the main thread). A C-level call that never returns
    to the interpreter cannot be interrupted here: use :class:`GradingPool`, whose limits kill the
    grading process, for untrusted graders or inputs.
    """
    fn = get_grader(grader) if isinstance(grader, str) else grader
    if not callable(fn):
        raise ValueError(f"grader must be a name or a callable, got {type(grader).__name__}")
    capped = cap_inputs(response, ground_truth, max_chars=max_chars, overlong=overlong)
    if isinstance(capped, Grade):
        return capped
    response, ground_truth = capped
    if timeout_s is None:
        return call_grader(fn, response, ground_truth)
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive or None")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "grade_one enforces its time limit with SIGALRM and must run on the main thread; "
            "use GradingPool, or timeout_s=None"
        )

    armed = [True]  # cleared as the grader stops: from then on a late signal is ignored

    def on_alarm(_signum: int, _frame: FrameType | None) -> None:
        if armed[0]:
            raise GradeTimeout()

    started = time.monotonic()
    outer = _WATCHDOG.arm(started + timeout_s)
    app_timer = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        try:
            # the first signal comes from the kernel's timer: it lands while the main thread holds
            # the GIL (in a long C call, the handler runs as soon as the call returns); the watchdog
            # is the backstop
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            with external_deadline():
                result = call_grader(fn, response, ground_truth)
        finally:
            armed[0] = False
    except GradeTimeout:
        # raised at the latest just before ``armed`` was cleared above; nothing here calls out before
        # it is cleared again, so no second one can come
        armed[0] = False
        result = _TIMEOUT
    finally:
        _WATCHDOG.restore(outer)
        signal.setitimer(signal.ITIMER_REAL, 0)
        # a signal sent before now has reached ``on_alarm`` (which ignored it) when these calls return
        signal.signal(signal.SIGALRM, previous)
        if app_timer[0] > 0:  # the caller's own timer runs on (one due meanwhile fires now)
            left = app_timer[0] - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), app_timer[1])
    return result


class _Watchdog:
    """``grade_one``'s limit: one thread per process that sends ``SIGALRM`` to the main thread once the
    armed deadline has passed, and again every ``repeat_s`` until the deadline is taken back.

    Beside the process's alarm timer, not instead of it: a grader that arms or cancels that timer
    itself (Math-Verify's own limits do) cancels the timer's signal, and one signal lost where Python
    swallows exceptions (``__del__``, weakref callbacks) would be the last. The timer still comes
    first where it can: a thread must take the GIL to send its signal, so while the main thread runs
    long C calls the watchdog's signal lands one call later than the timer's. No signal is sent once
    :meth:`restore` has returned. The thread starts on first use, and again in a forked child.
    """

    def __init__(self, repeat_s: float = 0.02) -> None:
        self.repeat_s = repeat_s
        self._pid = -1
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float) -> float | None:
        """Arm ``deadline`` (``time.monotonic()``; an armed earlier one stays in force); returns the
        deadline it replaces, for :meth:`restore`."""
        if self._pid != os.getpid():  # first use, or a forked child: the lock and thread are not ours
            self._pid, self._cond, self._thread = os.getpid(), threading.Condition(), None
            self._deadline = None
        with self._cond:
            outer = self._deadline
            self._deadline = deadline if outer is None else min(deadline, outer)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run,
                    args=(threading.main_thread().ident,),
                    name="exgrpo-grade-limit",
                    daemon=True,
                )
                self._thread.start()
            elif outer is None or self._deadline < outer:
                self._cond.notify()
        return outer

    def restore(self, outer: float | None) -> None:
        """Take the armed deadline back (an enclosing one, ``outer``, is armed again)."""
        with self._cond:
            self._deadline = outer

    def _run(self, thread_id: int | None) -> None:
        if thread_id is None:
            return
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                signal.pthread_kill(thread_id, signal.SIGALRM)
                self._cond.wait(self.repeat_s)


_WATCHDOG = _Watchdog()


def grade_items(
    grader: str, items: Sequence[tuple[str, str]], timeout_s: float, pool: GradingPool | None = None
) -> list[Grade]:
    """Grade ``(response, ground_truth)`` items with the named grader; results keep input order.

    In ``pool`` when one is given (hard per-item limits in child processes), else in this process
    with :func:`grade_one`: its ``SIGALRM`` limit works on the main thread only, so on any other
    thread items are graded without an outer limit (Math-Verify's own limits are off there too).
    """
    if not items:
        return []
    if pool is not None:
        return pool.grade_many(grader, items, timeout_s=timeout_s)
    limit = timeout_s if threading.current_thread() is threading.main_thread() else None
    return [grade_one(grader, response, gold, timeout_s=limit) for response, gold in items]


# ----------------------------------------------------------------------------------------------
# worker process
# ----------------------------------------------------------------------------------------------


def _worker_main(conn: Connection, preload: tuple[str, ...]) -> None:
    """Worker loop: one ``(task_id, grader_name, response, ground_truth)`` at a time."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for module in preload:
        with contextlib.suppress(Exception):  # a grader that fails to import reports it per item
            importlib.import_module(module)
    graders: dict[str, Grader] = {}
    conn.send(("ready", os.getpid()))
    with external_deadline():
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            task_id, name, response, ground_truth = msg
            grader = graders.get(name)
            if grader is None:
                try:
                    grader = graders[name] = get_grader(name)
                except Exception as exc:
                    conn.send((task_id, error_grade(exc)))
                    continue
            grade = call_grader(grader, response, ground_truth)
            conn.send((task_id, grade))


# ----------------------------------------------------------------------------------------------
# pool
# ----------------------------------------------------------------------------------------------


def _available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


@dataclass(eq=False)
class _Worker:
    proc: BaseProcess
    conn: Connection
    started: float
    ready: bool = False
    task: int | None = None
    task_id: int = -1
    deadline: float = 0.0
    dead: bool = False


@dataclass
class PoolStats:
    """Counters since the pool was created."""

    graded: int = 0
    timeouts: int = 0
    crashes: int = 0
    workers_started: int = 0


class GradingPool:
    """Process pool that grades ``(response, ground_truth)`` items with hard per-item timeouts.

    ``grade_many`` may be called from any thread; calls are serialised. Use as a context manager
    or call :meth:`close`.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        start_method: StartMethod = "forkserver",
        max_chars: int = DEFAULT_MAX_CHARS,
        overlong: Overlong = "tail",
        preload: Sequence[str] = DEFAULT_PRELOAD,
        start_timeout_s: float = 120.0,
        max_start_failures: int = 3,
    ) -> None:
        if num_workers is None:
            num_workers = _available_cpus()
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError("start_method must be 'forkserver' or 'spawn'")
        if overlong not in ("tail", "reject"):
            raise ValueError("overlong must be 'tail' or 'reject'")
        self.num_workers = num_workers
        self.max_chars = max_chars
        self.overlong: Overlong = overlong
        self._preload = tuple(preload)
        self._start_timeout_s = start_timeout_s
        self._max_start_failures = max_start_failures
        self._ctx: Any = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if the fork server of this process has not been started yet.
            self._ctx.set_forkserver_preload(["exgrpo_rollout.graders.pool", *self._preload])
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._task_ids = itertools.count()
        self._start_failures = 0
        self.stats = PoolStats()
        self._replenish()

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop all workers (politely, then SIGKILL after ``timeout_s``). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send(None)
            end = time.monotonic() + timeout_s
            for w in self._workers:
                w.proc.join(max(0.0, end - time.monotonic()))
                self._discard(w, kill=True)
            self._workers.clear()

    def warmup(self, timeout_s: float | None = None) -> None:
        """Block until every worker has started and imported its modules."""
        limit = self._start_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._check_open()
            end = time.monotonic() + limit
            while True:
                self._replenish()
                starting = [w for w in self._workers if not w.ready]
                if not starting:
                    return
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"grading workers not ready after {limit:.0f} s")
                self._poll(starting, min(left, 1.0), results=None)

    # -- grading ---------------------------------------------------------------------------------

    def grade_many(
        self, grader_name: str, items: Sequence[tuple[str, str]], timeout_s: float = 5.0
    ) -> list[Grade]:
        """Grade ``(response, ground_truth)`` items with the named grader; results keep input order.

        Each item gets at most ``timeout_s`` seconds of worker time (``Grade(0, "timeout")`` when it
        overruns; its worker is replaced). Raises ``ValueError`` for an unknown grader name and
        ``RuntimeError`` if workers cannot be started or the pool is closed.
        """
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        get_grader(grader_name)  # fail fast, in the caller, on unknown names
        n = len(items)
        results: list[Grade | None] = [None] * n
        payloads: list[tuple[str, str] | None] = [None] * n
        queue: deque[int] = deque()
        for i, item in enumerate(items):
            try:
                response, ground_truth = item
            except (TypeError, ValueError):
                results[i] = Grade(0.0, "error:TypeError", None)
                continue
            capped = cap_inputs(response, ground_truth, max_chars=self.max_chars, overlong=self.overlong)
            if isinstance(capped, Grade):
                results[i] = capped
            else:
                payloads[i] = capped
                queue.append(i)
        with self._lock:
            self._check_open()
            if queue:
                try:
                    self._run(grader_name, queue, payloads, results, timeout_s)
                except BaseException:
                    self._abandon_inflight()  # e.g. KeyboardInterrupt: leave no stale tasks behind
                    raise
            self.stats.graded += n
        return [r if r is not None else _CRASH for r in results]

    def grade(self, grader_name: str, response: str, ground_truth: str, timeout_s: float = 5.0) -> Grade:
        """Grade a single item in the pool."""
        return self.grade_many(grader_name, [(response, ground_truth)], timeout_s)[0]

    # -- internals -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GradingPool is closed")

    def _spawn(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._preload),
            name=f"grading-worker-{self.stats.workers_started}",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        self.stats.workers_started += 1
        self._workers.append(_Worker(proc=proc, conn=parent_conn, started=time.monotonic()))

    def _replenish(self) -> None:
        self._workers = [w for w in self._workers if not w.dead]
        while len(self._workers) < self.num_workers:
            if self._start_failures >= self._max_start_failures:
                raise RuntimeError(
                    f"grading workers failed to start {self._start_failures} times in a row; "
                    "check that the grader modules import in a fresh process"
                )
            self._spawn()

    def _discard(self, w: _Worker, *, kill: bool) -> None:
        if w.dead:
            return
        w.dead = True
        if kill and w.proc.is_alive():
            w.proc.kill()
        w.proc.join(5.0)
        with contextlib.suppress(OSError):
            w.conn.close()
        if not w.proc.is_alive():
            w.proc.close()

    def _abandon_inflight(self) -> None:
        for w in self._workers:
            if w.task is not None:
                w.task = None
                self._discard(w, kill=True)

    def _worker_lost(self, w: _Worker, results: list[Grade | None] | None, grade: Grade) -> None:
        """Record the end of a worker (crash or timeout) and release it."""
        if w.task is not None and results is not None:
            results[w.task] = grade
            if grade.reason == "timeout":
                self.stats.timeouts += 1
            else:
                self.stats.crashes += 1
        elif not w.ready:
            self._start_failures += 1
        w.task = None
        self._discard(w, kill=True)

    def _drain(self, w: _Worker, results: list[Grade | None] | None) -> None:
        while not w.dead:
            try:
                if not w.conn.poll():
                    return
                msg = w.conn.recv()
            except (EOFError, OSError):
                self._worker_lost(w, results, _CRASH)
                return
            except Exception as exc:  # undecodable reply: blame the item, replace the worker
                self._worker_lost(w, results, error_grade(exc))
                return
            if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "ready":
                w.ready = True
                self._start_failures = 0
                continue
            task_id, grade = msg
            if w.task is not None and task_id == w.task_id and results is not None:
                results[w.task] = grade if isinstance(grade, Grade) else coerce_grade(grade)
                w.task = None

    def _poll(self, watch: list[_Worker], wait_s: float, results: list[Grade | None] | None) -> None:
        waitables: list[Any] = []
        for w in watch:
            waitables.append(w.conn)
            waitables.append(w.proc.sentinel)
        ready = set(mp_connection.wait(waitables, timeout=max(0.0, wait_s)))
        for w in watch:
            if w.conn in ready:
                self._drain(w, results)
        for w in watch:
            if not w.dead and w.proc.sentinel in ready:
                self._drain(w, results)  # a reply written just before exiting still counts
                if not w.dead:
                    self._worker_lost(w, results, _CRASH)
        now = time.monotonic()
        for w in watch:
            if w.dead:
                continue
            if not w.ready and now - w.started > self._start_timeout_s:
                self._worker_lost(w, results, _CRASH)

    def _run(
        self,
        grader_name: str,
        queue: deque[int],
        payloads: list[tuple[str, str] | None],
        results: list[Grade | None],
        timeout_s: float,
    ) -> None:
        while True:
            self._replenish()
            now = time.monotonic()
            for w in self._workers:
                if not queue:
                    break
                if w.ready and w.task is None and not w.dead:
                    if not w.proc.is_alive():  # died while idle: not any item's fault
                        self._worker_lost(w, None, _CRASH)
                        continue
                    i = queue.popleft()
                    payload = payloads[i]
                    assert payload is not None
                    task_id = next(self._task_ids)
                    try:
                        w.conn.send((task_id, grader_name, payload[0], payload[1]))
                    except (OSError, ValueError):
                        queue.appendleft(i)  # never reached the worker: not this item's fault
                        self._worker_lost(w, None, _CRASH)
                        continue
                    w.task, w.task_id, w.deadline = i, task_id, now + timeout_s
            busy = [w for w in self._workers if w.task is not None and not w.dead]
            if not busy and not queue:
                return
            live = [w for w in self._workers if not w.dead]
            deadlines = [w.deadline for w in busy]
            deadlines += [w.started + self._start_timeout_s for w in live if not w.ready]
            wait_s = min(deadlines) - now if deadlines else 0.05
            self._poll(live, wait_s, results)
            now = time.monotonic()
            for w in busy:
                if not w.dead and w.task is not None and w.deadline <= now:
                    self._worker_lost(w, results, _TIMEOUT)
