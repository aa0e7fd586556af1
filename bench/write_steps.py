"""Where a commit's or an ingest's CPU goes, step by step, against the floor's.

In one process, on copies of the cached seeded pool (SQLite, `pool_bench.py` seeds it), the
service's app and the floor's app (`bench/_floor.py`) each answer `--steps` training steps as bare
ASGI calls (no HTTP, no client, as `bench/request_layers.py` sends them): a plan (answered as a
frame) and its commit of 64 fresh and 64 replayed groups (1,024 rollouts, ~3.5 MB), or with
`--request ingest` also an ingest of 32 fresh groups, the request measured (sent as a frame, or with
`--encoding json` as JSON with base64 payloads). Three views, timed by the event-loop thread's
CPU, or with `--clock wall` by the time that passed (a wait for the GIL, for a worker thread or for
the disk counts there):

* per request: the process's CPU (every thread: the service hashes a commit in a thread, and the
  WAL checkpoint runs in one on both sides), the loop thread's and the wall time, medians;
* every `sqlite3` call on the loop thread (the module's connections and cursors subclassed), by
  statement, means per request: the statements are the same work on both sides;
* each side's steps (its functions wrapped), inclusive means per request: what the loop spends
  around the statements.

The first 5 steps are left out. The wrappers cost ~1-2 us a call.

    .venv/bin/python bench/write_steps.py [--request commit|ingest] [--encoding binary|json]
        [--steps 60] [--size 10000] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import inspect
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _floor
import _seed
import pool_bench as pb
from request_layers import Asgi, _scope, asgi_request

from exgrpo_client import frames

SKIP = 5
#: the clock of every statement's and step's time: the event-loop thread's CPU, or with
#: `--clock wall` the time that passed (waits for the GIL, for a worker thread, for I/O included)
CLOCK: Callable[[], float] = time.thread_time


class Timer:
    """Loop-thread CPU by label while `on`."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False

    def add(self, label: str, seconds: float) -> None:
        if self.on and threading.current_thread() is threading.main_thread():
            self.cpu[label] += seconds
            self.calls[label] += 1

    def rows(self, n: int, order: list[str] | None = None) -> list[tuple[str, float, float]]:
        """(label, ms per request, calls per request): in `order`, else largest first."""
        rows = [(k, v / n * 1e3, self.calls[k] / n) for k, v in self.cpu.items()]
        if order is None:
            return sorted(rows, key=lambda r: -r[1])
        return sorted(rows, key=lambda r: order.index(r[0]) if r[0] in order else len(order))


SQL = Timer()
STEPS = Timer()
#: the service's steps in the order they were wrapped (a step's parts below it, indented)
STEP_ORDER: list[str] = []
#: the floor's (`_timed_floor_steps`), and the steps both sides share (`frames.decode`)
FLOOR_ORDER: list[str] = []


def _head(sql: str) -> str:
    """A statement's first words (a list of ids as `(?...)`)."""
    text = " ".join(sql.split())
    start = text.find("(?")
    if start >= 0:
        end = text.find(")", start)
        text = text[:start] + "(?...)" + text[end + 1 :]
    return text[:90]


class _Cursor(sqlite3.Cursor):
    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        t = CLOCK()
        try:
            return super().execute(sql, parameters)
        finally:
            SQL.add(_head(sql), CLOCK() - t)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> sqlite3.Cursor:
        t = CLOCK()
        try:
            return super().executemany(sql, seq_of_parameters)
        finally:
            SQL.add("(many) " + _head(sql), CLOCK() - t)

    def fetchall(self) -> list[Any]:
        t = CLOCK()
        try:
            return super().fetchall()
        finally:
            SQL.add("fetchall()", CLOCK() - t)


class _Connection(sqlite3.Connection):
    def cursor(self, factory: Any = _Cursor) -> Any:
        return super().cursor(factory)

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        return self.cursor().execute(sql, parameters)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> sqlite3.Cursor:
        return self.cursor().executemany(sql, seq_of_parameters)

    def commit(self) -> None:
        t = CLOCK()
        try:
            super().commit()
        finally:
            SQL.add("COMMIT", CLOCK() - t)


