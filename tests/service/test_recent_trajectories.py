"""A run's trajectories of the last five minutes (`ingest_per_minute`), read from the trajectory
tally's periods (migrations 0014 and 0015, a trajectory's period stored with it): the whole periods
inside the five minutes summed from the tally, only the trajectories of part of the period the
five minutes begin in counted row by row, so the count's work does not grow with the run's ingest
rate. Exact on both backends wherever the five minutes begin in a period, after deletes, moves and
folds."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import make_url, select, text

from exgrpo_pool.service import stats as stats_mod
from exgrpo_pool.store import repo, sqlite_inline
from exgrpo_pool.store.db import Database
from exgrpo_pool.store.models import Question, Run, Trajectory

from .factories import pool_stats, run_stats, setup_pool
from .harness import ADMIN_TOKEN, Backend, serve_app

POSTGRES = pytest.param("postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis])

#: a period's start (periods are `repo.TALLY_PERIOD_S` long, counted from the epoch), later than
#: the clock: no fold at an insert (SQLite folds a run's as it opens a period) finds them long past
ALIGNED = datetime(2030, 1, 1, tzinfo=UTC)


def _row(pool: int, qid: int, run: int, key: int, at: datetime) -> dict[str, Any]:
    return {
        "question_id": qid,
        "pool_id": pool,
        "scope": -pool,
        "source_run_id": run,
        "policy_version": 1,
        "step": 1,
        "token_ids": bytes(8),
        "logprobs": bytes(8),
        "num_tokens": 2,
        "reward": 1.0,
        "entropy": 0.5,
        "dedup_key": key.to_bytes(32, "big"),
        "text": None,
        "created_at": at,
    }


async def _ids(db: Database) -> tuple[int, dict[str, int], list[int]]:
    async with db.sessions() as session:
        qids = [int(q) for q in (await session.scalars(select(Question.id).order_by(Question.id)))]
        pool = int(await session.scalar(select(Question.pool_id)) or 0)
        runs = {str(n): int(i) for n, i in (await session.execute(select(Run.name, Run.id))).all()}
    return pool, runs, qids


async def _store(db: Database, rows: list[dict[str, Any]]) -> None:
    for start in range(0, len(rows), 500):  # a request's worth at a time, as the service stores them
        async with db.hot_sessions() as session, session.begin():
            await repo.insert_trajectories(session, rows[start : start + 500])


async def _counted(db: Database, run: int, since: datetime) -> tuple[int, int]:
    """(every trajectory of the run, those created at or after `since`), counted row by row."""
    async with db.sessions() as session:
        stmt = select(Trajectory.created_at).where(Trajectory.source_run_id == run)
        made = (await session.execute(stmt)).all()
    return len(made), sum(1 for (at,) in made if at >= since)


async def _two_hours_of_r1(client: Any, db: Database, now: datetime) -> int:
    """A pool of 4 questions whose run r1 stored one trajectory a minute over the two hours
    before `now`; r1's id."""
    await setup_pool(client, questions=4)
    pool, runs, qids = await _ids(db)
    run = runs["r1"]
    await _store(db, [_row(pool, qids[k % 4], run, k, now - timedelta(minutes=k)) for k in range(120)])
    return run


async def _period_cells(db: Database, run: int) -> dict[int, int]:
    """The run's trajectory tally by period (those that sum to something)."""
    async with db.sessions() as session:
        got = await session.execute(
            text("SELECT period, sum(n) FROM trajectory_tally WHERE run_id = :r GROUP BY period"), {"r": run}
        )
        return {int(p): int(n) for p, n in got if n}


@contextmanager
def _now(monkeypatch: pytest.MonkeyPatch, at: datetime) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(stats_mod, "utcnow", lambda: at)
        yield


