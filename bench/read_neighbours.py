"""What a polled read's ratio to the floor owes to the requests around it.

`pool_bench.py --floor` sends its polled reads in one order: a run's stats, the pool's stats and
a page of 50 questions, each to the service and then to the floor, after the plans, commits and
ingests of the run. This script sends a page of questions to the service (`_serve.py`) and to the
floor (`_floor.py`), each on its own copy of the cached seeded pool (`pool_bench.py` seeds it), in
three orders, before and after `--writes` plan + commit pairs per encoding on both sides:

* ``pages``: pages only, service and floor taking turns;
* ``in a row``: all of one side's pages, then all of the other's;
* ``with stats``: `pool_bench.py`'s order (run stats, pool stats, page; each to both sides);
* ``after a count elsewhere`` (Postgres): before each pair of pages, each side's database counts the
  last five minutes' trajectories for a client of its own (what the stats' count cost the
  database before migration 0014 read whole periods from the tally, without either side's stats
  request).

Per order and side: the p50 latency and the median server CPU (every thread of the process, read
around each request), with service/floor. Once a run has committed for a while, its stats count
the trajectories of the last five minutes (tens of thousands), and on Postgres that count runs
in the database's own process between two pages.

    .venv/bin/python bench/read_neighbours.py [--backend postgres|sqlite] [--size 10000]
        [--writes 40] [--reads 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed
import pool_bench as pb

PREFIX = f"/v1/pools/{_seed.POOL_NAME}"
PAGE = f"{PREFIX}/questions?limit=50"
STATS = (f"{PREFIX}/runs/{_seed.RUN_NAME}/stats", f"{PREFIX}/stats")


#: what a run's stats count of its recent trajectories, run on a connection of neither side
RECENT = "SELECT count(*) FROM trajectory WHERE created_at >= now() - interval '5 minutes'"


async def _order(
    apis: dict[str, pb.Api], order: str, reads: int, others: list[Any]
) -> dict[str, tuple[float, float]]:
    """(p50 ms, median CPU ms) of each side's pages in `order`."""
    got: dict[str, list[pb.Sample]] = {side: [] for side in apis}
    if order == "after a count elsewhere":
        for _ in range(reads):
            for conn in others:  # each side's database counts, for a client that is neither side
                await conn.fetchval(RECENT)
            for side, api in apis.items():
                got[side].append((await pb.timed_get(api, PAGE))[1])
    elif order == "in a row":
        for side, api in apis.items():
            for _ in range(reads):
                got[side].append((await pb.timed_get(api, PAGE))[1])
    else:
        paths = (*STATS, PAGE) if order == "with stats" else (PAGE,)
        for _ in range(reads):
            for path in paths:
                for side, api in apis.items():
                    sample = (await pb.timed_get(api, path))[1]
                    if path == PAGE:
                        got[side].append(sample)
    out = {}
    for side, samples in got.items():
        cpu = statistics.median(s.cpu_ms or 0.0 for s in samples)
        out[side] = (statistics.median(s.ms for s in samples), cpu)
    return out


async def _writes(apis: dict[str, pb.Api], trainers: dict[str, pb.Trainer], pairs: int) -> None:
    opts: Any = types.SimpleNamespace(idempotency_keys=True, candidates="all")
    for _ in range(pairs):
        for enc in ("json", "binary"):
            for side, api in apis.items():
                await pb.plan_commit(api, trainers[side], PREFIX, opts, enc)