def _timed_connections() -> None:
    """Every `sqlite3` connection made from now on times its calls."""
    connect = sqlite3.connect

    def timed(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        kwargs.setdefault("factory", _Connection)
        return connect(*args, **kwargs)

    sqlite3.connect = timed  # type: ignore[assignment]


def _wrap(owner: Any, name: str, label: str) -> None:
    STEP_ORDER.append(label)
    wrap(owner, name, label, STEPS)


def wrap(owner: Any, name: str, label: str, timer: Timer) -> None:
    """`owner.name` replaced by a wrapper that adds its calls' loop CPU to `timer` under `label`."""
    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t = CLOCK()
            try:
                return await fn(*args, **kwargs)
            finally:
                timer.add(label, CLOCK() - t)

        setattr(owner, name, timed_async)
        return

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            timer.add(label, CLOCK() - t)

    setattr(owner, name, timed)


def _timed_service_steps() -> None:
    """The service's steps of a commit and an ingest, wrapped where they are looked up."""
    from fastapi.dependencies import utils as fastapi_deps

    from exgrpo_pool.api import deps, lean, wire
    from exgrpo_pool.service import batches, experience
    from exgrpo_pool.store import repo

    _wrap(wire, "_unframed", "the frame read and checked (wire)")
    _wrap(wire, "_json_parsed", "the JSON body read and parsed (wire)")
    _wrap(frames, "decode", "  frames.decode")
    _wrap(frames.Payloads, "check", "  Payloads.check")
    _wrap(lean, "request_body_to_args", "the body validated")
    _wrap(fastapi_deps, "request_body_to_args", "the body validated (FastAPI's solver)")
    _wrap(wire.Wire, "prepare", "payloads handed to the rollouts")
    _wrap(wire, "predecode", "  the JSON payloads decoded and checked")
    _wrap(deps.Idempotency, "run", "the write (Idempotency.run)")
    _wrap(batches, "commit_batch", "  service.commit_batch")
    _wrap(batches, "ingest", "  service.ingest")
    _wrap(batches, "lock_run", "    lock_run")
    _wrap(repo, "batch_rows", "    repo.batch_rows")
    _wrap(batches, "_check_against_plan", "    the groups checked against the plan")
    for name in ("check_fence", "stored_plan", "rules_for", "scopes_of", "capacity_of", "_result"):
        _wrap(batches, name, f"    batches.{name}")
    for name in ("check_group_sizes", "decide_group"):
        _wrap(experience, name, f"      experience.{name}")
    _wrap(batches, "apply_groups", "    apply_groups")
    for name in (
        "questions_in_pool",
        "get_states",
        "upsert_decided_states",
        "insert_trajectories",
        "delete_trajectories",
    ):
        _wrap(repo, name, f"      repo.{name}")
    _wrap(experience, "trajectory_key", "      trajectory_key")
    for name in ("update_run", "merge_run_metrics", "update_batch"):
        _wrap(repo, name, f"    repo.{name}")
    _wrap(batches, "_apply_all_moves", "    the index follows")


def _timed_floor_steps() -> None:
    """The floor's steps of a commit and an ingest (`FLOOR_ORDER`); the frame's decoding is
    `frames.decode`, wrapped for both sides already."""
    floor = _floor.Floor
    for owner, name, label in (
        (_floor, "_payloads", "the payloads sliced and checked"),
        (floor, "commit", "Floor.commit"),
        (floor, "ingest", "Floor.ingest"),
        (floor, "_idempotent", "  the key recorded"),
        (floor, "_apply", "  Floor._apply"),
        (_floor, "decide_group", "    decide_group"),
        (_floor, "trajectory_key", "    trajectory_key"),
        (floor, "_states", "    the states read"),
        (floor, "_insert_trajectories", "    the trajectories inserted"),
        (floor, "apply_moves", "the index follows"),
    ):
        FLOOR_ORDER.append(label)
        wrap(owner, name, label, STEPS)


async def _call(app: Asgi, scope: dict[str, Any], body: bytes) -> tuple[int, bytes]:
    status, answer, _ = await asgi_request(app, scope, body)
    # the event loop's turn between two requests, as a server's loop has one while the answer goes
    # out and the next request comes in: what a request left to run after it (the WAL checkpoint's
    # task, on both sides) starts there, and not at the next request's first real wait (the
    # floor's requests have none, the service's some: the checkpoint fell into different requests)
    await asyncio.sleep(0)
    return status, answer


async def _side(side: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    run = _seed.RUN_NAME
    frame = frames.MEDIA_TYPE.encode()
    json_in = (b"content-type", b"application/json")
    body_type = (b"content-type", frame if args.encoding == "binary" else b"application/json")
    async with contextlib.AsyncExitStack() as stack:
        copy = await stack.enter_async_context(
            _seed.seeded_copy("sqlite", args.size, pb.CACHE, tmp, side, pg_dsn="", redis_url="")
        )
        app: Asgi
        if side == "service":
            from exgrpo_pool.app import create_app

            service = create_app(copy.settings, freeze_heap=True)
            await stack.enter_async_context(service.router.lifespan_context(service))
            app = service
        else:
            floor = _floor.Floor(await _floor._connect(copy.url))
            await floor.load()
            app = _floor.app_for(floor)
        trainer = pb.Trainer(seed=1)
        picks = random.Random(1)
        process: list[float] = []
        loop: list[float] = []
        wall: list[float] = []
        for i in range(args.steps + SKIP):
            scope = _scope("POST", f"{prefix}/runs/{run}/batches", headers=(json_in, (b"accept", frame)))
            status, raw = await _call(app, scope, json.dumps({"candidates": "all"}).encode())
            if status not in (200, 201):  # the floor answers a plan 200, the service 201
                raise SystemExit(f"{side}: plan answered {status}: {raw[:300]!r}")
            plan = frames.decode(raw)[0]
            commit = (
                _scope("POST", f"{prefix}/batches/{plan['id']}/commit", headers=(body_type,)),
                trainer.commit_body(plan, args.encoding),
            )
            measured = commit
            if args.request == "ingest":
                await _call(app, *commit)
                qids = [picks.randrange(1, args.size + 1) for _ in range(32)]
                measured = (
                    _scope("POST", f"{prefix}/runs/{run}/ingest", headers=(body_type,)),
                    trainer.ingest_body(qids, args.encoding),
                )
            SQL.on = STEPS.on = i >= SKIP
            p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            status, raw = await _call(app, *measured)
            p1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
            SQL.on = STEPS.on = False
            if status != 200:
                raise SystemExit(f"{side}: {args.request} answered {status}: {raw[:300]!r}")
            if i >= SKIP:
                process.append((p1 - p0) * 1e3)
                loop.append((t1 - t0) * 1e3)
                wall.append((w1 - w0) * 1e3)
        out = {
            "process_ms": statistics.median(process),
            "loop_ms": statistics.median(loop),
            "wall_ms": statistics.median(wall),
            "sql": SQL.rows(args.steps),
            "steps": STEPS.rows(args.steps, STEP_ORDER if side == "service" else [*FLOOR_ORDER, *STEP_ORDER]),
        }
        SQL.cpu.clear()
        SQL.calls.clear()
        STEPS.cpu.clear()
        STEPS.calls.clear()
        print(f"{side} done", file=sys.stderr, flush=True)
        return out


async def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    _timed_connections()
    _timed_service_steps()
    _timed_floor_steps()
    with tempfile.TemporaryDirectory() as tmp:
        return {side: await _side(side, args, Path(tmp)) for side in ("floor", "service")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--request", choices=["commit", "ingest"], default="commit")
    ap.add_argument("--encoding", choices=["binary", "json"], default="binary")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="what the statements and steps are timed by: the loop thread's CPU, or the time that passed",
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.thread_time
    out = asyncio.run(measure(args))
    clock = "wall-clock ms" if args.clock == "wall" else "CPU ms of the event-loop thread"
    print(f"\nSQLite, {args.size:,} questions, {args.request}, medians of {args.steps} requests\n")
    print("| side | process CPU | event-loop thread CPU | wall | its sqlite3 calls (" + args.clock + ") |")
    print("|---|---:|---:|---:|---:|")
    for side, m in out.items():
        sql = sum(ms for _, ms, _ in m["sql"])
        print(f"| {side} | {m['process_ms']:.2f} | {m['loop_ms']:.2f} | {m['wall_ms']:.2f} | {sql:.2f} |")
    print(f"\nEvery sqlite3 call on the loop thread, {clock} per request (calls per request)\n")
    print("| statement | floor | service |")
    print("|---|---:|---:|")
    floor = {k: (ms, n) for k, ms, n in out["floor"]["sql"]}
    service = {k: (ms, n) for k, ms, n in out["service"]["sql"]}
    for key in sorted(
        set(floor) | set(service), key=lambda k: -max(floor.get(k, (0, 0))[0], service.get(k, (0, 0))[0])
    ):
        cells = [f"{v[0]:.3f} ({v[1]:.2g})" if (v := d.get(key)) else "-" for d in (floor, service)]
        print(f"| `{key}` | {cells[0]} | {cells[1]} |")
    for side in ("service", "floor"):
        print(f"\nThe {side}'s steps, inclusive, {clock} per request (calls per request)\n")
        print("| step | ms | calls |")
        print("|---|---:|---:|")
        for label, ms, n in out[side]["steps"]:
            print(f"| {label} | {ms:.3f} | {n:.3g} |")


if __name__ == "__main__":
    main()