@pytest.mark.parametrize("offset", [0.0, 0.25, 3.5, 5.0, 9.75])
async def test_recent_trajectories_are_exact_wherever_the_five_minutes_begin(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, offset: float
) -> None:
    """Trajectories every quarter second over the six and a half minutes before `now`, `now` at
    several points of a period: the stats' recent count is the rows' own, the boundary's row (created
    exactly five minutes before) counted; after a delete of every third row, a move of some into
    the past and a fold of the tallies, still."""
    now = ALIGNED + timedelta(seconds=offset)
    since = now - timedelta(minutes=5)
    async with serve_app(backend.settings(), ADMIN_TOKEN) as (app, client):
        await setup_pool(client, questions=8, runs=("r1", "r2"))
        db: Database = app.state.ctx.db
        pool, runs, qids = await _ids(db)
        rows = [
            _row(pool, qids[k % len(qids)], runs["r1" if k % 5 else "r2"], k, now - timedelta(seconds=k / 4))
            for k in range(1560)
        ]
        await _store(db, rows)

        async def check() -> None:
            with _now(monkeypatch, now):
                one = {r: await run_stats(client, run=r) for r in runs}
                every = {r["run"]: r for r in (await pool_stats(client))["runs"]}
            for name, run in runs.items():
                total, recent = await _counted(db, run, since)
                assert recent > 0 and total > recent
                for stats in (one[name], every[name]):
                    assert (stats["trajectories"], stats["ingest_per_minute"]) == (total, recent / 5.0), name

        await check()
        async with db.transaction() as session:
            await session.execute(text("DELETE FROM trajectory WHERE id % 3 = 0"))
        await check()
        # some of the newest, an hour older: they leave the five minutes, and their periods (the
        # period is stored with a row, migration 0015: a writer that moves its time moves both)
        old = now - timedelta(hours=1)
        async with db.transaction() as session:
            await session.execute(
                text("UPDATE trajectory SET created_at = :old, period = :period WHERE id % 7 = 1"),
                {
                    "old": old.strftime("%Y-%m-%d %H:%M:%S.%f") if db.is_sqlite else old,
                    "period": repo.tally_period(old),
                },
            )
        await check()
        async with db.transaction() as session:
            await repo.fold_tallies(session, now=now)
        await check()


async def test_a_fold_leaves_one_row_per_run_for_the_periods_long_past(backend: Backend) -> None:
    """Periods that ended more than `repo.TALLY_FOLD_AFTER` ago are folded into one row per cell
    (period 0): the tally of a run that ingests for days stays a few dozen rows; the counts stand."""
    now = ALIGNED
    async with serve_app(backend.settings(), ADMIN_TOKEN) as (app, client):
        db: Database = app.state.ctx.db
        run = await _two_hours_of_r1(client, db, now)
        before = await _period_cells(db, run)
        assert len(before) == 120 and sum(before.values()) == 120
        async with db.transaction() as session:
            await repo.fold_tallies(session, now=now)
        after = await _period_cells(db, run)
        kept = repo.TALLY_FOLD_AFTER // 60  # a row a minute younger than the fold's cut
        assert after[0] == 120 - len(after) + 1 and len(after) in (kept + 1, kept + 2), after
        assert {p: n for p, n in after.items() if p} == {p: n for p, n in before.items() if p in after}
        async with db.sessions() as session:
            drift = await repo.tally_drift(session, now=now)
            assert [d for d in drift if d.tally == "trajectory_tally"] == []
        # trajectories of periods folded away, deleted: their periods' rows come back negative
        # (a trajectory keeps its period), and the next fold puts them in period 0 again
        async with db.transaction() as session:
            await session.execute(text("DELETE FROM trajectory WHERE id % 2 = 0"))
        async with db.transaction() as session:
            await repo.fold_tallies(session, now=now)
        again = await _period_cells(db, run)
        assert sum(again.values()) == 60 and again.keys() <= after.keys(), again
        async with db.sessions() as session:
            drift = await repo.tally_drift(session, now=now)
            assert [d for d in drift if d.tally == "trajectory_tally"] == []
            rows = await session.scalar(
                text("SELECT count(*) FROM trajectory_tally WHERE run_id = :r"), {"r": run}
            )
        assert rows == len(again)


async def test_a_recount_folds_the_periods_long_past(backend: Backend) -> None:
    """A repair's recount (`exgrpo db tallies --repair`) and a bulk load's count put the periods that
    ended `repo.TALLY_FOLD_AFTER` ago straight into period 0: a pool of long history would
    otherwise get a tally row per ten seconds of it, read by every stats request until a fold.
    SQLite's insert has folded them already, as it opened the run's periods."""
    now = datetime.now(UTC)
    young = repo.TALLY_FOLD_AFTER // 60  # minutes younger than the cut: their own periods
    async with serve_app(backend.settings(), ADMIN_TOKEN) as (app, client):
        db: Database = app.state.ctx.db
        run = await _two_hours_of_r1(client, db, now)
        if db.is_sqlite:
            assert len(await _period_cells(db, run)) in (young + 1, young + 2)
        for recount in ("repair", "bulk load"):
            async with db.transaction() as session:
                await session.execute(text("DELETE FROM trajectory_tally"))
                if recount == "repair":
                    await repo.recount_tallies(session)
                else:
                    await session.execute(text(repo.tally_trajectories()))
            cells = await _period_cells(db, run)
            assert sum(cells.values()) == 120 and len(cells) in (young + 1, young + 2), (recount, cells)
            assert cells[0] >= 120 - young - 1, (recount, cells)
            with_stats = await run_stats(client)
            assert with_stats["trajectories"] == 120 and with_stats["ingest_per_minute"] == 5 / 5.0, recount


