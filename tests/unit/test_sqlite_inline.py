"""SQLite called from the event loop (`sqlite_driver = "inline"`) on the hot path: statements of
`Database.hot()` run on the loop's thread, everything else on aiosqlite's threads, and a statement
that finds the file locked waits on the loop, so the connection holding the lock can finish."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings
from exgrpo_pool.store import repo, sqlite_inline
from exgrpo_pool.store.db import WARM_READS, Database


def _url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"


async def _thread_of_a_statement(db: Database, *, hot: bool = True) -> int:
    """The thread that ran a statement, on the hot path or off it: a SQL function records it."""
    seen: list[int] = []
    with db.hot() if hot else contextlib.nullcontext():
        return await _thread_of(db, seen)


async def _thread_of(db: Database, seen: list[int]) -> int:
    async with db.read() as session:
        raw = await (await session.connection()).get_raw_connection()
        driver = raw.driver_connection
        assert driver is not None
        # aiosqlite's connection and the inline one both have an awaitable create_function
        await driver.create_function("whoami", 0, lambda: seen.append(threading.get_ident()) or 1)
        assert (await session.execute(text("SELECT whoami()"))).scalar_one() == 1
    return seen[0]


@pytest.mark.parametrize("inline", [True, False], ids=["inline: the loop's thread", "thread: another thread"])
async def test_where_a_statement_runs(tmp_path: Path, inline: bool) -> None:
    db = Database(_url(tmp_path), sqlite_inline=inline)
    try:
        ran_on = await _thread_of_a_statement(db)
        off_the_hot_path = await _thread_of_a_statement(db, hot=False)
        with db.hot():
            async with db.read() as session:
                busy_timeout = (await session.execute(text("PRAGMA busy_timeout"))).scalar_one()
    finally:
        await db.close()
    assert (ran_on == threading.get_ident()) is inline
    # reads and writes that may take long (stats, exports, imports) never hold up the loop
    assert off_the_hot_path != threading.get_ident()
    # SQLite's own busy wait would hold up the loop: inline connections wait on the loop instead
    assert busy_timeout == (0 if inline else 30000)


async def test_a_file_written_by_several_processes_runs_its_hot_path_on_the_loop(tmp_path: Path) -> None:
    db = Database(_url(tmp_path), sqlite_inline=True, shared_file=True)
    try:
        assert await _thread_of_a_statement(db) == threading.get_ident()
        assert await _thread_of_a_statement(db, hot=False) != threading.get_ident()
    finally:
        await db.close()


async def test_processes_on_one_file_take_turns_on_the_loop_and_lose_no_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `Database`s on one file stand for two processes (`exgrpo serve --workers 2`): each write
    block reads a counter, gives the loop away while it holds SQLite's write lock, and writes the
    counter plus one. The other's BEGIN IMMEDIATE finds the file locked and waits on the loop (a
    wait inside SQLite would hold up the loop, and with it the holder: no block could finish)."""
    url = _url(tmp_path)
    first, second = (Database(url, sqlite_inline=True, shared_file=True) for _ in range(2))
    waits: list[int] = []
    busy = sqlite_inline._busy

    def counted(error: sqlite3.OperationalError) -> bool:
        waits.append(1)
        return busy(error)

    async def increment(db: Database) -> None:
        with db.hot():
            async with db.write() as session:
                n = (await session.execute(text("SELECT n FROM counter"))).scalar_one()
                await asyncio.sleep(0.01)  # the other process tries meanwhile
                await session.execute(text("UPDATE counter SET n = :n"), {"n": n + 1})

    try:
        async with first.write() as session:
            await session.execute(text("CREATE TABLE counter (n INTEGER NOT NULL)"))
            await session.execute(text("INSERT INTO counter VALUES (0)"))
        monkeypatch.setattr(sqlite_inline, "_busy", counted)
        await asyncio.gather(*(increment(db) for _ in range(5) for db in (first, second)))
        async with second.read() as session:
            assert (await session.execute(text("SELECT n FROM counter"))).scalar_one() == 10
        assert waits  # the file was found locked by the other, and waited for on the loop
    finally:
        await first.close()
        await second.close()


async def _hold_the_write_lock(db: Database, holding: asyncio.Event, release: asyncio.Event) -> None:
    with db.hot():
        await _hold(db, holding, release)


async def _hold(db: Database, holding: asyncio.Event, release: asyncio.Event) -> None:
    async with db.write() as session:
        await session.execute(text("INSERT INTO t (v) VALUES ('first')"))
        holding.set()
        await release.wait()