async def measure(args: argparse.Namespace) -> list[tuple[int, str, dict[str, tuple[float, float]]]]:
    tag = f"neighbours-{os.getpid()}"
    work = pb.OUT / "work"
    work.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[int, str, dict[str, tuple[float, float]]]] = []
    servers: list[pb.Server] = []
    drop: list[str] = []
    redis_prefix = f"exgrpo-bench-{uuid.uuid4().hex[:8]}"
    shape = _seed.Shape(questions=args.size)
    missing = f"no seeded pool of {args.size:,} questions of this schema: run pool_bench.py --backends"
    try:
        if args.backend == "sqlite":
            seed = pb.CACHE / f"sqlite-{args.size}.db"
            if not _seed.sqlite_cache_ok(shape, seed):
                raise SystemExit(f"{missing} sqlite --sizes {args.size} first")
            own, floor_copy = work / f"{tag}.db", work / f"{tag}-floor.db"
            _seed.copy_sqlite(seed, own)
            _seed.copy_sqlite(seed, floor_copy)
            env = {"EXGRPO_DATABASE_URL": f"sqlite+aiosqlite:///{own}"}
            floor_url = str(floor_copy)
        else:
            seed_db = f"exgrpo_bench_seed_{args.size}"
            if not await _seed.pg_cache_ok(shape, args.pg_dsn, seed_db):
                raise SystemExit(f"{missing} postgres --sizes {args.size} first")
            own_db, floor_db = tag.replace("-", "_"), tag.replace("-", "_") + "_floor"
            for db in (own_db, floor_db):
                await _seed.copy_postgres(args.pg_dsn, seed_db, db)
                drop.append(db)
            env = {
                "EXGRPO_DATABASE_URL": _seed.pg_url(args.pg_dsn, own_db, driver=True),
                "EXGRPO_REDIS_URL": args.redis_url,
                "EXGRPO_REDIS_PREFIX": redis_prefix,
            }
            floor_url = _seed.pg_url(args.pg_dsn, floor_db)
        logs = pb.OUT / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        servers.append(pb.start_server(env, logs / f"{tag}.log", None))
        floor_env = {"FLOOR_DATABASE": floor_url}
        servers.append(pb.start_server(floor_env, logs / f"{tag}-floor.log", None, pb.FLOOR))
        async with contextlib.AsyncExitStack() as stack:
            apis = {}
            for side, s in zip(("service", "floor"), servers, strict=True):
                client = pb.bench_client(s.url)
                apis[side] = pb.Api(await stack.enter_async_context(client), s.proc.pid)
            for api in apis.values():  # warm-up
                for _ in range(30):
                    await pb.timed_get(api, PAGE)
            trainers = {side: pb.Trainer(seed=args.size) for side in apis}
            others: list[Any] = []
            for db in drop:
                conn = await asyncpg.connect(_seed.pg_url(args.pg_dsn, db))
                stack.push_async_callback(conn.close)
                others.append(conn)
            for pairs in (0, args.writes):
                await _writes(apis, trainers, pairs)
                orders = ["pages", "in a row", "with stats"]
                if others:
                    orders.append("after a count elsewhere")
                for order in orders:
                    rows.append((pairs, order, await _order(apis, order, args.reads, others)))
                    print(f"after {pairs} plan + commit pairs: {order} done", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
        if drop:
            await _seed.pg_admin(args.pg_dsn, *(f'DROP DATABASE IF EXISTS "{db}"' for db in drop))
            pb._redis_cleanup(args.redis_url, redis_prefix)
        for f in (pb.OUT / "work").glob(f"{tag}*"):
            f.unlink()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="postgres")
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--writes", type=int, default=40, help="plan + commit pairs per encoding and side")
    ap.add_argument("--reads", type=int, default=200, help="pages per side and order")
    ap.add_argument(
        "--pg-dsn", default=os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432")
    )
    ap.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = ap.parse_args()
    rows = asyncio.run(measure(args))
    print(f"\n{args.backend}, {args.size:,} questions, pages of 50, {args.reads} a side and order\n")
    print("| plan + commit pairs before | order | service p50 ms | floor p50 ms | p50 ratio "
          "| service CPU ms | floor CPU ms | CPU ratio |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for pairs, order, m in rows:
        (sm, sc), (fm, fc) = m["service"], m["floor"]
        print(f"| {pairs} | {order} | {sm:.2f} | {fm:.2f} | {sm / fm:.2f} ", end="")
        print(f"| {sc:.3f} | {fc:.3f} | {sc / fc:.2f} |")


if __name__ == "__main__":
    main()
