"""The hot path's driver statements (`store/repo.py`): what its writes store, read back through
the mapped classes, on both backends; its reads on SQLite's inline driver, taken from `sqlite3`
itself."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from exgrpo_pool.store import pg_direct, repo
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


async def _raw(db: Database, sql: str) -> list[tuple[Any, ...]]:
    async with db.sessions() as session:
        return [tuple(r) for r in (await (await session.connection()).exec_driver_sql(sql)).all()]


async def _hot_writes(session: Any, name: str) -> int:
    """The hot path's Core writes for run `name` (its batch, metrics and idempotency record named
    after it); the run's id."""
    found = await repo.run_rows(session, "p1", name, lock=True, lease=True)
    assert found is not None and found[2] is not None
    run_id: int = found[1].id
    await repo.update_run(session, run_id, {"epoch": 3, "cursor": 7, "updated_at": AT})
    await repo.extend_lease(session, run_id, AT + timedelta(hours=1))
    batch = repo.BatchRow(
        f"b-{name}", run_id, 4, "planned", "mixed", 2, {"fresh": [1, 2], "x": None}, None, AT
    )
    await repo.insert_batch(session, batch)
    await repo.update_batch(session, batch.id, {"result": {"n": 1.5}, "committed_at": AT})
    await repo.merge_run_metrics(session, run_id, 4, {"loss": 0.25})
    await repo.merge_run_metrics(session, run_id, 4, {"reward": 0.5})
    await repo.record_idempotent(
        session,
        {
            "key": name,
            "principal": "p",
            "route": "r",
            "request_hash": "",
            "status_code": 201,
            "response": None,
            "created_at": AT,
        },
    )
    await repo.complete_idempotent(session, name, "p", {"ok": [1, None]}, "h")
    return run_id


async def _stored_alike(db: Database, ids: dict[str, int], metric_more: str) -> None:
    """Runs r1 and r2 have the same rows where the hot path wrote them (`metric_more`: more
    columns of their metrics)."""
    stored = {
        "run": "SELECT epoch, cursor, updated_at, step, phase FROM run WHERE id = {}",
        "run_lease": "SELECT holder, expires_at, generation FROM run_lease WHERE run_id = {}",
        "batch": "SELECT step, status, phase, policy_version, plan, result, created_at, committed_at "
        "FROM batch WHERE run_id = {}",
        "run_metric": f"SELECT step, metrics{metric_more} FROM run_metric WHERE run_id = {{}}",
    }
    for table, sql in stored.items():
        one, two = [await _raw(db, sql.format(ids[n])) for n in ("r1", "r2")]
        assert one == two and one, (table, one, two)


async def _hot_reads(s: Any, name: str, run_id: int, lock: bool) -> list[Any]:
    """The hot path's Core reads of run `name` through session `s`: its run, batch, open batch
    and lease rows."""
    run = await repo.run_rows(s, "p1", name, lock=lock, lease=True)
    batch = await repo.batch_rows(s, "p1", f"b-{name}", lock=lock)
    assert run is not None and batch is not None
    assert batch[2].plan == {"fresh": [1, 2], "x": None}
    assert batch[2].created_at == AT and batch[1].updated_at == AT
    opened = await repo.open_batch(s, run_id, 4)
    assert opened == batch[2]
    assert await repo.open_batch(s, run_id, 5) is None
    lease = await repo.get_lease_row(s, run_id)
    assert lease is not None and lease.expires_at == AT + timedelta(hours=1)
    return [run, batch, opened, lease]