async def test_a_locked_write_waits_on_the_loop_for_the_holder(tmp_path: Path) -> None:
    """Two `Database`s on one file (each serialises only its own writes): the second write finds
    the file locked while the first holds it across an await. It must wait without holding up the
    loop, or the first could never commit (with a busy timeout inside SQLite both would hang for
    30 s and the second fail with "database is locked")."""
    first, second = Database(_url(tmp_path), sqlite_inline=True), Database(_url(tmp_path), sqlite_inline=True)
    try:
        async with first.write() as session:
            await session.execute(text("CREATE TABLE t (v TEXT)"))
        holding, release = asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(_hold_the_write_lock(first, holding, release))
        await holding.wait()

        async def second_write() -> None:
            with second.hot():
                async with second.write() as session:
                    await session.execute(text("INSERT INTO t (v) VALUES ('second')"))

        waiter = asyncio.create_task(second_write())
        ticks = 0
        for _ in range(5):  # the loop runs while the second write waits
            await asyncio.sleep(0.02)
            ticks += 1
        assert not waiter.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, waiter), timeout=10)
        assert ticks == 5
        async with second.read() as session:
            rows = (await session.execute(text("SELECT v FROM t ORDER BY rowid"))).scalars().all()
        assert rows == ["first", "second"]
    finally:
        await first.close()
        await second.close()


