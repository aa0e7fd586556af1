"""The trajectory tally of what `repo.insert_trajectories` stores: counted by the insert itself on
both backends, not by a row trigger (migration 0013 drops SQLite's, as 0010 left none on
Postgres), exactly, whatever of the rows were stored already or come twice in one request, on
every connection a write takes (SQLite's inline driver and its thread driver)."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from sqlalchemy import select, text

from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo
from exgrpo_pool.store.db import Database
from exgrpo_pool.store.models import Question, Run

from .factories import setup_pool
from .harness import ADMIN_TOKEN, Backend, serve_app

AT = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)

TRAJECTORY_TRIGGERS = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'trajectory'"


async def _pool(backend: Backend) -> tuple[int, int, list[int]]:
    """The pool's id, its run's id and its questions' ids."""
    async with serve_app(backend.settings(), ADMIN_TOKEN) as (app, client):
        await setup_pool(client, questions=4)
        db: Database = app.state.ctx.db
        async with db.transaction() as session:
            rows = (await session.execute(select(Question.pool_id, Question.id).order_by(Question.id))).all()
            run = await session.scalar(select(Run.id))
    assert run is not None
    return int(rows[0][0]), int(run), [int(r[1]) for r in rows]


def _row(pool: int, qid: int, run: int | None, tokens: int, key: int) -> dict[str, Any]:
    return {
        "question_id": qid,
        "pool_id": pool,
        "scope": -pool,
        "source_run_id": run,
        "policy_version": 1,
        "step": 2,
        "token_ids": bytes(4 * tokens),
        "logprobs": bytes(4 * tokens),
        "num_tokens": tokens,
        "reward": 1.0,
        "entropy": 0.5,
        "dedup_key": bytes([key]) * 32,
        "text": None,
        "created_at": AT,
    }


async def _tally(db: Database, pool: int) -> dict[int, tuple[int, int]]:
    """The trajectory tally's cells of the pool (run id, 0 for none: trajectories, tokens),
    without the cells that sum to nothing."""
    async with db.sessions() as session:
        rows = await session.execute(
            text(
                "SELECT run_id, sum(n), sum(tokens) FROM trajectory_tally WHERE pool_id = :p GROUP BY run_id"
            ),
            {"p": pool},
        )
        return {int(r): (int(n), int(t)) for r, n, t in rows if n or t}


async def _insert(db: Database, rows: list[dict[str, Any]], *, hot: bool) -> int:
    sessions = db.hot_sessions if hot else db.sessions
    async with sessions() as session, session.begin():
        return await repo.insert_trajectories(session, rows)


async def test_an_insert_counts_what_it_stored_in_the_tally(backend: Backend) -> None:
    pool, run, (q1, q2, q3, _) = await _pool(backend)
    db = Database(backend.database_url, sqlite_inline=True)
    try:
        # every row new, two cells (a run's and none)
        first = [_row(pool, q1, run, 3, 1), _row(pool, q2, None, 5, 2), _row(pool, q3, run, 7, 3)]
        assert await _insert(db, first, hot=True) == 3
        assert await _tally(db, pool) == {run: (2, 10), 0: (1, 5)}
        # one row stored already, one new, and one twice in the request: only the new one counts
        second = [_row(pool, q1, run, 3, 1), _row(pool, q2, run, 11, 4), _row(pool, q2, run, 11, 4)]
        assert await _insert(db, second, hot=True) == 1
        assert await _tally(db, pool) == {run: (3, 21), 0: (1, 5)}
        # the thread driver's connections (an import) count alike
        third = [_row(pool, q3, None, 13, 5), _row(pool, q3, run, 7, 3)]
        assert await _insert(db, third, hot=False) == 1
        assert await _tally(db, pool) == {run: (3, 21), 0: (2, 18)}
        # every row new, one cell (a request's rows, always)
        fourth = [_row(pool, q1, run, 2, 6), _row(pool, q3, run, 4, 7)]
        assert await _insert(db, fourth, hot=True) == 2
        assert await _tally(db, pool) == {run: (5, 27), 0: (2, 18)}
        # nothing stored, nothing counted
        assert await _insert(db, first, hot=True) == 0
        assert await _tally(db, pool) == {run: (5, 27), 0: (2, 18)}
        async with db.sessions() as session:
            assert [d for d in await repo.tally_drift(session) if d.tally == "trajectory_tally"] == []
    finally:
        await db.close()


def test_sqlite_counts_no_trajectory_insert_in_a_row_trigger(tmp_path: Path) -> None:
    """The trigger cost ~4 us per stored row (~0.3 ms of an ingest's 85, ~1.3 ms of a commit's 340,
    in `bench/`): the insert counts its rows once per cell. Deletes keep their trigger (a cascade
    from a question or a pool deletes rows no statement of the service names)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    dbmod.upgrade(url)
    with sqlite3.connect(tmp_path / "pool.db") as conn:
        names = {r[0] for r in conn.execute(TRAJECTORY_TRIGGERS)}
    assert names == {"trajectory_tally_delete", "trajectory_tally_update"}


def _stored_under_the_trigger(path: Path, pool: int, run: int, qid: int, tokens: int, key: int) -> None:
    """A row stored as the service before migration 0013 stored it: counted by the trigger."""
    with sqlite3.connect(path) as conn:
        assert "trajectory_tally_insert" in {r[0] for r in conn.execute(TRAJECTORY_TRIGGERS)}
        conn.execute(
            "INSERT INTO trajectory (question_id, pool_id, scope, source_run_id, policy_version, step, "
            "token_ids, logprobs, num_tokens, reward, dedup_key, created_at) "
            "VALUES (?, ?, ?, ?, 1, 2, x'00', x'00', ?, 1.0, ?, '2026-01-01')",
            (qid, pool, -pool, run, tokens, bytes([key]) * 32),
        )


async def test_sqlite_migration_0013_keeps_the_counts_both_ways(tmp_path: Path) -> None:
    """Rows stored under the trigger (0012) and by the insert (0013) are counted once each, and a
    downgrade brings the trigger back for what is stored then."""
    path = tmp_path / "pool.db"
    url = f"sqlite+aiosqlite:///{path}"
    pool, run, (q1, q2, q3, q4) = await _pool(Backend("sqlite", url, None, "unused"))
    cfg = dbmod.alembic_config(url)
    db = Database(url, sqlite_inline=True)
    try:
        await asyncio.to_thread(command.downgrade, cfg, "0012")
        _stored_under_the_trigger(path, pool, run, q1, 3, 1)
        await asyncio.to_thread(command.upgrade, cfg, "head")
        assert await _insert(db, [_row(pool, q2, run, 5, 2)], hot=True) == 1
        assert await _tally(db, pool) == {run: (2, 8)}
        await asyncio.to_thread(command.downgrade, cfg, "0012")
        _stored_under_the_trigger(path, pool, run, q3, 7, 3)
        await asyncio.to_thread(command.upgrade, cfg, "head")
        assert await _insert(db, [_row(pool, q4, None, 9, 4)], hot=False) == 1
        assert await _tally(db, pool) == {run: (3, 15), 0: (1, 9)}
        async with db.sessions() as session:
            assert await repo.tally_drift(session) == []
    finally:
        await db.close()
