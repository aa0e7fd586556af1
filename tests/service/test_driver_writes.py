"""The hot path's driver statements (`store/repo.py`): what its writes store, read back through
the mapped classes, on both backends; its reads on SQLite's inline driver, taken from `sqlite3`
itself."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert, select, text
from sqlalchemy.exc import IntegrityError, OperationalError

from exgrpo_pool.store import repo
from exgrpo_pool.store.db import Database
from exgrpo_pool.store.models import IdempotencyKey, Question, RunQuestion

from .factories import setup_pool
from .harness import ADMIN_TOKEN, Backend, serve_app

AT = datetime(2026, 3, 4, 5, 6, 7, 891011, tzinfo=UTC)


async def _pool_and_questions(backend: Backend) -> tuple[int, list[int]]:
    async with serve_app(backend.settings(), ADMIN_TOKEN) as (app, client):
        await setup_pool(client, questions=4)
        db: Database = app.state.ctx.db
        async with db.transaction() as session:
            rows = (await session.execute(select(Question.pool_id, Question.id).order_by(Question.id))).all()
    return int(rows[0][0]), [int(r[1]) for r in rows]


def _state(scope: int, qid: int, pool: int, **values: Any) -> dict[str, Any]:
    row = {
        "scope": scope,
        "question_id": qid,
        "pool_id": pool,
        "last_k": 1,
        "bucket": None,
        "retired": False,
        "last_step": 1,
        "last_run_id": None,
        "updated_at": AT,
    }
    return {**row, **values}


async def _states(db: Database, scope: int) -> dict[int, tuple[Any, ...]]:
    async with db.transaction() as session:
        rows = await session.execute(select(RunQuestion).where(RunQuestion.scope == scope))
        return {
            s.question_id: (s.last_k, s.bucket, s.retired, s.last_step, s.updated_at) for s in rows.scalars()
        }


async def test_decided_states_upsert_in_order_and_a_retired_question_stays_retired(backend: Backend) -> None:
    pool, (q1, q2, q3, q4) = await _pool_and_questions(backend)
    scope = -pool - 1000  # a scope of its own: no run's states in it
    later = AT + timedelta(seconds=5)
    db = Database(backend.database_url)
    try:
        async with db.transaction() as session:
            await repo.upsert_decided_states(
                session,
                [
                    _state(scope, q1, pool, last_k=2, bucket=2),
                    _state(scope, q2, pool, last_k=4, retired=True),
                    _state(scope, q3, pool, last_k=1, bucket=1),
                ],
            )
        assert await _states(db, scope) == {
            q1: (2, 2, False, 1, AT),
            q2: (4, None, True, 1, AT),
            q3: (1, 1, False, 1, AT),
        }
        async with db.transaction() as session:
            # stored as SQLAlchemy stores it (SQLite keeps text: a comparison or an ORDER BY of a
            # timestamp column compares the text)
            await session.execute(insert(RunQuestion).values(_state(scope, q4, pool)))
            raw = "SELECT DISTINCT updated_at FROM run_question WHERE scope = :s"
            assert len((await session.execute(text(raw), {"s": scope})).all()) == 1
        async with db.transaction() as session:
            await repo.upsert_decided_states(
                session,
                [
                    # no bucket: the stored one stays; a retired question never comes back
                    _state(scope, q1, pool, last_k=0, last_step=2, updated_at=later),
                    _state(scope, q2, pool, last_k=3, bucket=3, last_step=2, updated_at=later),
                    # the same question twice in one call: the rows apply in their order
                    _state(scope, q3, pool, last_k=3, bucket=3, last_step=2, updated_at=later),
                    _state(scope, q3, pool, last_k=4, retired=True, last_step=3, updated_at=later),
                ],
            )
        assert await _states(db, scope) == {
            q1: (0, 2, False, 2, later),
            q2: (3, None, True, 2, later),
            q3: (4, None, True, 3, later),
            q4: (1, None, False, 1, AT),
        }
    finally:
        await db.close()


async def test_an_idempotency_record_reads_back_and_a_second_one_of_its_key_is_refused(
    backend: Backend,
) -> None:
    await _pool_and_questions(backend)  # the schema
    db = Database(backend.database_url)
    values = {
        "key": "k-1",
        "principal": "someone",
        "route": "POST /v1/pools/p1/runs/r1/batches",
        "request_hash": "",
        "status_code": 201,
        "response": {"a": [1, 2.5, None, "x"]},
        "created_at": AT,
    }
    try:
        async with db.transaction() as session:
            await repo.record_idempotent(session, values)
        async with db.transaction() as session:
            got = await repo.get_idempotent(session, "k-1", "someone")
            assert got is not None
            assert {c: getattr(got, c) for c in values} == values
        with pytest.raises(IntegrityError):
            async with db.transaction() as session:
                await repo.record_idempotent(session, {**values, "route": "POST /elsewhere"})
        async with db.transaction() as session:
            rows = (await session.execute(select(IdempotencyKey.route))).scalars().all()
        assert rows == [values["route"]]
    finally:
        await db.close()


async def test_inline_sqlite_reads_come_from_sqlite3_and_fail_with_sqlalchemys_errors(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    pool, qids = await _pool_and_questions(Backend("sqlite", url, None, "unused"))
    db = Database(url, sqlite_inline=True)
    assert db.hot_engine is not None
    executed: list[str] = []
    event.listen(db.hot_engine.sync_engine, "before_cursor_execute", lambda *a: executed.append(a[2]))
    try:
        async with db.hot_sessions() as hot, db.sessions() as thread:
            got = await repo.question_prompts(hot, qids)
            assert await repo.questions_in_pool(hot, pool, [*qids, 10**9]) == set(qids)
            assert executed == [], "not through SQLAlchemy's execution"
            assert got == await repo.question_prompts(thread, qids) and sorted(got) == qids
            await (await thread.connection()).exec_driver_sql("ALTER TABLE run_question RENAME TO gone")
            await thread.commit()
            with pytest.raises(OperationalError, match="no such table: run_question"):
                await repo.get_states(hot, 1, qids)
    finally:
        await db.close()
