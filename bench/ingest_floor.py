"""Ingest against the floor in one process: the service's work per request without HTTP or
concurrency.

`pool_bench.py --floor` measures ingest over HTTP from several producers, where the two sides'
numbers move with the machine between rounds. This runs the service's app and the floor's app
(`bench/_floor.py`) in one process, on two copies of the cached seeded pool (SQLite, or Postgres +
Redis as `pool_bench.py` runs it), and sends both the very same ingest bodies through
`httpx.ASGITransport`, one request at a time, rounds alternating which side goes first. Each round
sends `--per-round` requests of `--groups` graded groups; the process's CPU (all threads: SQLite's
work included, Postgres's and Redis's not) and the wall time per request are taken per round, each
round ending when its side's background WAL checkpoint has finished, and the medians printed with
service/floor. The page faults (minor) and the system time per request are the process's too.
"loop CPU" is the event loop's thread alone (`time.thread_time`): what the requests' handling
holds the loop for, without the work the side hands to other threads (SQLite's WAL checkpoint);
the client's share of sending each body through `httpx.ASGITransport` is in it, alike on both
sides. The "app" columns leave the client out: the time inside each side's ASGI app, from its
call to its return (the process's CPU, all threads, as a server's own would count it; the loop's;
the wall), so their ratios are those of the requests' own work, comparable with what
`pool_bench.py --floor` measures in the servers.

`--request commit` measures a training step's commit instead (`--groups` and `--per-round` do not
apply): each round plans `--commits` batches on each side (128 questions, candidates with their
payloads, as `pool_bench.py` plans them, not timed) and commits each with the 1,024 graded rollouts
a trainer of the same seed sends both sides, the same body on each (both sides plan the same
questions from the same copy); only the commits are timed, each after its side's checkpoint of the
plan has finished and up to the end of its own.

`--allocator default` leaves glibc's allocator as it starts (the service's `keep_freed_memory()`
not called), to measure what that setting changes; it applies to both sides, one process.

    .venv/bin/python bench/ingest_floor.py --backend sqlite --size 10000 --rounds 8 --encoding binary
    .venv/bin/python bench/ingest_floor.py --backend postgres --size 10000 --rounds 8
    .venv/bin/python bench/ingest_floor.py --backend sqlite --size 10000 --rounds 6 --request commit
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _floor
import _seed
import pool_bench as pb

import exgrpo_pool.app
from exgrpo_client import frames
from exgrpo_pool.app import create_app

SIDES = ("service", "floor")


@contextlib.asynccontextmanager
async def _apps(
    backend: str, size: int, tmp: Path, args: argparse.Namespace
) -> AsyncIterator[dict[str, Any]]:
    """The service's app and the floor's, each on its own copy of the seeded pool."""
    async with contextlib.AsyncExitStack() as stack:
        copies = {
            side: await stack.enter_async_context(
                _seed.seeded_copy(
                    backend, size, pb.CACHE, tmp, f"exgrpo_bench_ingest_{side}",
                    pg_dsn=args.pg_dsn, redis_url=args.redis_url,
                )
            )
            for side in SIDES
        }  # fmt: skip
        app = create_app(copies["service"].settings, freeze_heap=True)
        floor = _floor.Floor(await _floor._connect(copies["floor"].url))
        await floor.load()
        await stack.enter_async_context(app.router.lifespan_context(app))
        clients, clocks = {}, {}
        for side, asgi in (("service", app), ("floor", _floor.app_for(floor))):
            clocks[side] = _AppClock(asgi)
            transport = httpx.ASGITransport(app=clocks[side])
            clients[side] = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url=f"http://{side}", timeout=120)
            )
        yield {"clients": clients, "clocks": clocks, "app": app, "floor": floor}


def _clocks() -> tuple[float, float, float]:
    """The process's CPU (all threads), the calling thread's CPU and the wall clock, in seconds."""
    return time.process_time(), time.thread_time(), time.perf_counter()


#: what `_Took` sums per round, and what `_AppClock` adds to it (in the order `_clocks` reads them)
ROUND_MEASURES = ("cpu", "loop", "wall", "sys", "faults", "stored")
APP_MEASURES = ("app_cpu", "app_loop", "app_wall")


class _AppClock:
    """A side's ASGI app, timed from the call to its return: the request's own work, without the
    client's share of building and sending it through `httpx.ASGITransport` and of reading the
    answer (the columns "app ..."). Summed over the calls: the process's CPU (all threads, as a
    server's would count: the service's digest thread is in it), the calling thread's, the wall."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sums = dict.fromkeys(APP_MEASURES, 0.0)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        before = _clocks()
        try:
            await self.app(scope, receive, send)
        finally:
            for k, b, a in zip(APP_MEASURES, before, _clocks(), strict=True):
                self.sums[k] += a - b


