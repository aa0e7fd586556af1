"""Launcher of the pool service for `pool_bench.py`: one uvicorn process, settings from EXGRPO_*.

Besides the plain service it can, for the benchmark only:

* ``EXGRPO_BENCH_TIMING=1``: add a ``Server-Timing`` header to every response with the time the
  request spent in the application (from its first byte to the response start), in SQL statements
  (SQLAlchemy cursor events) and in Redis round trips, so the benchmark can tell where time goes.
  It also carries the request's garbage-collection pauses (``gc``: their time and number).
* ``EXGRPO_BENCH_SQL_LOG=<file>`` (with the timing): one line per SQL statement, its ms and text.
* ``EXGRPO_BENCH_FREEZE_HEAP=0``: serve without freezing the start-up heap (``create_app(...,
  freeze_heap=False)``), to measure what the freeze changes.
* ``EXGRPO_BENCH_PROFILE=<file>``: SIGUSR1 starts cProfile on the event-loop thread, SIGUSR2
  stops it and writes the stats to ``<file>``.
* An older service: ``pool_bench.py --service-src DIR`` puts the packages of an older tree first on
  ``PYTHONPATH``; this launcher then passes only what that service's ``create_app`` takes.
* ``EXGRPO_WORKERS=N`` (``pool_bench.py --service-workers N``): N service processes as
  ``exgrpo serve --workers N`` runs them, without any of the hooks above.

Usage: ``EXGRPO_DATABASE_URL=... EXGRPO_ALLOW_ANONYMOUS=true python bench/_serve.py``.
"""

from __future__ import annotations

import contextvars
import cProfile
import functools
import inspect
import os
import signal
import time
from collections.abc import Iterable
from typing import Any, TextIO

import uvicorn

from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

# [sql seconds, sql statements, redis seconds, redis round trips, gc seconds, gc passes] of the
# current request
_ACC: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("bench_acc", default=None)


def _add(slot: int, seconds: float) -> None:
    acc = _ACC.get()
    if acc is not None:
        acc[slot] += seconds
        acc[slot + 1] += 1


#: ``EXGRPO_BENCH_SQL_LOG``: a file to append a line per statement to (its ms and text)
_LOG_PATH = os.environ.get("EXGRPO_BENCH_SQL_LOG")
_LOG: TextIO | None = None


def _log_statement(seconds: float, text: str) -> None:
    """A statement's line in ``EXGRPO_BENCH_SQL_LOG``'s file (opened once per process), if set."""
    global _LOG
    if _LOG_PATH is None:
        return
    if _LOG is None:
        _LOG = open(_LOG_PATH, "a", buffering=1)  # noqa: SIM115  # open for the process's life
    _LOG.write(f"{seconds * 1000:.2f}\t{' '.join(text.split())[:120]}\n")


def _install_sql_timer() -> None:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def before(conn: Any, *_: Any) -> None:
        conn.info.setdefault("bench_t0", []).append(time.perf_counter())

    def after(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        stack = conn.info.get("bench_t0")
        if stack:
            seconds = time.perf_counter() - stack.pop()
            _add(0, seconds)
            _log_statement(seconds, statement)

    def failed(ctx: Any) -> None:
        stack = ctx.connection.info.get("bench_t0") if ctx.connection is not None else None
        if stack:
            stack.pop()

    event.listen(Engine, "before_cursor_execute", before)
    event.listen(Engine, "after_cursor_execute", after)
    event.listen(Engine, "handle_error", failed)

    # the hot path's statements that go to `sqlite3` or to asyncpg directly, not through
    # SQLAlchemy's execution (an older service, `--service-src`, may have neither module)
    import importlib

    for module_name in ("exgrpo_pool.store.sqlite_inline", "exgrpo_pool.store.pg_direct"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        # the reads (on the loop, and the long counts in a worker thread), and the writes
        for name in ("fetch_all", "fetch_all_off_loop", "execute"):
            run = getattr(module, name, None)
            if run is not None:
                setattr(module, name, _timed_call(run))


def probe_floor(app: Any, statements: Iterable[tuple[type, str]]) -> Any:
    """The floor's side of the probe (``pool_bench.py`` sets ``EXGRPO_BENCH_TIMING`` for both
    sides): its statements timed as the service's are (`statements`: the (class, method) pairs of
    its database calls, each call's whole time counted as SQL; SQLite's BEGIN on both sides, a
    COMMIT on neither), its collections, and the `Server-Timing` header: the probe's cost on both
    sides of a ratio."""
    for cls, name in statements:
        setattr(cls, name, _timed_call(vars(cls)[name]))
    _install_gc_timer()
    return ServerTiming(app)


def _timed_call(run: Any) -> Any:
    """An async call of the database (a driver call `(conn, sql, ...)` of the service, a method of
    the floor's) with its time added to the request's SQL time, and logged with its statement
    (its second argument, where that is one)."""

    async def call(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await run(*args, **kw)
        finally:
            seconds = time.perf_counter() - t0
            _add(0, seconds)
            _log_statement(seconds, args[1] if len(args) > 1 and isinstance(args[1], str) else run.__name__)

    return call


def _install_gc_timer() -> None:
    """Garbage-collection pauses, counted to the request whose allocation set them off."""
    import gc

    started: list[float] = [0.0]

    def callback(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            _add(4, time.perf_counter() - started[0])

    gc.callbacks.append(callback)


def _install_redis_timer() -> None:
    from redis.asyncio import client

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                _add(2, time.perf_counter() - t0)

        return wrapper

    client.Redis.execute_command = timed(client.Redis.execute_command)  # type: ignore[method-assign]  # timing probe
    client.Pipeline.execute = timed(client.Pipeline.execute)  # type: ignore[method-assign]  # timing probe


class ServerTiming:
    """ASGI wrapper that reports app / SQL / Redis time of each request in `Server-Timing`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        acc = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        token = _ACC.set(acc)
        t0 = time.perf_counter()

        async def timed_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                app_ms = (time.perf_counter() - t0) * 1000
                value = (
                    f'app;dur={app_ms:.3f}, sql;dur={acc[0] * 1000:.3f};desc="{int(acc[1])}", '
                    f'redis;dur={acc[2] * 1000:.3f};desc="{int(acc[3])}", '
                    f'gc;dur={acc[4] * 1000:.3f};desc="{int(acc[5])}"'
                )
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"server-timing", value.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            _ACC.reset(token)


def _install_profiler(path: str) -> None:
    prof = cProfile.Profile()

    def start(*_: Any) -> None:
        prof.enable()

    def stop(*_: Any) -> None:
        prof.disable()
        prof.dump_stats(path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def main() -> None:
    settings = Settings()
    if getattr(settings, "workers", 1) > 1:
        # `exgrpo serve --workers N` as it is: no Server-Timing, SQL log or profiler (they are
        # per process), and the benchmark's per-request CPU counts the parent only
        from exgrpo_cli._serve import serve_workers

        raise SystemExit(serve_workers(settings, demo=False, demo_data=None))
    kwargs: dict[str, Any] = {}
    if "freeze_heap" in inspect.signature(create_app).parameters:  # an older service has no freeze
        kwargs["freeze_heap"] = os.environ.get("EXGRPO_BENCH_FREEZE_HEAP", "1") == "1"
    app: Any = create_app(settings, **kwargs)
    if os.environ.get("EXGRPO_BENCH_TIMING") == "1":
        _install_sql_timer()
        _install_gc_timer()
        if settings.redis_url:
            _install_redis_timer()
        app = ServerTiming(app)
    if path := os.environ.get("EXGRPO_BENCH_PROFILE"):
        _install_profiler(path)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
