"""What a request costs beyond the service's own work, and what a commit costs in a write.

1. **The framework's share**: in one process, on a copy of the cached seeded SQLite pool of
   ``--size`` questions (``pool_bench.py`` seeds it), the event-loop thread's CPU per request of a
   selection (``n`` questions, ids only) sent through the whole app (uvicorn's ASGI interface,
   FastAPI's routing, dependencies and validation, the middleware) with ``httpx.ASGITransport``;
   the same selection called directly (the request model validated, the service function, the
   JSON answer); and ``GET /healthz`` through the app (the client's own share and the fixed cost
   of any request). Rounds alternate, medians are printed.
2. **A COMMIT's share of a write** (``--commit-cost``): 1,000 rows of 8 KB payload inserted in one
   transaction and committed, on Postgres (``STORAGE EXTERNAL`` columns, as the service's) and on
   SQLite (WAL, ``synchronous=NORMAL`` and the service's checkpoint bound), the insert and the
   COMMIT timed apart: what grouping several requests into one transaction could save at most.

    .venv/bin/python bench/request_overhead.py [--size 10000] [--n 64] [--rounds 10] [--commit-cost]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed
import pool_bench as pb

from exgrpo_client import schemas as s
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings
from exgrpo_pool.service import batches
from exgrpo_pool.store.db import WAL_AUTOCHECKPOINT_PAGES


async def framework_share(size: int, n: int, rounds: int) -> dict[str, float]:
    seed = pb.CACHE / f"sqlite-{size}.db"
    if not seed.exists():
        raise SystemExit(f"no seeded pool at {seed}: run pool_bench.py --sizes {size} first")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "pool.db"
        _seed.copy_sqlite(seed, work)
        settings = Settings(database_url=f"sqlite+aiosqlite:///{work}", allow_anonymous=True)
        app = create_app(settings, freeze_heap=True)
        async with app.router.lifespan_context(app):
            ctx = app.state.ctx
            raw = json.dumps({"n": n, "seed": 1, "candidates": "none"}).encode()
            path = f"/v1/pools/{_seed.POOL_NAME}/runs/{_seed.RUN_NAME}/select"
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:

                async def through_app() -> None:
                    r = await client.post(path, content=raw, headers={"content-type": "application/json"})
                    r.raise_for_status()

                async def direct() -> None:
                    req = s.SelectRequest.model_validate_json(raw)
                    answer = await batches.select_replay(ctx, _seed.POOL_NAME, _seed.RUN_NAME, req)
                    answer.json()

                async def healthz() -> None:
                    (await client.get("/healthz")).raise_for_status()

                kinds: dict[str, Callable[[], Awaitable[None]]] = {
                    "select through the app": through_app,
                    "select called directly": direct,
                    "GET /healthz through the app": healthz,
                }
                for fn in kinds.values():  # warm-up
                    await fn()
                cpu: dict[str, list[float]] = {k: [] for k in kinds}
                for _ in range(rounds):
                    for kind, fn in kinds.items():
                        t0 = time.thread_time()
                        for _ in range(20):
                            await fn()
                        cpu[kind].append((time.thread_time() - t0) / 20 * 1000)
    return {k: statistics.median(v) for k, v in cpu.items()}


async def _pg_commit_cost(dsn: str, rows: list[tuple[int, bytes, bytes]]) -> tuple[float, float]:
    conn = await asyncpg.connect(dsn)
    table = f"commit_cost_{os.getpid()}"
    try:
        await conn.execute(f"CREATE TABLE {table} (id bigserial primary key, q bigint, a bytea, b bytea)")
        await conn.execute(f"ALTER TABLE {table} ALTER COLUMN a SET STORAGE EXTERNAL")
        await conn.execute(f"ALTER TABLE {table} ALTER COLUMN b SET STORAGE EXTERNAL")
        ins, com = [], []
        for _ in range(8):
            t0 = time.perf_counter()
            tr = conn.transaction()
            await tr.start()
            await conn.executemany(f"INSERT INTO {table} (q, a, b) VALUES ($1, $2, $3)", rows)
            t1 = time.perf_counter()
            await tr.commit()
            ins.append((t1 - t0) * 1000)
            com.append((time.perf_counter() - t1) * 1000)
        return statistics.median(ins), statistics.median(com)
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.close()


def _sqlite_commit_cost(rows: list[tuple[int, bytes, bytes]]) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        con = sqlite3.connect(Path(tmp) / "x.db", isolation_level=None)
        for pragma in (
            "journal_mode=WAL",
            "synchronous=NORMAL",
            f"wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}",
        ):
            con.execute(f"PRAGMA {pragma}")
        con.execute("CREATE TABLE t (id integer primary key, q int, a blob, b blob)")
        ins, com = [], []
        for _ in range(8):
            t0 = time.perf_counter()
            con.execute("BEGIN IMMEDIATE")
            con.executemany("INSERT INTO t (q, a, b) VALUES (?, ?, ?)", rows)
            t1 = time.perf_counter()
            con.execute("COMMIT")
            ins.append((t1 - t0) * 1000)
            com.append((time.perf_counter() - t1) * 1000)
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the service checkpoints off the request
        con.close()
        return statistics.median(ins), statistics.median(com)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--commit-cost", action="store_true")
    ap.add_argument(
        "--pg-dsn", default=os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    args = ap.parse_args()
    print(f"| request (select n={args.n}, ids only, {args.size:,} questions) | loop-thread CPU ms |")
    print("|---|---:|")
    for kind, ms in asyncio.run(framework_share(args.size, args.n, args.rounds)).items():
        print(f"| {kind} | {ms:.2f} |")
    if args.commit_cost:
        rows = [(i, os.urandom(4096), os.urandom(4096)) for i in range(1000)]
        print("\n| backend (1,000 rows of 8 KB in one transaction) | insert ms | COMMIT ms | COMMIT share |")
        print("|---|---:|---:|---:|")
        for name, (ins, com) in (
            ("postgres", asyncio.run(_pg_commit_cost(args.pg_dsn, rows))),
            ("sqlite", _sqlite_commit_cost(rows)),
        ):
            print(f"| {name} | {ins:.1f} | {com:.2f} | {com / (ins + com):.0%} |")


if __name__ == "__main__":
    main()