async def _settle(side: str, apps: dict[str, Any]) -> None:
    """Wait for the side's background WAL checkpoint (SQLite): its CPU is the side's own work, and
    left running it would be counted in the other side's round."""
    if side == "service":
        await apps["app"].state.ctx.db.settle()
        return
    task = getattr(apps["floor"].db, "checkpoint", None)
    if task is not None:
        await task


class _Took:
    """What a side's requests of one round cost, summed over the spans between `start` and `stop`
    (the process's CPU, the loop's, the wall time, system time, minor page faults, and of those
    spans the time inside the side's app: `clock`), and `per_request` of them into `out`."""

    def __init__(self, clock: _AppClock) -> None:
        self.clock = clock
        self.sums = dict.fromkeys(ROUND_MEASURES + APP_MEASURES, 0.0)

    def start(self) -> None:
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)
        self._before = _clocks()
        self._app0 = dict(self.clock.sums)

    def stop(self, stored: float) -> None:
        r1, sums = resource.getrusage(resource.RUSAGE_SELF), self.sums
        for k, b, a in zip(("cpu", "loop", "wall"), self._before, _clocks(), strict=True):
            sums[k] += a - b
        sums["sys"] += r1.ru_stime - self._r0.ru_stime
        sums["faults"] += r1.ru_minflt - self._r0.ru_minflt
        sums["stored"] += stored
        for k, v in self.clock.sums.items():
            sums[k] += v - self._app0[k]

    def per_request(self, n: int, out: dict[str, list[float]]) -> None:
        for k, v in self.sums.items():
            out[k].append(v / n * (1 if k in ("faults", "stored") else 1000))


async def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    measures = ROUND_MEASURES + APP_MEASURES
    out: dict[str, dict[str, list[float]]] = {s: {k: [] for k in measures} for s in SIDES}
    if args.allocator == "default":
        exgrpo_pool.app.keep_freed_memory = lambda: False  # create_app's lifespan looks it up
    trainer, rng = pb.Trainer(0), np.random.default_rng(1)
    media = frames.MEDIA_TYPE if args.encoding == "binary" else "application/json"
    path = f"/v1/pools/{_seed.POOL_NAME}/runs/{_seed.RUN_NAME}/ingest"
    with tempfile.TemporaryDirectory() as tmp:
        async with _apps(args.backend, args.size, Path(tmp), args) as apps:
            clients = apps["clients"]
            if args.request == "commit":
                await _commits(args, apps, media, out)
                return out
            for r in range(args.rounds + 1):  # round 0 warms both sides up
                bodies = [
                    trainer.ingest_body(
                        [int(q) + 1 for q in rng.choice(args.size, size=args.groups, replace=False)],
                        args.encoding,
                    )
                    for _ in range(args.per_round)
                ]
                for side in pb.in_turn(SIDES, r + 1):
                    stored, took = 0, _Took(apps["clocks"][side])
                    took.start()
                    for body in bodies:
                        resp = await clients[side].post(path, content=body, headers={"content-type": media})
                        if resp.status_code != 200:
                            raise SystemExit(f"{side}: {resp.status_code} {resp.text[:300]}")
                        stored += resp.json()["stored_trajectories"]
                    await _settle(side, apps)
                    took.stop(stored)
                    if r:
                        took.per_request(len(bodies), out[side])
                print(f"round {r}/{args.rounds}", file=sys.stderr, flush=True)
    return out