async def test_inline_sqlite_core_statements_read_and_write_what_sqlalchemy_does(tmp_path: Path) -> None:
    """The hot path's Core statements, compiled once and run on `sqlite3` by the inline driver:
    each read gives the values SQLAlchemy gives, and each write stores the same text, written
    once through either (two runs and their batches alike but for their names)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    async with serve_app(Backend("sqlite", url, None, "unused").settings(), ADMIN_TOKEN) as (_app, client):
        await setup_pool(client, questions=4, runs=("r1", "r2"))
        for run in ("r1", "r2"):
            r = await client.put(f"/v1/pools/p1/runs/{run}/lease", json={"holder": "t", "ttl_s": 600})
            assert r.status_code == 200, r.text
    db = Database(url, sqlite_inline=True)
    assert db.hot_engine is not None
    executed: list[str] = []
    event.listen(db.hot_engine.sync_engine, "before_cursor_execute", lambda *a: executed.append(a[2]))
    try:
        ids: dict[str, int] = {}
        for name, sessions in (("r1", db.hot_sessions), ("r2", db.sessions)):
            async with sessions() as session, session.begin():
                ids[name] = await _hot_writes(session, name)
        assert executed == [], "the inline driver's statements do not pass through SQLAlchemy"
        await _stored_alike(db, ids, ", length(updated_at)")
        keys = await _raw(db, "SELECT status_code, response, request_hash, created_at FROM idempotency_key")
        assert keys == [(201, '{"ok": [1, null]}', "h", str(AT.replace(tzinfo=None)))] * 2
        # and read back: each read through the inline driver gives what SQLAlchemy's gives
        for lock in (False, True):
            for name in ("r1", "r2"):
                async with db.hot_sessions() as hot:
                    inline = await _hot_reads(hot, name, ids[name], lock)
                async with db.sessions() as thread:
                    assert await _hot_reads(thread, name, ids[name], lock) == inline
        assert executed == []
    finally:
        await db.close()


@pytest.mark.parametrize(
    "backend",
    [pytest.param("postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis])],
    indirect=True,
)
async def test_postgres_core_statements_on_asyncpg_read_and_write_what_sqlalchemy_does(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path's Core statements, compiled once and run on asyncpg (`pg_direct`): each read
    gives the values SQLAlchemy gives, and each write stores the same values, written once through
    either (run r1's on asyncpg, r2's through SQLAlchemy, the adapter hidden)."""
    async with serve_app(backend.settings(), ADMIN_TOKEN) as (_app, client):
        await setup_pool(client, questions=4, runs=("r1", "r2"))
        for run in ("r1", "r2"):
            r = await client.put(f"/v1/pools/p1/runs/{run}/lease", json={"holder": "t", "ttl_s": 600})
            assert r.status_code == 200, r.text
    db = Database(backend.database_url)
    direct: list[str] = []
    fetch_all, execute = pg_direct.fetch_all, pg_direct.execute

    async def counted_fetch(adapt: Any, sql: str, *args: Any) -> Any:
        direct.append(sql)
        return await fetch_all(adapt, sql, *args)

    async def counted_execute(adapt: Any, sql: str, *args: Any, **kw: Any) -> Any:
        direct.append(sql)
        return await execute(adapt, sql, *args, **kw)

    monkeypatch.setattr(pg_direct, "fetch_all", counted_fetch)
    monkeypatch.setattr(pg_direct, "execute", counted_execute)
    adapter = pg_direct.adapter
    try:
        ids: dict[str, int] = {}
        for name, hidden in (("r1", False), ("r2", True)):
            monkeypatch.setattr(pg_direct, "adapter", (lambda _c: None) if hidden else adapter)
            direct.clear()
            async with db.sessions() as session, session.begin():
                ids[name] = await _hot_writes(session, name)
            # every one of them on asyncpg (the lease's float column read as the driver gives it),
            # or none
            assert len(direct) == (0 if hidden else 10), direct
        await _stored_alike(db, ids, "")
        keys = await _raw(db, "SELECT status_code, response, request_hash, created_at FROM idempotency_key")
        assert keys == [(201, {"ok": [1, None]}, "h", AT)] * 2
        for lock in (False, True):
            for name in ("r1", "r2"):
                # one after the other: with `lock` the first holds its rows until it ends
                monkeypatch.setattr(pg_direct, "adapter", adapter)
                direct.clear()
                async with db.sessions() as a, a.begin():
                    on_asyncpg = await _hot_reads(a, name, ids[name], lock)
                assert direct, "the reads ran on asyncpg"
                monkeypatch.setattr(pg_direct, "adapter", lambda _c: None)
                direct.clear()
                async with db.sessions() as b, b.begin():
                    assert await _hot_reads(b, name, ids[name], lock) == on_asyncpg
                assert direct == []
    finally:
        await db.close()


