"""Stats read tallies, not the pool (migration 0010): the statements of pool totals, runs' state
histograms and trajectory counts (one statement), and a pool's question count touch no question, state or
trajectory row, except a run's trajectories of part of the ten-second period the last five minutes
begin in (through the (run, created) index, between two times; the whole periods from the
trajectory tally, migration 0015). Counting rows there took 160-240 ms at 1M questions."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from sqlalchemy import create_engine, event
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo

COUNTED = ("question", "run_question", "trajectory")


def _plans(url: str, sqls: list[str]) -> list[list[str]]:
    engine = create_engine(url.replace("+aiosqlite", ""))
    try:
        with engine.connect() as conn:
            return [[str(r[-1]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {q}").all()] for q in sqls]
    finally:
        engine.dispose()


def _statements(url: str) -> list[str]:
    """The SQL the repository runs for stats, as run (literal parameters)."""
    seen: list[str] = []

    async def main() -> None:
        engine = create_async_engine(url)

        def grab(_c: object, _cur: object, statement: str, params: object, *_: object) -> None:
            values = list(params) if isinstance(params, tuple | list) else []
            sql = statement
            for v in values:
                sql = sql.replace("?", f"'{v}'" if isinstance(v, str) else str(int(v)), 1)
            seen.append(sql)

        event.listen(engine.sync_engine, "before_cursor_execute", grab)
        async with AsyncSession(engine) as session:
            await repo.pool_totals(session, 1)
            await repo.pool_tokens(session, 1)
            await repo.count_questions(session, 1)
            # two runs, one of each state scope (its own, the pool's)
            await repo.stats_counts(session, 1, {1: 1, 2: -1}, datetime(2026, 1, 1, tzinfo=UTC))
        await engine.dispose()

    asyncio.run(main())
    return seen


def _reads_counted_rows(plan: list[str]) -> list[str]:
    """The steps of a plan that read a counted table, but a run's trajectories of part of a
    period."""
    return [
        step
        for step in plan
        if any(f" {table} " in f"{step} " for table in COUNTED)
        and "ix_trajectory_run_created (source_run_id=? AND created_at>? AND created_at<?)" not in step
    ]


def test_stats_read_no_counted_rows(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    dbmod.upgrade(url)
    sqls = _statements(url)
    assert len(sqls) == 4, sqls
    plans = _plans(url, sqls)
    for sql, plan in zip(sqls, plans, strict=True):
        assert _reads_counted_rows(plan) == [], (sql, plan)
    # the part of a period is read, through the index between two times
    assert any("ix_trajectory_run_created" in step for plan in plans for step in plan)


def test_before_the_tallies_stats_counted_the_rows(tmp_path: Path) -> None:
    """The check above tells a count of the pool from a tally read: the same reads as the
    schema before the tallies ran them (a count over each counted table) fail it."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    dbmod.upgrade(url)
    command.downgrade(dbmod.alembic_config(url), "0009")
    counts = [
        "SELECT count(*) FROM question WHERE pool_id = 1",
        "SELECT scope, bucket, retired, count(*) FROM run_question WHERE scope IN (1, -1) GROUP BY 1, 2, 3",
        "SELECT source_run_id, count(*) FROM trajectory WHERE source_run_id IN (1, 2) GROUP BY 1",
        "SELECT count(*), sum(num_tokens) FROM trajectory WHERE pool_id = 1",
    ]
    for sql, plan in zip(counts, _plans(url, counts), strict=True):
        assert _reads_counted_rows(plan) != [], (sql, plan)