async def _commits(
    args: argparse.Namespace, apps: dict[str, Any], media: str, out: dict[str, dict[str, list[float]]]
) -> None:
    """`--request commit`: per round and side, `--commits` plans (not timed), each committed with
    the same trainer's body on both sides; the commits' CPU and wall time per request."""
    trainers = {side: pb.Trainer(3) for side in SIDES}  # the same seed: the same bodies
    base = f"/v1/pools/{_seed.POOL_NAME}"
    for r in range(args.rounds + 1):  # round 0 warms both sides up
        for side in pb.in_turn(SIDES, r + 1):
            client = apps["clients"][side]
            took = _Took(apps["clocks"][side])
            for _ in range(args.commits):
                answer = await client.post(
                    f"{base}/runs/{_seed.RUN_NAME}/batches",
                    json={"candidates": "all"},
                    headers={"idempotency-key": uuid.uuid4().hex},
                )
                if answer.status_code not in (200, 201):
                    raise SystemExit(f"{side}: plan {answer.status_code} {answer.text[:300]}")
                plan = answer.json()
                body = trainers[side].commit_body(plan, args.encoding)
                await _settle(side, apps)
                took.start()
                resp = await client.post(
                    f"{base}/batches/{plan['id']}/commit",
                    content=body,
                    headers={"content-type": media, "idempotency-key": uuid.uuid4().hex},
                )
                if resp.status_code != 200:
                    raise SystemExit(f"{side}: commit {resp.status_code} {resp.text[:300]}")
                await _settle(side, apps)
                took.stop(resp.json()["stored_trajectories"])
            if r:
                took.per_request(args.commits, out[side])
            print(f"round {r}/{args.rounds} {side}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--encoding", choices=("binary", "json"), default="binary")
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--per-round", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--allocator", choices=("kept", "default"), default="kept")
    ap.add_argument("--request", choices=("ingest", "commit"), default="ingest")
    ap.add_argument("--commits", type=int, default=4, help="with --request commit: commits a round")
    args = ap.parse_args()
    out = asyncio.run(measure(args))
    med = {s: {k: statistics.median(v) for k, v in out[s].items()} for s in SIDES}
    what, per_round = f"ingests of {args.groups} groups", args.per_round
    if args.request == "commit":
        what, per_round = "commits of 128 groups (after plans of 64 fresh and 64 replayed)", args.commits
    print(
        f"\n{args.backend}, {args.size:,} questions, {args.encoding}, {what}, median of {args.rounds} "
        f"rounds of {per_round}, per request, allocator {args.allocator}\n"
    )
    cols = ("cpu", "loop", "sys", "faults", "wall", "app_cpu", "app_loop", "app_wall")
    print(
        "| side | CPU ms | loop CPU ms | system ms | page faults | wall ms | app CPU ms | app loop CPU ms "
        "| app wall ms | stored trajectories | trajectories/s |"
    )
    print("|---|" + "---:|" * (len(cols) + 2))
    for s in SIDES:
        m = med[s]
        cells = " | ".join(f"{m[k]:,.0f}" if k == "faults" else f"{m[k]:.1f}" for k in cols)
        print(f"| {s} | {cells} | {m['stored']:.0f} | {m['stored'] / m['wall'] * 1000:,.0f} |")
    ratios = {k: med["service"][k] / med["floor"][k] for k in cols if k not in ("sys", "faults")}
    cells = " | ".join("" if k not in ratios else f"{ratios[k]:.2f}" for k in cols)
    print(f"| service / floor | {cells} | | |")


if __name__ == "__main__":
    main()