def _trajectory_rows_read(plan: Any) -> int:
    """Rows that the nodes of an `EXPLAIN (ANALYZE, FORMAT JSON)` plan read from `trajectory`."""
    if isinstance(plan, list):
        return sum(_trajectory_rows_read(p) for p in plan)
    node = plan.get("Plan", plan)
    own = node.get("Relation Name") == "trajectory"
    rows = int(node.get("Actual Rows", 0)) * int(node.get("Actual Loops", 1)) if own else 0
    return rows + sum(_trajectory_rows_read(p) for p in node.get("Plans", []))


def _sqlite_steps(database_url: str, sql: str, args: Any) -> int:
    """The steps of SQLite's virtual machine for one statement, run on a connection of its own."""
    conn = sqlite3.connect(make_url(database_url).database or "")
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    try:
        conn.set_progress_handler(step, 1)
        conn.execute(sql, args).fetchall()
    finally:
        conn.close()
    return steps[0]


async def _postgres_rows_read(database_url: str, sql: str, args: Any) -> int:
    """The rows of `trajectory` that one statement reads (its plan, run with EXPLAIN ANALYZE)."""
    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return _trajectory_rows_read(
            json.loads(await conn.fetchval(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", *args))
        )
    finally:
        await conn.close()


async def test_the_count_does_no_more_for_a_run_that_ingested_more(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work of the stats statement for a run with ~300 and then ~3,000 trajectories of the last
    five minutes: the whole periods come from the tally, so ten times the rows reads the boundary
    period's part ten times, not every new row as when every recent row was counted. On Postgres
    the rows of `trajectory` its plan reads: 3 -> 30 (301 -> 3,002 before migration 0014); on
    SQLite its virtual machine's steps grow by the 27 rows' (by 2,701 rows' at ~3 steps each
    before migration 0015)."""
    statements: list[tuple[str, list[Any]]] = []

    def spying(read: Any) -> Any:
        async def spied(conn: Any, sql: str, args: Any, *rest: Any) -> Any:
            if "trajectory_tally" in sql and "FROM trajectory WHERE" in sql:
                statements.append((sql, list(args)))
            return await read(conn, sql, args, *rest)

        return spied

    for module, name in (
        (repo.Driver, "rows"),
        (sqlite_inline, "fetch_all_within"),
        (sqlite_inline, "fetch_all_off_loop"),
    ):
        monkeypatch.setattr(module, name, spying(getattr(module, name)))
    now = ALIGNED + timedelta(seconds=3)  # counted row by row: the period's first 3 s, subtracted
    async with serve_app(backend.settings(), ADMIN_TOKEN) as (app, client):
        await setup_pool(client, questions=8)
        db: Database = app.state.ctx.db
        pool, runs, qids = await _ids(db)
        seen: dict[int, float] = {}
        work: dict[int, int] = {}
        for per_second, first_key in ((1, 0), (9, 10_000)):
            rows = [
                _row(pool, qids[k % 8], runs["r1"], first_key + k, now - timedelta(seconds=k / per_second))
                for k in range(310 * per_second)  # ten seconds more than the five minutes
            ]
            await _store(db, rows)
            with _now(monkeypatch, now):
                seen[per_second] = (await run_stats(client))["ingest_per_minute"]
            if db.is_sqlite:
                work[per_second] = _sqlite_steps(backend.database_url, *statements[-1])
            else:
                work[per_second] = await _postgres_rows_read(backend.database_url, *statements[-1])
    assert seen == {1: 301 / 5.0, 9: (301 + 2701) / 5.0}  # `since` itself counted
    if backend.name.startswith("postgres"):
        assert work == {1: 3, 9: 30}, work
    else:
        assert work[9] - work[1] < 27 * 3 * 2, work