async def test_trajectories_stored_by_the_inline_driver_are_blobs_read_back_as_sent(tmp_path: Path) -> None:
    """The payload columns go to `sqlite3` as the bytes they are: stored as BLOBs, as SQLAlchemy
    stores them, and read back unchanged by either path."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    pool, qids = await _pool_and_questions(Backend("sqlite", url, None, "unused"))
    db = Database(url, sqlite_inline=True)

    def row(qid: int, n: int) -> dict[str, Any]:
        ids = bytes(range(n)) * 4
        return {
            "question_id": qid,
            "pool_id": pool,
            "scope": -pool,
            "source_run_id": None,
            "policy_version": 1,
            "step": 2,
            "token_ids": ids,
            "logprobs": b"\x00\x00\x80\xbf" * n,
            "num_tokens": n,
            "reward": 1.0,
            "entropy": 0.5,
            "dedup_key": bytes([n]) * 16,
            "text": None,
            "created_at": AT,
        }

    sent = [row(qids[0], 3), row(qids[1], 5)]
    try:
        async with db.hot_sessions() as hot, hot.begin():
            assert await repo.insert_trajectories(hot, sent[:1]) == 1
        async with db.sessions() as thread, thread.begin():
            assert await repo.insert_trajectories(thread, sent[1:]) == 1
        sql = "SELECT typeof(token_ids), typeof(logprobs), typeof(dedup_key) FROM trajectory"
        types = await _raw(db, sql)
        assert types == [("blob", "blob", "blob")] * 2
        for sessions in (db.hot_sessions, db.sessions):
            async with sessions() as session:
                got = await repo.trajectories_of(session, qids[:2], scope=-pool)
                for r in sent:
                    (one,) = got[r["question_id"]]
                    assert (one.token_ids, one.logprobs) == (r["token_ids"], r["logprobs"])
                    assert one.created_at == AT
    finally:
        await db.close()


async def test_a_sessions_connection_is_kept_for_its_transaction_only(tmp_path: Path) -> None:
    """The hot path asks its session for the connection once per transaction; after a commit
    the session's next transaction gets its own."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    _pool, qids = await _pool_and_questions(Backend("sqlite", url, None, "unused"))
    db = Database(url)
    try:
        async with db.sessions() as session:
            first = await repo.question_prompts(session, qids)
            held = session.info["exgrpo_connection"]
            await repo.get_states(session, 1, qids)
            assert session.info["exgrpo_connection"] is held
            await session.commit()
            assert held[1].closed
            assert await repo.question_prompts(session, qids) == first
            again = session.info["exgrpo_connection"]
            assert again is not held and not again[1].closed
    finally:
        await db.close()


#: JSON texts as `json.loads` reads them, each stored in a question's prompt column; pydantic-core's
#: parser reads the first three itself, a lone surrogate (SQLite only) only `json.loads` reads
_JSON_TEXTS = [
    '[{"role": "user", "content": "\\u00e9 \\ud83d\\ude00 \\"q\\""}]',
    '{"n": 123456789012345678901234567890, "x": [1.5, -0.0, 1e300, null, true]}',
    '{"a": 1, "b": {"c": []}}',
]
_SQLITE_ONLY = ['[NaN, -Infinity, "\\ud800"]']


def _same_json(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_json(a[k], b[k]) for k in a)
    return bool(a == b)