async def test_a_lock_held_too_long_fails_as_sqlite_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_inline, "BUSY_WAIT_S", 0.2)
    db = Database(_url(tmp_path), sqlite_inline=True)
    other = None
    try:
        async with db.write() as session:
            await session.execute(text("CREATE TABLE t (v TEXT)"))
        other = sqlite3.connect(tmp_path / "pool.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(Exception, match="database is locked"), db.hot():
            async with db.write() as session:
                await session.execute(text("INSERT INTO t (v) VALUES ('x')"))
        other.execute("ROLLBACK")
        async with db.write() as session:  # nothing was lost, nothing half-written
            await session.execute(text("INSERT INTO t (v) VALUES ('y')"))
        async with db.read() as session:
            assert (await session.execute(text("SELECT v FROM t"))).scalars().all() == ["y"]
    finally:
        if other is not None:
            other.close()
        await db.close()


def test_the_driver_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(allow_anonymous=True).sqlite_driver in ("thread", "inline")
    monkeypatch.setenv("EXGRPO_SQLITE_DRIVER", "inline")
    assert Settings(allow_anonymous=True).sqlite_driver == "inline"
    monkeypatch.setenv("EXGRPO_SQLITE_DRIVER", "threads")
    with pytest.raises(ValidationError, match="sqlite_driver"):
        Settings(allow_anonymous=True)


@pytest.mark.parametrize("driver", ["inline", "thread"])
async def test_the_service_takes_the_setting(tmp_path: Path, driver: str) -> None:
    settings = Settings(database_url=_url(tmp_path), allow_anonymous=True, sqlite_driver=driver)  # type: ignore[arg-type]
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        ran_on = await _thread_of_a_statement(app.state.ctx.db)
    assert (ran_on == threading.get_ident()) is (driver == "inline")


async def _counter_table(db: Database) -> None:
    async with db.write() as session:
        await session.execute(text("CREATE TABLE counter (n INTEGER NOT NULL)"))
        await session.execute(text("INSERT INTO counter VALUES (0)"))


async def test_a_hot_session_is_closed_without_a_task_of_its_own(tmp_path: Path) -> None:
    """SQLAlchemy's `async with` closes a session in a task shielded from cancellation (two more
    turns of the loop per request); an inline session's close never waits, and is awaited
    directly. The connection is back in the pool all the same."""
    db = Database(_url(tmp_path), sqlite_inline=True)
    started: list[str] = []
    loop = asyncio.get_running_loop()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        started.append(getattr(coro, "__qualname__", repr(coro)))
        return asyncio.Task(coro, loop=loop, **kw)

    try:
        await _counter_table(db)
        await db.settle()
        assert db.hot_engine is not None
        pool = db.hot_engine.sync_engine.pool
        loop.set_task_factory(factory)
        with db.hot():
            async with db.read() as session:
                assert (await session.execute(text("SELECT n FROM counter"))).scalar_one() == 0
            async with db.write() as session:
                await session.execute(text("UPDATE counter SET n = n + 1"))
        loop.set_task_factory(None)
        # the write's background WAL checkpoint is its only task
        assert [name for name in started if "checkpoint" not in name] == []
        # the read's connection is back in the pool; the write's is kept for the next write
        assert pool.checkedout() == 1  # type: ignore[attr-defined]
        assert db._writer is not None
        with db.hot():
            async with db.read() as session:
                assert (await session.execute(text("SELECT n FROM counter"))).scalar_one() == 1
    finally:
        loop.set_task_factory(None)
        await db.close()


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
async def test_a_cancelled_hot_request_gives_its_connection_back(tmp_path: Path, write: bool) -> None:
    """A request cancelled inside its session (a client gone, a shutdown) leaves no connection
    checked out and, for a write, nothing written; the next requests run."""
    db = Database(_url(tmp_path), sqlite_inline=True)
    inside = asyncio.Event()

    async def request() -> None:
        with db.hot():
            async with db.write() if write else db.read() as session:
                await session.execute(text("UPDATE counter SET n = 7" if write else "SELECT n FROM counter"))
                inside.set()
                await asyncio.sleep(30)

    try:
        await _counter_table(db)
        task = asyncio.create_task(request())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert db.hot_engine is not None
        assert db.hot_engine.sync_engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        with db.hot():
            async with db.write() as session:
                await session.execute(text("UPDATE counter SET n = n + 1"))
            async with db.read() as session:
                assert (await session.execute(text("SELECT n FROM counter"))).scalar_one() == 1
    finally:
        await db.close()


async def _read_counter(db: Database) -> tuple[AsyncSession, int]:
    """A hot read of the counter through the repo's driver statements (as the hot reads run)."""
    with db.hot():
        async with db.read() as session:
            conn = await repo._connection(session)
            rows = await repo._driver_rows(conn, "SELECT n FROM counter", ())
    return session, int(rows[0][0])


def _raw(session: AsyncSession) -> sqlite3.Connection | None:
    """The `sqlite3` connection a hot session holds, as the repo keeps it."""
    return repo.inline_sqlite(session.info["exgrpo_connection"][1])


def _checked_out(db: Database) -> int:
    assert db.hot_engine is not None
    return int(db.hot_engine.sync_engine.pool.checkedout())  # type: ignore[attr-defined]


async def test_a_hot_read_keeps_its_session_for_the_next_and_sees_every_commit(tmp_path: Path) -> None:
    """A hot read's session and its connection serve the next hot read (no checkout, no close in
    between); it holds no snapshot meanwhile: what a write commits in between is read."""
    db = Database(_url(tmp_path), sqlite_inline=True)
    try:
        await _counter_table(db)
        first, n = await _read_counter(db)
        assert n == 0 and _checked_out(db) == 1
        raw = _raw(first)
        assert raw is not None and not raw.in_transaction and repo.held_idle(first) is True
        again, n = await _read_counter(db)
        assert again is first and _raw(again) is raw and n == 0
        with db.hot():
            async with db.write() as session:
                await session.execute(text("UPDATE counter SET n = n + 1"))
        _, n = await _read_counter(db)
        assert n == 1
        # a write through another connection, off the hot path, is read too
        async with db.write() as session:
            await session.execute(text("UPDATE counter SET n = n + 1"))
        _, n = await _read_counter(db)
        assert n == 2
    finally:
        await db.close()
    assert _checked_out(db) == 0


async def test_a_hot_read_that_fails_or_writes_is_not_kept(tmp_path: Path) -> None:
    """A hot read whose block raised, or that left a transaction open on its connection (a write
    where none belongs), is closed: its connection goes back to the pool, the write is undone."""
    db = Database(_url(tmp_path), sqlite_inline=True)
    try:
        await _counter_table(db)
        with db.hot(), pytest.raises(ZeroDivisionError):
            async with db.read() as session:
                await repo._driver_rows(await repo._connection(session), "SELECT n FROM counter", ())
                _ = 1 / 0
        assert _checked_out(db) == 0
        with db.hot():
            async with db.read() as session:
                conn = await repo._connection(session)
                await repo._driver_write(conn, "UPDATE counter SET n = 9", ())
                raw = _raw(session)
                assert raw is not None and raw.in_transaction and repo.held_idle(session) is False
        assert _checked_out(db) == 0
        _, n = await _read_counter(db)
        assert n == 0
    finally:
        await db.close()


async def test_concurrent_hot_reads_keep_at_most_a_few_sessions(tmp_path: Path) -> None:
    db = Database(_url(tmp_path), sqlite_inline=True)
    gate = asyncio.Event()

    async def read() -> int:
        with db.hot():
            async with db.read() as session:
                rows = await repo._driver_rows(await repo._connection(session), "SELECT n FROM counter", ())
                await gate.wait()
        return int(rows[0][0])

    try:
        await _counter_table(db)
        tasks = [asyncio.create_task(read()) for _ in range(WARM_READS + 4)]
        await asyncio.sleep(0.05)
        assert _checked_out(db) == WARM_READS + 4
        gate.set()
        assert await asyncio.gather(*tasks) == [0] * (WARM_READS + 4)
        assert _checked_out(db) == WARM_READS
    finally:
        await db.close()
    assert _checked_out(db) == 0


async def _hot_write(db: Database, sql: str) -> tuple[AsyncSession, sqlite3.Connection]:
    """A hot write of `sql` through the repo's driver statements (as the hot path writes): its
    session, and the `sqlite3` connection it ran on."""
    with db.hot():
        async with db.write() as session:
            conn = await repo._connection(session)
            await repo._driver_write(conn, sql, ())
            raw = repo.inline_sqlite(conn)
            assert raw is not None and raw.in_transaction
    return session, raw


def _counter_on_disk(tmp_path: Path) -> int:
    """The counter as another connection reads it: what was committed."""
    with contextlib.closing(sqlite3.connect(tmp_path / "pool.db")) as other:
        return int(other.execute("SELECT n FROM counter").fetchone()[0])


async def test_hot_writes_share_one_kept_session_and_connection(tmp_path: Path) -> None:
    """One hot write after another runs in the same session on the same connection, which stays
    checked out in between with no transaction open on it; each write is committed when its block
    ends, and the database's close gives the connection back."""
    db = Database(_url(tmp_path), sqlite_inline=True)
    try:
        await _counter_table(db)
        assert _checked_out(db) == 0
        first, raw = await _hot_write(db, "UPDATE counter SET n = n + 1")
        assert _counter_on_disk(tmp_path) == 1
        assert _checked_out(db) == 1 and db._writer is first
        assert not raw.in_transaction and not first.in_transaction()
        second, raw_again = await _hot_write(db, "UPDATE counter SET n = n + 1")
        assert second is first and raw_again is raw
        assert _counter_on_disk(tmp_path) == 2 and _checked_out(db) == 1
        # a read on the hot path sees both
        _, n = await _read_counter(db)
        assert n == 2
    finally:
        await db.close()
    assert _checked_out(db) == 0 and db._writer is None


async def test_a_hot_write_that_fails_is_undone_and_its_session_not_kept(tmp_path: Path) -> None:
    """A hot write whose block raises is rolled back; its session is closed and its connection
    given back, and the next hot write runs in a new one."""
    db = Database(_url(tmp_path), sqlite_inline=True)
    try:
        await _counter_table(db)
        kept, _ = await _hot_write(db, "UPDATE counter SET n = 5")
        with db.hot(), pytest.raises(ZeroDivisionError):
            async with db.write() as session:
                assert session is kept
                await repo._driver_write(await repo._connection(session), "UPDATE counter SET n = 9", ())
                _ = 1 / 0
        assert _counter_on_disk(tmp_path) == 5
        assert db._writer is None and _checked_out(db) == 0
        after, _ = await _hot_write(db, "UPDATE counter SET n = n + 1")
        assert after is not kept and _counter_on_disk(tmp_path) == 6
    finally:
        await db.close()


async def test_a_hot_writes_orm_objects_are_let_go_when_it_ends(tmp_path: Path) -> None:
    """What a kept write session loaded is not in it at the next write (a close lets it go): the
    next write reads rows again and never an object as the write before left it."""
    from exgrpo_pool.store import db as dbmod
    from exgrpo_pool.store.models import Pool

    url = _url(tmp_path)
    await asyncio.to_thread(dbmod.upgrade, url)
    db = Database(url, sqlite_inline=True)
    try:
        with db.hot():
            async with db.write() as session:
                session.add(Pool(name="p", config={"k": 8}))
            async with db.write() as session:
                pool = (await session.execute(select(Pool))).scalar_one()
                assert pool in session
            assert not session.identity_map and db._writer is session
            async with db.write() as again:
                assert again is session and pool not in again
                assert (await again.execute(select(Pool))).scalar_one() is not pool
    finally:
        await db.close()


async def test_a_write_inside_a_transaction_flushes_what_it_changed_and_only_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `write()` joined to a `transaction()` flushes its ORM changes when its block ends, so an
    error they cause surfaces in that block; a block that changed no ORM object (the hot path's
    driver statements) has nothing to flush and does not ask the session to."""
    from exgrpo_pool.store import db as dbmod
    from exgrpo_pool.store.models import Pool

    url = _url(tmp_path)
    await asyncio.to_thread(dbmod.upgrade, url)
    db = Database(url, sqlite_inline=True)
    flushes: list[AsyncSession] = []
    real_flush = AsyncSession.flush

    async def counted(self: AsyncSession, *args: Any, **kw: Any) -> None:
        flushes.append(self)
        await real_flush(self, *args, **kw)

    monkeypatch.setattr(AsyncSession, "flush", counted)
    try:
        with db.hot(), pytest.raises(RuntimeError):
            async with db.transaction():
                async with db.write() as session:
                    await repo._driver_rows(await repo._connection(session), "SELECT 1", ())
                assert flushes == []
                async with db.write() as session:
                    session.add(Pool(name="p", config={"k": 8}))
                assert flushes == [session]
                with pytest.raises(IntegrityError):  # in the block that added the duplicate
                    async with db.write() as session:
                        session.add(Pool(name="p", config={"k": 8}))
                raise RuntimeError("the transaction is rolled back")
        async with db.write() as session:
            assert (await session.execute(select(Pool))).all() == []
    finally:
        await db.close()


def _counted_table(rows: int) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    conn.execute("CREATE TABLE t (run INTEGER, at TEXT)")
    conn.execute("CREATE INDEX ix_t ON t (run, at)")
    conn.executemany("INSERT INTO t VALUES (1, ?)", [(f"{i:08d}",) for i in range(rows)])
    return conn


_COUNT = "SELECT count(*) FROM t WHERE run = ? AND at >= ?"


async def test_a_read_within_its_steps_answers_and_one_past_them_is_stopped() -> None:
    """`fetch_all_within` answers a read that SQLite's virtual machine finishes within the steps
    given, and None for one that needs more (stopped there, not run to its end); the connection's
    progress handler is gone either way, so the next statement runs whole."""
    conn = _counted_table(5_000)
    assert await sqlite_inline.fetch_all_within(conn, _COUNT, (1, ""), 100_000) == [(5_000,)]
    assert await sqlite_inline.fetch_all_within(conn, _COUNT, (1, "00004900"), 1_000) == [(100,)]
    assert await sqlite_inline.fetch_all_within(conn, _COUNT, (1, ""), 1_000) is None
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    # the stopped read's handler was removed: a handler set now sees every step of a whole count
    conn.set_progress_handler(tick, 1)
    assert conn.execute(_COUNT, (1, "")).fetchall() == [(5_000,)]
    conn.set_progress_handler(None, 0)
    assert steps[0] > 5_000 * 2
    assert (await sqlite_inline.fetch_all_off_loop(conn, _COUNT, (1, ""))) == [(5_000,)]


async def test_a_read_stopped_inside_a_transaction_leaves_the_transaction_and_its_writes() -> None:
    """A read stopped for its steps inside a write transaction changes nothing: the transaction
    stays open with what it wrote, and commits it."""
    conn = _counted_table(5_000)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO t VALUES (2, 'written')")
    assert await sqlite_inline.fetch_all_within(conn, _COUNT, (1, ""), 500) is None
    assert conn.in_transaction
    conn.execute("COMMIT")
    assert conn.execute("SELECT count(*) FROM t WHERE run = 2").fetchone() == (1,)


async def test_a_read_that_fails_otherwise_raises_its_error_and_leaves_no_handler() -> None:
    conn = _counted_table(10)
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        await sqlite_inline.fetch_all_within(conn, "SELECT count(*) FROM missing", (), 10)
    # no handler left behind to stop a long statement
    assert conn.execute("SELECT count(*) FROM t a, t b, t c").fetchone() == (1_000,)


async def test_a_read_run_again_and_again_within_its_steps_is_never_stopped() -> None:
    """SQLite counts a prepared statement's steps over all its runs (the driver keeps it prepared
    for the next), and calls a progress handler every so many of them: a budget of one run's steps
    must not be taken from that running total, or a short read is stopped now and then."""
    conn = _counted_table(30)  # ~100 steps a count
    answers = [await sqlite_inline.fetch_all_within(conn, _COUNT, (1, ""), 1_000) for _ in range(100)]
    assert answers == [[(30,)]] * 100
    # and one that needs more than its steps is stopped every time, not only where the total
    # crosses a multiple of them
    assert [await sqlite_inline.fetch_all_within(conn, _COUNT, (1, ""), 40) for _ in range(20)] == [None] * 20
