"""A large transaction's COMMIT on the inline SQLite driver runs in a worker thread
(`sqlite_inline.OFF_LOOP_COMMIT_ROWS`): the loop goes on meanwhile, a small transaction still
commits on the loop, and a commit whose caller is cancelled is waited for before the connection
can be used again."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from exgrpo_pool.store.sqlite_inline import OFF_LOOP_COMMIT_ROWS, InlineConnection


class Recording(sqlite3.Connection):
    """A connection that records the thread of every COMMIT and, where told, holds it until an
    event is set (the commit's work done only after that)."""

    threads: list[int]
    hold: threading.Event | None
    started: threading.Event

    def commit(self) -> None:
        self.threads.append(threading.get_ident())
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(10), "the commit was never let go"
        super().commit()


def _open(path: Path, hold: threading.Event | None = None) -> Recording:
    conn = sqlite3.connect(path, factory=Recording, check_same_thread=False)
    assert isinstance(conn, Recording)
    conn.threads, conn.hold, conn.started = [], hold, threading.Event()
    return conn


@pytest.fixture
def db_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "t.db"
    setup = sqlite3.connect(path)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE t (x INTEGER)")
    setup.commit()
    setup.close()
    yield path


def _insert(conn: sqlite3.Connection, n: int) -> None:
    conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(n)])


def _count(path: Path) -> int:
    other = sqlite3.connect(path)
    try:
        return int(other.execute("SELECT count(*) FROM t").fetchone()[0])
    finally:
        other.close()


async def _held_commit(
    path: Path, hold: threading.Event
) -> tuple[Recording, InlineConnection, asyncio.Future[None]]:
    """A large transaction's commit begun in its thread and held there by `hold`."""
    conn = _open(path, hold)
    inline = InlineConnection(conn)
    _insert(conn, OFF_LOOP_COMMIT_ROWS)
    commit = asyncio.ensure_future(inline.commit())
    for _ in range(2000):
        if conn.started.is_set():
            break
        await asyncio.sleep(0.005)
    assert conn.started.is_set(), "the commit never began"
    return conn, inline, commit


async def test_a_large_commit_runs_in_a_thread_and_a_small_one_on_the_loop(db_file: Path) -> None:
    conn = _open(db_file)
    inline = InlineConnection(conn)
    loop_thread = threading.get_ident()
    _insert(conn, OFF_LOOP_COMMIT_ROWS)
    await inline.commit()
    _insert(conn, 3)
    await inline.commit()
    # the count of changed rows starts again after a rollback: 200 rolled back and 100 committed
    # are a transaction of 100
    _insert(conn, 200)
    await inline.rollback()
    _insert(conn, OFF_LOOP_COMMIT_ROWS - 1)
    await inline.commit()
    inline.stop()
    large, small, after_rollback = conn.threads
    assert large != loop_thread
    assert small == loop_thread
    assert after_rollback == loop_thread
    assert _count(db_file) == OFF_LOOP_COMMIT_ROWS + 3 + OFF_LOOP_COMMIT_ROWS - 1


async def test_the_loop_runs_while_a_large_commit_is_written(db_file: Path) -> None:
    """The commit waits until a task on the loop lets it go: on the loop it would wait forever."""
    hold = threading.Event()
    _, inline, commit = await _held_commit(db_file, hold)
    assert not commit.done()
    assert _count(db_file) == 0  # not committed yet: a reader sees the file as it was
    hold.set()
    await asyncio.wait_for(commit, 10)
    inline.stop()
    assert _count(db_file) == OFF_LOOP_COMMIT_ROWS


async def test_a_cancelled_large_commit_is_waited_for_before_the_cancellation_goes_on(db_file: Path) -> None:
    hold = threading.Event()
    conn, inline, commit = await _held_commit(db_file, hold)
    commit.cancel()
    await asyncio.sleep(0.05)
    commit.cancel()  # a second cancellation does not end the wait either
    await asyncio.sleep(0.05)
    # still waiting for the thread: nothing may use the connection while it commits
    assert not commit.done()
    hold.set()
    with pytest.raises(asyncio.CancelledError):
        await commit
    # the commit ended before the cancellation went on: written, and the connection free
    assert _count(db_file) == OFF_LOOP_COMMIT_ROWS
    assert not conn.in_transaction
    _insert(conn, 1)
    await inline.commit()
    inline.stop()
    assert _count(db_file) == OFF_LOOP_COMMIT_ROWS + 1


async def test_a_large_commit_that_fails_raises_its_error_and_can_be_rolled_back(tmp_path: Path) -> None:
    """A deferred foreign key broken by the transaction fails its COMMIT: the error comes from the
    thread as it would on the loop, the transaction stays open for the caller's rollback, and the
    next small transaction commits on the loop again."""
    path = tmp_path / "fk.db"
    setup = sqlite3.connect(path)
    setup.executescript(
        "PRAGMA journal_mode=WAL; CREATE TABLE parent (id INTEGER PRIMARY KEY); "
        "CREATE TABLE t (x INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED);"
    )
    setup.close()
    conn = _open(path)
    conn.execute("PRAGMA foreign_keys=ON")
    inline = InlineConnection(conn)
    _insert(conn, OFF_LOOP_COMMIT_ROWS)  # no parent row: the key is broken at COMMIT
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        await inline.commit()
    assert conn.in_transaction
    await inline.rollback()
    conn.execute("INSERT INTO parent VALUES (0)")
    conn.execute("INSERT INTO t VALUES (0)")
    await inline.commit()
    inline.stop()
    failed, small = conn.threads
    assert failed != threading.get_ident()
    assert small == threading.get_ident()
    assert _count(path) == 1