async def test_json_columns_are_read_as_json_loads_reads_them_by_the_faster_parser(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JSON column (a prompt here) reads back as `json.loads` reads its text, through every
    engine and driver, and `json.loads` itself runs only for a text pydantic-core's parser refuses."""
    import json

    _pool, qids = await _pool_and_questions(backend)
    sqlite = backend.database_url.startswith("sqlite")
    texts = _JSON_TEXTS + (_SQLITE_ONLY if sqlite else [])
    calls: list[str] = []
    loads = json.loads

    def counted(raw: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(raw)
        return loads(raw, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counted)
    db = Database(backend.database_url, sqlite_inline=sqlite)
    try:
        cast = "" if sqlite else "CAST(:p AS JSONB)"
        async with db.transaction() as session:
            for qid, doc in zip(qids, texts, strict=False):
                await session.execute(
                    text(f"UPDATE question SET prompt = {cast or ':p'} WHERE id = :id"), {"p": doc, "id": qid}
                )
            # the text as stored (Postgres's JSONB writes numbers its own way: 1e300 in full)
            stored = await session.execute(
                text(f"SELECT id, {'prompt' if sqlite else 'CAST(prompt AS TEXT)'} FROM question")
            )
            expected = {int(qid): loads(doc) for qid, doc in stored.all()}
        makers = (db.hot_sessions, db.sessions) if sqlite else (db.sessions,)
        for sessions in makers:
            calls.clear()
            async with sessions() as session:
                got = await repo.question_prompts(session, list(expected))
                mapped = {q.id: q.prompt for q in (await session.execute(select(Question))).scalars()}
            for qid, value in expected.items():
                assert _same_json(got[qid]["prompt"], value), (got[qid]["prompt"], value)
                assert _same_json(mapped[qid], value), (mapped[qid], value)
            # twice each (the driver read and the mapped read) the lone surrogate, nothing else
            assert len(calls) == (2 if sqlite else 0), calls
    finally:
        await db.close()


async def test_a_driver_statement_is_part_of_its_sessions_transaction(backend: Backend) -> None:
    """A driver write (the idempotency record; on Postgres run on asyncpg itself, `pg_direct`) is
    undone with its session's transaction, and kept with its commit, as the statements SQLAlchemy
    runs in that transaction are."""
    _pool, qids = await _pool_and_questions(backend)
    db = Database(backend.database_url, sqlite_inline=backend.database_url.startswith("sqlite"))
    values = {
        "key": "k-tx",
        "principal": "someone",
        "route": "POST /x",
        "request_hash": "",
        "status_code": 200,
        "response": {},
        "created_at": AT,
    }
    try:
        for sessions in {db.hot_sessions, db.sessions}:
            async with sessions() as session:
                # the driver statement first: it begins the transaction where none is open
                await repo.record_idempotent(session, values)
                await session.execute(text("UPDATE question SET data_source = 'changed'"))
                assert await repo.get_idempotent(session, "k-tx", "someone") is not None
                await session.rollback()
            async with db.transaction() as session:
                assert await repo.get_idempotent(session, "k-tx", "someone") is None
                sources = (await session.execute(select(Question.data_source))).scalars().all()
                assert "changed" not in sources and len(sources) == len(qids)
        async with db.hot_sessions() as session:
            await repo.record_idempotent(session, values)
            await session.commit()
        async with db.transaction() as session:
            assert await repo.get_idempotent(session, "k-tx", "someone") is not None
    finally:
        await db.close()


@pytest.mark.parametrize(
    "backend",
    [pytest.param("postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis])],
    indirect=True,
)
async def test_a_driver_statement_on_a_lost_connection_fails_as_sqlalchemys_do(backend: Backend) -> None:
    """A driver read on asyncpg itself whose connection the server closed raises SQLAlchemy's
    DBAPIError with `connection_invalidated` (what the service answers 503 for), and the pool
    gives a working connection afterwards."""
    import asyncpg

    from exgrpo_pool.app import database_unavailable

    _pool, qids = await _pool_and_questions(backend)
    db = Database(backend.database_url)
    try:
        async with db.sessions() as session:
            first = await repo.question_prompts(session, qids)
            pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            other = await asyncpg.connect(
                backend.database_url.replace("postgresql+asyncpg://", "postgresql://")
            )
            try:
                await other.execute("SELECT pg_terminate_backend($1)", pid)
            finally:
                await other.close()
            with pytest.raises(DBAPIError) as failed:
                await repo.question_prompts(session, qids)
            assert failed.value.connection_invalidated, repr(failed.value)
            assert database_unavailable(failed.value)
        async with db.sessions() as session:
            assert await repo.question_prompts(session, qids) == first
    finally:
        await db.close()


async def test_a_replays_picked_states_are_what_the_three_reads_they_replace_give(backend: Backend) -> None:
    """`repo.picked_states` reads in one statement what `get_states`, `questions_with_trajectories`
    and `question_prompts` read in three: for picks with and without a state row, retired or not,
    with trajectories stored in the scope asked, in another or none, before and after a step."""
    pool, (q1, q2, q3, q4) = await _pool_and_questions(backend)
    scope, stored_in, elsewhere = -pool - 2000, -pool - 2001, -pool - 2002
    db = Database(backend.database_url)

    def trajectory(qid: int, in_scope: int, step: int, key: int) -> dict[str, Any]:
        return {
            "question_id": qid,
            "pool_id": pool,
            "scope": in_scope,
            "source_run_id": None,
            "policy_version": 1,
            "step": step,
            "token_ids": b"\x01\x00\x00\x00",
            "logprobs": b"\x00\x00\x80\xbf",
            "num_tokens": 1,
            "reward": 1.0,
            "entropy": 0.5,
            "dedup_key": bytes([key]) * 16,
            "text": None,
            "created_at": AT,
        }

    try:
        async with db.transaction() as session:
            await repo.upsert_decided_states(
                session,
                [
                    _state(scope, q1, pool, bucket=2),
                    _state(scope, q2, pool, retired=True),
                    _state(scope, q3, pool, bucket=1),
                    _state(elsewhere, q4, pool, bucket=3),  # a state of q4, in another scope only
                ],
            )
            rows = [
                trajectory(q1, stored_in, 2, 1),
                trajectory(q1, stored_in, 7, 2),
                trajectory(q2, stored_in, 5, 3),
                trajectory(q3, elsewhere, 9, 4),  # stored, but not in the scope asked
                trajectory(q4, stored_in, 9, 5),  # stored, but no state in `scope`
            ]
            assert await repo.insert_trajectories(session, rows) == len(rows)
        picks = [q3, q1, q4, q2, q1, 10**9]  # a question twice, one that does not exist
        seen: dict[tuple[int, int | None, bool], dict[int, repo.PickedState]] = {}
        for where in (stored_in, elsewhere):
            for min_step in (None, 3, 8):
                for prompts in (False, True):
                    async with db.transaction() as session:
                        got = await repo.picked_states(
                            session, scope, picks, stored_in=where, min_step=min_step, prompts=prompts
                        )
                        states = await repo.get_states(session, scope, picks)
                        stored = await repo.questions_with_trajectories(
                            session, picks, scope=where, min_step=min_step
                        )
                        questions = await repo.question_prompts(session, picks)
                    want = {
                        qid: (bucket, retired, qid in stored, questions[qid] if prompts else None)
                        for qid, (bucket, retired) in states.items()
                    }
                    assert got == want, (where, min_step, prompts)
                    seen[where, min_step, prompts] = got
        assert len(seen) == 12
        # what the cases hold: the three states of `scope` (not q4's), each stored or not as asked
        stored_flags = {key[:2]: {qid: v[2] for qid, v in got.items()} for key, got in seen.items() if key[2]}
        assert stored_flags[stored_in, None] == {q1: True, q2: True, q3: False}
        assert stored_flags[stored_in, 3] == {q1: True, q2: True, q3: False}
        assert stored_flags[stored_in, 8] == {q1: False, q2: False, q3: False}
        assert stored_flags[elsewhere, None] == {q1: False, q2: False, q3: True}
        first = seen[stored_in, None, True]
        assert first[q1][:2] == (2, False) and first[q2][:2] == (None, True) and first[q3][:2] == (1, False)
        assert first[q1][3] is not None and first[q1][3]["question_id"] == q1
        assert all(v[3] is None for v in seen[stored_in, None, False].values())
    finally:
        await db.close()
