"""What a run's stats pay to count its trajectories of the last five minutes (`ingest_per_minute`),
as the run ingests more: the statement the service runs now (the trajectory tally's whole
ten-second periods and part of one period's rows: migration 0014 on Postgres, 0015 on SQLite)
against the one it ran before (every recent row counted over the (run, created) index), on the
same database.

On a copy of the cached seeded pool of ``--size`` questions (``pool_bench.py --backends
postgres`` or ``sqlite`` seeds it), the seeded run stores trajectories of 8 bytes of payload,
created evenly over the five minutes and ten seconds before now, in steps up to each of
``--recent`` (cumulative); after each step both statements run ``--rounds`` times, taking turns,
and the medians of the wall time seen by the client are printed (asyncpg, prepared; or
`sqlite3`), with the database's own work, taken once per statement and step after the rounds: on
Postgres its execution time (``EXPLAIN ANALYZE``) and the rows of `trajectory` it reads, on
SQLite the steps of its virtual machine (a progress handler called at every step, which slows it:
no time is given for that run).

    .venv/bin/python bench/recent_count.py [--backend postgres|sqlite] [--recent 10000,50000,300000]
        [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed
import pool_bench as pb

from exgrpo_pool.store import repo, sqlite_inline
from exgrpo_pool.store.db import Database
from exgrpo_pool.store.models import Question, Run

#: the statement of a run's stats before migration 0014 (Postgres) and 0015 (SQLite): the tally's
#: total and every row of the five minutes counted
BEFORE = (
    "SELECT 0, run_id, sum(n) FROM trajectory_tally WHERE pool_id = $1 AND run_id = ANY($2::bigint[]) "
    "GROUP BY run_id UNION ALL SELECT 1, source_run_id, count(*) FROM trajectory WHERE source_run_id "
    "= ANY($3::bigint[]) AND created_at >= $4 GROUP BY source_run_id"
)
BEFORE_SQLITE = (
    "SELECT 0, run_id, sum(n) FROM trajectory_tally WHERE pool_id = ? AND run_id IN (?) GROUP BY run_id "
    "UNION ALL SELECT 1, ?, (SELECT count(*) FROM trajectory WHERE source_run_id = ? AND created_at >= ?)"
)


def _rows_read(plan: Any) -> int:
    """Rows that the nodes of an `EXPLAIN (ANALYZE, FORMAT JSON)` plan read from `trajectory`."""
    if isinstance(plan, list):
        return sum(_rows_read(p) for p in plan)
    node = plan.get("Plan", plan)
    own = node.get("Relation Name") == "trajectory"
    rows = int(node.get("Actual Rows", 0)) * int(node.get("Actual Loops", 1)) if own else 0
    return rows + sum(_rows_read(p) for p in node.get("Plans", []))


async def _store(db: Database, pool: int, run: int, qids: list[int], n: int) -> None:
    now = datetime.now(UTC)
    window = 310.0
    for first in range(0, n, 2000):
        rows = [
            {
                "question_id": qids[k % len(qids)],
                "pool_id": pool,
                "scope": run,
                "source_run_id": run,
                "policy_version": 1,
                "step": 1,
                "token_ids": bytes(4),
                "logprobs": bytes(4),
                "num_tokens": 1,
                "reward": 1.0,
                "entropy": 0.5,
                "dedup_key": secrets.token_bytes(32),
                "text": None,
                "created_at": now - timedelta(seconds=window * k / n),
            }
            for k in range(first, min(n, first + 2000))
        ]
        async with db.hot_sessions() as session, session.begin():
            await repo.insert_trajectories(session, rows)


async def _service_statement(db: Database, pool: int, run: int, since: datetime) -> tuple[str, list[Any]]:
    """The statement `repo.stats_counts` runs for a run's stats (without its last replays; with
    the run's state tally cells, which the statement before did not read), and its arguments."""
    seen: list[tuple[str, list[Any]]] = []
    spied_on = [
        (repo.Driver, "rows"),
        (sqlite_inline, "fetch_all_within"),
        (sqlite_inline, "fetch_all_off_loop"),
    ]
    kept = [getattr(module, name) for module, name in spied_on]

    def spying(read: Any) -> Any:
        async def spied(conn: Any, sql: str, args: Any, *rest: Any) -> Any:
            if "trajectory_tally" in sql and "FROM trajectory WHERE" in sql:
                seen.append((sql, list(args)))
            return await read(conn, sql, args, *rest)

        return spied

    for (module, name), read in zip(spied_on, kept, strict=True):
        setattr(module, name, spying(read))
    try:
        async with db.hot_sessions() as session:
            await repo.stats_counts(session, pool, {run: run}, since, replays=False)
    finally:
        for (module, name), read in zip(spied_on, kept, strict=True):
            setattr(module, name, read)
    return seen[-1]


