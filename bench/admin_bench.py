"""What the rare, large operations cost on a seeded pool: deleting the whole pool with the tallies'
triggers (migration 0010) and without them, and `exgrpo db tallies` (a check, and a repair of one
cell set off on purpose).

On Postgres a DELETE's statement trigger gets every deleted row in a transition table, and the
deletion of a pool cascades to its questions, states and trajectories, so a pool of 1M questions
puts them all there (spilled to a temporary file past `work_mem`); on SQLite a row trigger runs
per deleted row. Each side deletes the pool from its own copy of the cached seeded pool
(`pool_bench.py` seeds it), migrated to the head; the other copy has the triggers dropped. Wall
time of the DELETE (cascades included) and its COMMIT.

    .venv/bin/python bench/admin_bench.py --backend sqlite --size 1000000
    .venv/bin/python bench/admin_bench.py --backend postgres --size 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed
import pool_bench as pb
import tally_bench

from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store.models import question_tally


async def _delete_sqlite(path: str, triggers: bool) -> float:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        dbmod._sqlite_pragmas(dbmod.SQLITE_CACHE_MB)(conn, None)  # foreign keys on: the cascades
        if not triggers:
            for name in tally_bench.TRIGGERS:
                conn.execute(f"DROP TRIGGER {name}")
        t0 = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM pool WHERE name = ?", (_seed.POOL_NAME,))
        conn.execute("COMMIT")
        return time.perf_counter() - t0
    finally:
        conn.close()


async def _delete_postgres(url: str, triggers: bool) -> float:
    conn = await asyncpg.connect(url)
    try:
        if not triggers:
            for name in tally_bench.TRIGGERS:
                table = tally_bench.COUNTED[name.rsplit("_", 1)[0]]
                await conn.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
        t0 = time.perf_counter()
        async with conn.transaction():
            await conn.execute("DELETE FROM pool WHERE name = $1", _seed.POOL_NAME)
        return time.perf_counter() - t0
    finally:
        await conn.close()


async def _tallies(url: str) -> dict[str, float]:
    """`exgrpo db tallies`: a check, then a repair of one cell set off on purpose."""
    db = dbmod.Database(url)
    try:
        t0 = time.perf_counter()
        assert await db.check_tallies() == [], "the seeded pool's tallies should agree with its rows"
        check = time.perf_counter() - t0
        async with db.write() as session:
            await session.execute(question_tally.insert().values(pool_id=1, n=5))
        t0 = time.perf_counter()
        repaired = await db.check_tallies(repair=True)
        repair = time.perf_counter() - t0
        assert len(repaired) == 1, repaired
        return {"check": check, "repair": repair}
    finally:
        await db.close()


async def main_async(args: argparse.Namespace) -> None:
    rows: list[tuple[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=pb.OUT) as tmp:
        async with contextlib.AsyncExitStack() as stack:
            copies = {
                triggers: await stack.enter_async_context(
                    _seed.seeded_copy(
                        args.backend,
                        args.size,
                        pb.CACHE,
                        Path(tmp),
                        f"exgrpo_admin_{'on' if triggers else 'off'}",
                        pg_dsn=args.pg_dsn,
                        redis_url=args.redis_url,
                    )
                )
                for triggers in (True, False)
            }
            for copy in copies.values():
                await asyncio.to_thread(dbmod.upgrade, copy.settings.database_url)
            tallies = await _tallies(copies[True].settings.database_url)
            rows += [
                ("exgrpo db tallies", f"{tallies['check']:.2f}"),
                ("exgrpo db tallies --repair (one cell off)", f"{tallies['repair']:.2f}"),
            ]
            delete = _delete_sqlite if args.backend == "sqlite" else _delete_postgres
            for triggers in (True, False):
                took = await delete(copies[triggers].url, triggers)
                rows.append(
                    (f"delete the pool, {'with' if triggers else 'without'} tally triggers", f"{took:.2f}")
                )
    print(f"\n{args.backend}, seeded pool of {args.size:,} questions\n")
    print("| operation | seconds |\n|---|---:|")
    for what, secs in rows:
        print(f"| {what} | {secs} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
