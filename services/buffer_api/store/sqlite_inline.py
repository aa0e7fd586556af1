"""SQLite driven from the event loop's own thread, behind SQLAlchemy's aiosqlite dialect.

aiosqlite runs every call of a connection in that connection's thread: a statement through
SQLAlchemy is four calls (open a cursor, execute, fetch, close), each a queue put, a thread
wake-up and a future resolved back on the loop. A plan or a commit makes 9-10 statements. Here the
same calls run `sqlite3` directly, as the awaitables SQLAlchemy's adapter expects, so a statement
costs what SQLite does and nothing more. The loop waits while SQLite works; with the page cache
holding the hot pages that is short, and a write does not give the loop away between its
statements while it holds SQLite's write lock.

A statement must never wait for another connection inside SQLite here: the connection that holds
the write lock may need this very loop to finish. So these connections have no busy timeout of
their own (`busy_timeout=0`): a statement that finds the database locked is retried after an
`asyncio.sleep`, which lets the holder run, until `BUSY_WAIT_S` have passed. SQLite in WAL mode
lets readers run beside the writer, and `Database` serialises this process's writes before they
begin, so in one process that wait is rare.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any

#: how long a statement waits for a lock held by another connection before it fails as
#: SQLite's own busy timeout would ("database is locked")
BUSY_WAIT_S = 30.0


def lock_error(error: sqlite3.Error) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED (any extended code): another connection held a lock the
    statement needed; the statement did nothing."""
    code = getattr(error, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _busy(error: sqlite3.Error) -> bool:
    """A lock error that waiting can end: not a stale snapshot (SQLITE_BUSY_SNAPSHOT, where the
    transaction must restart)."""
    return lock_error(error) and getattr(error, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY_SNAPSHOT


async def _retrying(call: Callable[[], object]) -> None:
    """Run `call`; while SQLite answers that another connection holds the lock, wait on the loop
    (1 ms, doubling to 50 ms) and try again, for up to `BUSY_WAIT_S`."""
    deadline = time.monotonic() + BUSY_WAIT_S
    pause = 0.001
    while True:
        try:
            call()
            return
        except sqlite3.OperationalError as error:
            if not _busy(error) or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


async def fetch_all(conn: sqlite3.Connection, sql: str, parameters: Sequence[Any]) -> list[Any]:
    """The rows of one statement run on `conn` directly (retried as a cursor's statement is), as
    the tuples `sqlite3` gives."""
    cursor = conn.cursor()
    try:
        try:  # the first try without the retry loop's clock and closure (~2 us of a ~10 us read)
            cursor.execute(sql, parameters)
        except sqlite3.OperationalError as error:
            if not _busy(error):
                raise
            await _retrying(lambda: cursor.execute(sql, parameters))
        return cursor.fetchall()
    finally:
        cursor.close()


#: the most steps between two calls of `fetch_all_within`'s progress handler
_STEPS_PER_CALL = 1_000


async def fetch_all_within(
    conn: sqlite3.Connection, sql: str, parameters: Sequence[Any], steps: int
) -> list[Any] | None:
    """The rows of one read run on `conn` directly (as `fetch_all`), or None where SQLite's
    virtual machine needs more than about `steps` steps for it: a progress handler stops it there
    (SQLITE_INTERRUPT). A stopped read has changed nothing, and a transaction open on `conn`
    stays open with its changes (SQLite rolls one back only for an interrupted write); the caller
    runs the read elsewhere (`fetch_all_off_loop`). The handler is removed before this returns.

    SQLite calls a progress handler every N steps of a prepared statement's running total over
    all its runs (the driver keeps a statement prepared for its next run), not of this run alone:
    so the handler counts its own calls, every `steps / 16` steps at most (every 1,000 for large
    budgets), and stops the read at the call that ends its budget, within one such interval of
    `steps`."""
    every = max(1, min(_STEPS_PER_CALL, steps // 16))
    left = [max(1, -(-steps // every))]

    def spent() -> int:
        left[0] -= 1
        return left[0] <= 0

    conn.set_progress_handler(spent, every)
    try:
        return await fetch_all(conn, sql, parameters)
    except sqlite3.OperationalError as error:
        if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_INTERRUPT:
            return None
        raise
    finally:
        conn.set_progress_handler(None, 0)


async def fetch_all_off_loop(conn: sqlite3.Connection, sql: str, parameters: Sequence[Any]) -> list[Any]:
    """The rows of one read that may take long (it counts rows without bound), run on `conn` in a
    worker thread: `sqlite3` lets the loop go on while SQLite works. The caller's request holds
    `conn` meanwhile; nothing else uses it."""

    def run() -> list[Any]:
        cursor = conn.cursor()
        try:
            return cursor.execute(sql, parameters).fetchall()
        finally:
            cursor.close()

    return await asyncio.to_thread(run)


async def execute(
    conn: sqlite3.Connection, sql: str, parameters: Sequence[Any], *, many: bool = False
) -> int:
    """Run one statement that returns no rows on `conn` directly (`many`: once per parameter set
    in `parameters`), retried as a cursor's statement is; the rows it changed (summed)."""
    cursor = conn.cursor()
    try:
        if many:
            await _retrying(lambda: cursor.executemany(sql, parameters))
        else:
            await _retrying(lambda: cursor.execute(sql, parameters))
        return cursor.rowcount
    finally:
        cursor.close()


class InlineCursor:
    """The subset of aiosqlite's cursor that SQLAlchemy's adapter uses."""

    __slots__ = ("_cursor",)

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self._cursor = cursor

    async def __aenter__(self) -> InlineCursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._cursor.close()

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] = ()) -> InlineCursor:
        await _retrying(lambda: self._cursor.execute(sql, parameters))
        return self

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any] | dict[str, Any]]) -> InlineCursor:
        if not isinstance(rows, list | tuple):
            rows = list(rows)  # a retry must see the same rows again
        await _retrying(lambda: self._cursor.executemany(sql, rows))
        return self

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        return self._cursor.fetchmany(self._cursor.arraysize if size is None else size)

    async def close(self) -> None:
        self._cursor.close()

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    @property
    def arraysize(self) -> int:
        return self._cursor.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value


class InlineConnection:
    """The subset of aiosqlite's connection that SQLAlchemy's adapter uses."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn: sqlite3.Connection | None = conn

    @property
    def _connection(self) -> sqlite3.Connection | None:
        # SQLAlchemy's adapter skips COMMIT and ROLLBACK on a connection already closed
        return self._conn

    def live(self) -> sqlite3.Connection:
        """The open `sqlite3` connection (ProgrammingError once closed)."""
        return self._live()

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        return self._conn

    def cursor(self) -> InlineCursor:
        return InlineCursor(self._live().cursor())

    async def commit(self) -> None:
        await _retrying(self._live().commit)

    async def rollback(self) -> None:
        self._live().rollback()

    async def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def create_function(self, name: str, num_params: int, func: Callable[..., Any], **kw: Any) -> None:
        self._live().create_function(name, num_params, func, **kw)

    @property
    def isolation_level(self) -> str | None:
        return self._live().isolation_level


def creator(database: str, *, cached_statements: int) -> Callable[[], Any]:
    """`async_creator` for `create_async_engine`: opens `database` for use from the loop."""

    async def connect() -> InlineConnection:
        conn = sqlite3.connect(
            database, timeout=0, check_same_thread=False, cached_statements=cached_statements
        )
        return InlineConnection(conn)

    return connect