def _sqlite_steps(conn: sqlite3.Connection, sql: str, args: list[Any]) -> int:
    """The steps of SQLite's virtual machine for one run of a statement."""
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    conn.set_progress_handler(step, 1)
    try:
        conn.execute(sql, args).fetchall()
    finally:
        conn.set_progress_handler(None, 0)
    return steps[0]


async def measure(args: argparse.Namespace) -> list[tuple[int, dict[str, tuple[float, float, int]]]]:
    out: list[tuple[int, dict[str, tuple[float, float, int]]]] = []
    name = f"recent_count_{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        async with _seed.seeded_copy(
            args.backend, args.size, pb.CACHE, Path(tmp), name, pg_dsn=args.pg_dsn, redis_url=args.redis_url
        ) as copy:
            db = Database(copy.settings.database_url)
            pg = args.backend == "postgres"
            conn: Any = (
                await asyncpg.connect(copy.url) if pg else sqlite3.connect(db.engine.url.database or "")
            )
            try:
                async with db.sessions() as session:
                    run = int(await session.scalar(select(Run.id).where(Run.name == _seed.RUN_NAME)) or 0)
                    pool = int(await session.scalar(select(Run.pool_id).where(Run.id == run)) or 0)
                    qids = [int(q) for q in await session.scalars(select(Question.id).limit(1000))]
                stored = 0
                for target in args.recent:
                    await _store(db, pool, run, qids, target - stored)
                    stored = target
                    async with db.transaction() as session:
                        await repo.fold_tallies(session)
                    since = datetime.now(UTC) - timedelta(minutes=5)
                    # the service's statement, as `stats_counts` runs it
                    now_statement = await _service_statement(db, pool, run, since)
                    if pg:
                        await conn.execute("ANALYZE trajectory_tally")
                        before = (BEFORE, [pool, [run], [run], since])
                    else:
                        stamp = since.strftime("%Y-%m-%d %H:%M:%S.%f")  # as the column binds it
                        before = (BEFORE_SQLITE, [pool, run, run, run, stamp])
                    statements = {"periods (now)": now_statement, "every row (before)": before}
                    walls: dict[str, list[float]] = {k: [] for k in statements}
                    for _ in range(args.rounds):
                        for key, (sql, a) in statements.items():
                            t = time.perf_counter()
                            await conn.fetch(sql, *a) if pg else conn.execute(sql, a).fetchall()
                            walls[key].append((time.perf_counter() - t) * 1000)
                    got: dict[str, tuple[float, float, int]] = {}
                    for key, (sql, a) in statements.items():
                        if pg:
                            plan = json.loads(
                                await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *a)
                            )
                            got[key] = (
                                statistics.median(walls[key]),
                                float(plan[0]["Execution Time"]),
                                _rows_read(plan),
                            )
                        else:
                            got[key] = (
                                statistics.median(walls[key]),
                                float("nan"),
                                _sqlite_steps(conn, sql, a),
                            )
                    out.append((target, got))
                    print(f"{target:,} recent trajectories measured", file=sys.stderr, flush=True)
            finally:
                await conn.close() if pg else conn.close()
                await db.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["postgres", "sqlite"], default="postgres")
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--recent", default="10000,50000,300000", help="recent trajectories, cumulative steps")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--pg-dsn", default=os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432")
    )
    ap.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = ap.parse_args()
    args.recent = [int(x) for x in args.recent.split(",")]
    rows = asyncio.run(measure(args))
    print(
        f"\n{args.backend}, {args.size:,} questions, a run's trajectories of the last five minutes counted\n"
    )
    if args.backend == "postgres":
        print(
            "| recent trajectories | statement | client wall p50 ms | Postgres execution ms "
            "| trajectory rows read |"
        )
        print("|---:|---|---:|---:|---:|")
    else:
        print("| recent trajectories | statement | wall p50 ms | SQLite steps |")
        print("|---:|---|---:|---:|")
    for target, got in rows:
        for key, (wall, execution, work) in got.items():
            database = f" {execution:.2f} |" if args.backend == "postgres" else ""
            print(f"| {target:,} | {key} | {wall:.2f} |{database} {work:,} |")


if __name__ == "__main__":
    main()
