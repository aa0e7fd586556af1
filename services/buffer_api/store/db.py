"""Database engine, sessions and migrations (SQLite file by default, Postgres via asyncpg)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from exgrpo_pool import faults, jsonread
from exgrpo_pool.store import repo
from exgrpo_pool.store.sqlite_inline import creator as sqlite_inline_creator

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

log = logging.getLogger("exgrpo.pool")


#: WAL pages after which a committing SQLite connection checkpoints by itself, inside the write
#: that crossed it. `Database` checkpoints in the background after every write, so this is only
#: the bound if those fall behind (SQLite's default, 1,000 pages = 4 MB, is less than two commits
#: of a 128 x 8 batch: a checkpoint of ~10-15 ms inside nearly every commit).
WAL_AUTOCHECKPOINT_PAGES = 16_384


#: SQLite's page cache per connection, in MiB (`Settings.sqlite_cache_mb`). SQLite's default, 2 MB,
#: holds less than the payloads one plan reads (~2.6 MB for 64 questions with 8 KB trajectories), so
#: each plan read them from the file again, and the trajectory indexes that every commit descends
#: were evicted by them. 0 leaves SQLite's default.
SQLITE_CACHE_MB = 64

#: hot reads' sessions kept open with their connections, at most (`Database._warm_read`): the
#: hot engine's pool has 5 connections and 10 more on demand, and the hot writes keep one of them
#: (`Database._kept_write`)
WARM_READS = 4

#: Postgres: the tallies' rows are folded (`repo.fold_tallies`) after this many writes
FOLD_TALLIES_EVERY = 64

#: Postgres errors after which a transaction may simply run again (the database aborted it to let
#: another go on), by SQLSTATE
RETRY_SQLSTATES = {"40001": "serialization failure", "40P01": "deadlock"}


#: prepared statements kept per connection of the inline SQLite driver (the hot path's)
HOT_CACHED_STATEMENTS = 128


def _sqlite_pragmas(cache_mb: int, *, inline: bool = False) -> Callable[[DBAPIConnection, object], None]:
    def on_connect(dbapi_conn: DBAPIConnection, _record: object) -> None:
        cur = dbapi_conn.cursor()
        # the busy timeout is spent before journal_mode, which needs a lock to switch a new file;
        # inline connections wait on the event loop instead (sqlite_inline.BUSY_WAIT_S)
        cur.execute(f"PRAGMA busy_timeout={0 if inline else 30000}")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
        if cache_mb:
            # negative: KiB, not pages; SQLite takes the memory as pages are read, not up front
            cur.execute(f"PRAGMA cache_size=-{int(cache_mb) * 1024}")
        cur.close()

    return on_connect


def make_engine(
    url: str, *, pool_size: int = 10, sqlite_cache_mb: int = SQLITE_CACHE_MB, sqlite_inline: bool = False
) -> AsyncEngine:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        # Python's sqlite3 keeps 128 prepared statements per connection; multi-row INSERTs of varying
        # length are each a new statement of ~2 MB, so the default cache grew RSS by ~2 MB per step.
        # The hot path's statements have a bounded set of texts (no multi-row INSERT, lists of ids
        # of rounded lengths: `repo.id_marks`): its connections keep all of them prepared
        cached = 16
        inline = sqlite_inline and bool(u.database) and u.database != ":memory:"
        if inline:
            assert u.database is not None
            connect = sqlite_inline_creator(u.database, cached_statements=HOT_CACHED_STATEMENTS)
            engine = create_async_engine(url, async_creator=connect, json_deserializer=jsonread.loads)
        else:
            engine = create_async_engine(
                url, connect_args={"cached_statements": cached}, json_deserializer=jsonread.loads
            )
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas(sqlite_cache_mb, inline=inline))
        return engine
    engine = create_async_engine(
        url, pool_size=pool_size, max_overflow=pool_size, json_deserializer=jsonread.loads
    )
    event.listen(engine.sync_engine, "checkout", _drop_if_closed)
    return engine


def _drop_if_closed(dbapi_conn: DBAPIConnection, _record: object, _proxy: object) -> None:
    """A pooled Postgres connection the server has closed (a restart, a failover, a proxy's idle
    timeout) is replaced when it is taken, not used: asyncpg marks a connection closed as soon as
    the server's close reaches the event loop. SQLAlchemy's `pool_pre_ping` would instead send
    BEGIN, an empty statement and ROLLBACK on every checkout: three round trips per request. A
    connection that died without a close (a cut network) fails its first statement, which the
    request answers 503, and the pool then drops every connection older than the failure."""
    driver = getattr(dbapi_conn, "driver_connection", None)
    is_closed = getattr(driver, "is_closed", None)
    if is_closed is not None and is_closed():
        raise DisconnectionError("the server closed this connection")


@dataclass
class _Shared:
    """The transaction of `Database.transaction()`, joined by every `write()` and `read()` of the
    task until it ends."""

    db: Database
    session: AsyncSession
    after_commit: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


_shared: ContextVar[_Shared | None] = ContextVar("exgrpo_shared_transaction", default=None)


@dataclass(eq=False)
class _Member:
    """One block's place in a grouped transaction (`Database.transaction(group=...)`): handed the
    transaction's session on its turn, it says how its block ended, then waits for the commit."""

    turn: asyncio.Future[AsyncSession]
    #: the block ended: None, or what it raised (its savepoint is then rolled back)
    done: asyncio.Future[BaseException | None]
    committed: asyncio.Future[None]


@dataclass(eq=False)
class _Queue:
    """The blocks of one group key waiting for a transaction, and the task that opens them."""

    waiting: deque[_Member] = field(default_factory=deque)
    leader: asyncio.Task[None] | None = None


class _BlockFailed(Exception):
    """A group of one whose block raised: its transaction rolls back (the block has its error)."""


#: set by `Database.hot()` for the task's requests on the hot path
_hot: ContextVar[bool] = ContextVar("exgrpo_hot_path", default=False)


class Database:
    """Owns the engine. `write()` opens one transaction; on SQLite writes are serialised in
    process (SQLite allows one writer at a time and would otherwise answer `database is locked`).
    Inside `transaction()` every `write()` and `read()` joins that one transaction instead.

    `shared_file`: other processes write the same SQLite file (`exgrpo serve --workers N`). Python's
    sqlite3 begins a transaction at its first INSERT/UPDATE/DELETE, so the reads of a write block
    before it could miss what another process commits meanwhile; with this every `write()` takes
    SQLite's write lock when it begins (BEGIN IMMEDIATE, waiting up to the busy timeout)."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 10,
        shared_file: bool = False,
        sqlite_cache_mb: int = SQLITE_CACHE_MB,
        sqlite_inline: bool = False,
        group_max: int = 1,
    ) -> None:
        self.url = url
        self.engine = make_engine(url, pool_size=pool_size, sqlite_cache_mb=sqlite_cache_mb)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        #: SQLite called from the event loop (`sqlite_inline`), for the hot path only (`hot()`);
        #: with other processes on the file too (`shared_file`): a statement that finds the file
        #: locked by one of them waits on the loop (`sqlite_inline.BUSY_WAIT_S`), as it waits for
        #: a connection of its own process (the 50-client mix with two processes served 1.2-1.4x
        #: the requests of the thread driver's)
        self.hot_engine: AsyncEngine | None = None
        self.hot_sessions = self.sessions
        #: hot reads' sessions kept with their connections for the next hot read (`_warm_read`)
        self._warm: list[AsyncSession] = []
        #: the polled reads' connections of the inline SQLite driver, kept for the next (`polled`)
        self._readers: list[repo.Driver] = []
        #: the hot writes' session, bound to a connection it keeps (`_kept_write`)
        self._writer: AsyncSession | None = None
        if sqlite_inline and self.is_sqlite:
            self.hot_engine = make_engine(url, sqlite_cache_mb=sqlite_cache_mb, sqlite_inline=True)
            self.hot_sessions = async_sessionmaker(self.hot_engine, expire_on_commit=False)
        #: hot-path reads outside a transaction on Postgres: autocommit, so a selection sends no
        #: BEGIN and ROLLBACK around its statements. Under READ COMMITTED (the default, which the
        #: service keeps) each statement sees what was committed when it began either way.
        self.hot_reads: async_sessionmaker[AsyncSession] | None = None
        if not self.is_sqlite:
            autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            self.hot_reads = async_sessionmaker(autocommit, expire_on_commit=False)
        self._write_lock = asyncio.Lock() if self.is_sqlite else None
        self._begin_immediate = self.is_sqlite and shared_file
        u = make_url(url)
        #: a SQLite file: its WAL is checkpointed in the background after writes
        self._wal = self.is_sqlite and bool(u.database) and u.database != ":memory:"
        #: the file a checkpoint opens directly (None: a URL with options, checkpointed through
        #: the engine as the service opens it)
        self._wal_file = u.database if self._wal and not u.query else None
        self._checkpointer: sqlite3.Connection | None = None
        self._checkpoint: asyncio.Task[None] | None = None
        self._checkpoint_again = False
        self._fold: asyncio.Task[None] | None = None
        self._writes_unfolded = 0
        #: Postgres: blocks of one group key that wait while the key's transaction is open go
        #: into the next one together, up to this many (`transaction(group=...)`)
        self.group_max = group_max if not self.is_sqlite else 1
        self._groups: dict[Hashable, _Queue] = {}
        #: told the number of blocks of every grouped transaction that committed
        self.on_group: Callable[[int], None] | None = None

    @staticmethod
    def hot() -> contextlib.AbstractContextManager[None]:
        """The task's `write()`, `read()` and `transaction()` are on the hot path (plan, commit,
        ingest, select, tasks, and the polled reads of bounded work: a run's and the pool's stats,
        a page of questions): with the inline SQLite driver they call SQLite from the event loop,
        and on Postgres their reads outside a transaction are autocommit (`hot_reads`).
        Everything else (listings, imports, exports, deletes: reads and writes that may take long)
        keeps the thread driver and never holds up the loop. (A class, not a generator: entered on
        every hot request, a generator's context manager cost ~1.5 us more.)"""
        return _HotPath()

    def _sessions(self, *, read: bool = False) -> async_sessionmaker[AsyncSession]:
        """The sessions of a `write()` or (`read`) a `read()` outside a joined transaction."""
        if not _hot.get():
            return self.sessions
        return self.hot_reads if read and self.hot_reads is not None else self.hot_sessions

    def _joined(self) -> _Shared | None:
        shared = _shared.get()
        return shared if shared is not None and shared.db is self else None

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        shared = self._joined()
        if shared is not None:
            yield shared.session
            # a unique violation or the like surfaces in the block that caused it (a block that
            # added, changed or deleted no ORM object has nothing to flush: no hop into the session)
            session = shared.session
            if _changed(session):
                await session.flush()
            return
        lock = self._write_lock or contextlib.nullcontext()
        async with lock:
            if self.hot_engine is not None and _hot.get():
                async with self._kept_write() as session:
                    yield session
            else:
                async with self._sessions()() as session, session.begin():
                    await self._begin(session)
                    yield session
        faults.committed()
        if self._wal:
            self._checkpoint_soon()
        elif not self.is_sqlite:
            self._writes_unfolded += 1
            if self._writes_unfolded >= FOLD_TALLIES_EVERY and (self._fold is None or self._fold.done()):
                self._writes_unfolded = 0
                self._fold = asyncio.get_running_loop().create_task(self.fold_tallies())

    async def _begin(self, session: AsyncSession) -> None:
        if self._begin_immediate:
            # sqlite3 sees the transaction open and issues no BEGIN of its own; COMMIT and
            # ROLLBACK end it as usual
            await (await session.connection()).exec_driver_sql("BEGIN IMMEDIATE")

    @contextlib.asynccontextmanager
    async def _kept_write(self) -> AsyncIterator[AsyncSession]:
        """A hot SQLite write (the inline driver) in the session kept from the one before, bound
        to the connection it keeps checked out: hot writes run one at a time (`_write_lock`), so
        one session serves them all. A session made, its connection taken from the pool, given
        back and the session closed cost ~150 us of CPU a write (the loop's greenlet hops and the
        pool's bookkeeping), as much as a small write's statements. The session is kept only
        when its block ended normally and the commit left no transaction open on the connection
        (`_reusable`); its ORM objects, if it loaded any, are let go as a close lets them go.
        Otherwise it is closed and its connection given back, and the next write makes them
        anew."""
        session, self._writer = self._writer, None
        if session is None:
            assert self.hot_engine is not None
            session = AsyncSession(await self.hot_engine.connect(), expire_on_commit=False)
        kept = False
        try:
            async with session.begin():
                await self._begin(session)
                yield session
            if _reusable(session):
                session.expunge_all()
                self._writer = session
                kept = True
        finally:
            if not kept:
                await _close_bound(session)

    def _checkpoint_soon(self) -> None:
        """Copy the WAL's new pages into the database file off the request's path: a task that
        runs once the request has given the event loop back (one at a time; writes made while it
        runs get another pass). PASSIVE: it waits for no reader or writer."""
        if self._checkpoint is not None and not self._checkpoint.done():
            self._checkpoint_again = True
            return
        self._checkpoint = asyncio.get_running_loop().create_task(self._checkpoint_wal())

    async def _checkpoint_wal(self) -> None:
        again = True
        while again:
            self._checkpoint_again = False
            try:
                if self._wal_file is not None:
                    # in a worker thread (it copies megabytes) on a connection of its own: through
                    # the engine, the checkout and the driver's thread hops took loop time
                    await asyncio.to_thread(self._checkpoint_file, self._wal_file)
                else:
                    async with self.engine.connect() as conn:  # the thread driver
                        await conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
            except Exception:  # the WAL stays; the next write tries again, SQLite's bound holds
                log.warning("background WAL checkpoint failed", exc_info=True)
                return
            again = self._checkpoint_again

    def _checkpoint_file(self, path: str) -> None:
        """A PASSIVE checkpoint of the file (one runs at a time), on a connection kept open for
        the next one and closed with the database."""
        if self._checkpointer is None:
            self._checkpointer = sqlite3.connect(
                path, timeout=0, check_same_thread=False, isolation_level=None
            )
        self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    async def fold_tallies(self) -> None:
        """Postgres: fold the tallies' rows, in a transaction of its own (writers only add rows,
        so it waits for none of them). A failure leaves the rows as they are: the counts hold."""
        try:
            async with self.sessions() as session, session.begin():
                await repo.fold_tallies(session)
        except Exception:
            log.warning("folding the tallies failed; the next pass tries again", exc_info=True)

    async def check_tallies(self, *, repair: bool = False, attempts: int = 5) -> list[repo.TallyDrift]:
        """The tally cells that differ from counting their rows; with `repair` set to the counts.
        Counts every question, state and trajectory (seconds at 1M questions), in one snapshot.
        On Postgres it runs beside the service's writers and none waits for it (REPEATABLE READ,
        see `repo.recount_tallies`); a serialization failure against a concurrent fold is
        retried. On SQLite a repair holds the file's write lock while it counts."""
        check = repo.recount_tallies if repair else repo.tally_drift
        if self.is_sqlite:
            # one transaction from the first read on (sqlite3 would begin one only at the first
            # write, and each read would see the file as it was then): a snapshot for a check,
            # the write lock for a repair (another process may be the service writing the file)
            async with self.sessions() as session, session.begin():
                begin = "BEGIN IMMEDIATE" if repair else "BEGIN"
                await (await session.connection()).exec_driver_sql(begin)
                return await check(session)
        engine = self.engine.execution_options(isolation_level="REPEATABLE READ")
        for attempt in range(1, attempts + 1):
            try:
                async with AsyncSession(engine, expire_on_commit=False) as session, session.begin():
                    return await check(session)
            except DBAPIError as exc:
                if attempt == attempts or getattr(exc.orig, "sqlstate", None) not in RETRY_SQLSTATES:
                    raise
                log.info("the tally recount met a concurrent fold; counting again (%d)", attempt)
        raise AssertionError("unreachable")

    async def settle(self) -> None:
        """Wait for the background checkpoint or fold, if one is running, and for the grouped
        transactions still open: a block that raised has returned before its group's transaction
        ended (tests, shutdown)."""
        leaders = [q.leader for q in list(self._groups.values())]
        for task in (self._checkpoint, self._fold, *leaders):
            if task is not None and not task.done():
                await asyncio.shield(task)

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        shared = self._joined()
        if shared is not None:
            yield shared.session
            return
        if _hot.get() and (self.hot_engine is not None or self.hot_reads is not None):
            async with self._warm_read() as session:
                yield session
            return
        async with self._sessions(read=True)() as session:
            yield session

    @contextlib.asynccontextmanager
    async def _warm_read(self) -> AsyncIterator[AsyncSession]:
        """A hot read (the inline SQLite driver, or Postgres's autocommit reads) in a session kept
        for the next one with its connection (up to `WARM_READS` of them): taking a connection
        from SQLAlchemy's pool and giving it back cost ~110-150 us of a SQLite read of ~0.5 ms and
        ~190 us of a Postgres one (greenlet hops, the pool's bookkeeping, a ROLLBACK). A read
        leaves nothing behind to keep: `sqlite3` opens no transaction for a SELECT and the Postgres
        reads are autocommit (each statement reads what was committed when it began, as before), so
        an idle kept session holds no snapshot and no lock; its ORM objects, if it loaded any, are
        let go. A session is kept only when its block ended normally and left no transaction open
        on its connection (`repo.held_idle`); any other ends closed. A kept Postgres connection
        that the server has closed meanwhile (a restart, an idle timeout) is dropped when next
        taken, as the pool drops one (`_drop_if_closed`)."""
        session: AsyncSession | None = None
        while self._warm and session is None:
            kept_one = self._warm.pop()
            if repo.held_idle(kept_one) is False:
                await kept_one.invalidate()
            else:
                session = kept_one
        if session is None:
            session = self._sessions(read=True)()
        kept = False
        try:
            yield session
            idle = repo.held_idle(session)
            clean = not session.in_transaction() if idle is None else idle
            if clean and not _changed(session) and len(self._warm) < WARM_READS:
                session.expunge_all()
                self._warm.append(session)
                kept = True
        finally:
            if not kept:
                if self.hot_engine is None:  # asyncpg: closed in a task shielded from cancellation
                    await asyncio.shield(session.close())
                else:
                    # the inline driver's close never waits (`sqlite3`'s ROLLBACK finds no lock to
                    # wait for): awaited itself, without a shielded task (~70 us, two loop turns)
                    await session.close()

    def polled(self) -> contextlib.AbstractAsyncContextManager[AsyncSession | repo.Driver]:
        """Where a polled read (a run's stats, the pool's stats) runs its statements: on the hot
        path's SQLite connections (the inline driver) a connection of its own, kept for the next
        one (up to `WARM_READS` of them) with its driver found once (`repo.Driver`), without an
        ORM session; anywhere else, and inside a joined transaction, `read()`'s session. The
        repository's functions of these reads take either (`repo.Target`). In process on the 10k
        pool a run's stats cost the service call ~120 us of CPU in a warm session and ~84 us so
        (the floor's whole read ~47): the session's bookkeeping (taking it and keeping it again,
        its connection and driver looked up per statement, its objects let go) is not done.
        The statements are autocommit reads, as in a warm session: `sqlite3` opens no transaction
        for a SELECT, so a kept connection holds no snapshot and no lock. A connection is kept
        only when its block ended normally with no transaction open on it, in SQLAlchemy (a
        statement SQLAlchemy ran itself begins one: a 404's lookup) or in `sqlite3`; any other is
        closed, given back to the engine's pool."""
        return _Polled(self)

    @contextlib.asynccontextmanager
    async def transaction(self, group: Hashable | None = None) -> AsyncIterator[AsyncSession]:
        """One write transaction for everything the block does, through this object's `write()`
        and `read()` included: an idempotent request commits its writes and its key record
        together. What `after_commit` was given runs once the transaction has committed.

        `group` (Postgres, `group_max` > 1): blocks with the same key share transactions. The
        first opens one alone; the blocks that arrive while it is open wait (not for a connection
        or a row lock: in this process) and go into the next transaction together, one after
        another, each in a savepoint of its own, so a block that raises is undone alone and the
        others commit. A block sees what the blocks before it wrote, as if they had committed just
        before it; it returns once the whole transaction has committed, and fails if that fails.
        The writes of one run's ingests wait for the run's row lock in turn anyway: together they
        take the lock, a connection and a commit once."""
        if self._joined() is not None:
            raise RuntimeError("Database.transaction() does not nest")
        if group is None or self.group_max <= 1:
            async with self.write() as session:
                shared = _Shared(self, session)
                token = _shared.set(shared)
                try:
                    yield session
                finally:
                    _shared.reset(token)
        else:
            member = self._enqueue(group)
            try:
                session = await member.turn
            except BaseException as exc:  # cancelled while waiting, or just as its turn came
                if member.turn.done() and not member.turn.cancelled() and not member.done.done():
                    member.done.set_result(exc)
                raise
            shared = _Shared(self, session)
            token = _shared.set(shared)
            try:
                yield session
            except BaseException as exc:
                member.done.set_result(exc)
                raise
            finally:
                _shared.reset(token)
            member.done.set_result(None)
            # the others of the group commit with it whatever becomes of this request's task
            await asyncio.shield(member.committed)
            faults.committed()
        for callback in shared.after_commit:
            await _follow_up(callback)

    def _enqueue(self, group: Hashable) -> _Member:
        loop = asyncio.get_running_loop()
        member = _Member(loop.create_future(), loop.create_future(), loop.create_future())
        queue = self._groups.setdefault(group, _Queue())
        queue.waiting.append(member)
        if queue.leader is None:
            queue.leader = loop.create_task(self._lead(group, queue))
        return member

    async def _lead(self, group: Hashable, queue: _Queue) -> None:
        """Open transactions for the blocks of `group` while any wait, each for all that wait
        (up to `group_max`); gone when none is left."""
        try:
            while queue.waiting:
                members: list[_Member] = []
                while queue.waiting and len(members) < self.group_max:
                    member = queue.waiting.popleft()
                    if not member.turn.cancelled():
                        members.append(member)
                if members:
                    await self._grouped(members)
        finally:
            # left early only when this task is cancelled (the event loop closing): those still
            # waiting are cancelled with it rather than left waiting for a turn that never comes
            while queue.waiting:
                queue.waiting.popleft().turn.cancel()
            queue.leader = None
            if self._groups.get(group) is queue:
                del self._groups[group]

    async def _grouped(self, members: list[_Member]) -> None:
        """One transaction for `members`' blocks, one after another; a block that raised is rolled
        back to its savepoint (a group of one rolls back the whole transaction)."""
        alone = len(members) == 1
        kept: list[_Member] = []
        try:
            async with self.write() as session:
                for member in members:
                    if member.turn.cancelled():  # gave up while the blocks before it ran
                        continue
                    savepoint = None if alone else await session.begin_nested()
                    member.turn.set_result(session)
                    failed = await member.done
                    if failed is None:
                        if savepoint is not None:
                            await savepoint.commit()
                        kept.append(member)
                    elif savepoint is not None:
                        await savepoint.rollback()
                        if isinstance(failed, DBAPIError) and failed.connection_invalidated:
                            raise failed  # the connection is gone, and the transaction with it
                    else:
                        raise _BlockFailed()
        except _BlockFailed:
            return
        except BaseException as exc:
            for member in members:
                if not member.turn.done():
                    member.turn.set_exception(exc)
                elif member.turn.cancelled() or (member.done.done() and member.done.result() is not None):
                    continue  # never ran, or failed by itself
                elif not member.committed.done():
                    # ran (or runs on: this task was cancelled) and waits for the commit
                    member.committed.set_exception(exc)
            # every waiting block is told; a cancellation of this task itself goes on
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for member in kept:
            member.committed.set_result(None)
        if kept and self.on_group is not None:
            self.on_group(len(kept))

    async def after_commit(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` after the current `transaction()` commits, or now outside of one (the
        caller's own transaction has ended then). It must not raise: the write stands."""
        shared = self._joined()
        if shared is None:
            await _follow_up(callback)
        else:
            shared.after_commit.append(callback)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.settle()
        warm, self._warm = self._warm, []
        for session in warm:
            await session.close()
        readers, self._readers = self._readers, []
        for reader in readers:
            await reader.conn.close()
        writer, self._writer = self._writer, None
        if writer is not None:
            await _close_bound(writer)
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
        if self.hot_engine is not None:
            await self.hot_engine.dispose()
        await self.engine.dispose()


class _HotPath:
    """`Database.hot()`'s context."""

    __slots__ = ("token",)

    def __enter__(self) -> None:
        self.token = _hot.set(True)

    def __exit__(self, *exc: object) -> None:
        _hot.reset(self.token)


class _Polled:
    """`Database.polled()`'s context."""

    __slots__ = ("db", "fallback", "reader")

    def __init__(self, db: Database) -> None:
        self.db = db
        self.fallback: contextlib.AbstractAsyncContextManager[AsyncSession] | None = None
        self.reader: repo.Driver | None = None

    async def __aenter__(self) -> AsyncSession | repo.Driver:
        db = self.db
        if db.hot_engine is None or not _hot.get() or db._joined() is not None:
            self.fallback = db.read()
            return await self.fallback.__aenter__()
        reader = db._readers.pop() if db._readers else None
        if reader is None or reader.conn.closed or reader.conn.invalidated:
            reader = repo.Driver(await db.hot_engine.connect())
        self.reader = reader
        return reader

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.fallback is not None:
            await self.fallback.__aexit__(kind, exc, tb)
            return
        reader, readers = self.reader, self.db._readers
        assert reader is not None
        raw = reader.inline
        if (
            kind is None
            and raw is not None
            and not raw.in_transaction
            and not reader.conn.in_transaction()
            and len(readers) < WARM_READS
        ):
            readers.append(reader)
        else:
            await reader.conn.close()


def _changed(session: AsyncSession) -> bool:
    """Whether the session holds ORM objects added, changed or deleted and not yet flushed."""
    return bool(session.new or session.dirty or session.deleted)


def _reusable(session: AsyncSession) -> bool:
    """Whether a hot write's session, its transaction committed, may serve the next hot write: its
    connection open and valid, with no transaction left on it, in SQLAlchemy or in `sqlite3`, and
    no ORM change pending."""
    conn = session.bind
    if not isinstance(conn, AsyncConnection) or conn.closed or conn.invalidated or conn.in_transaction():
        return False
    raw = repo.inline_sqlite(conn)
    return (
        raw is not None and not raw.in_transaction and not session.in_transaction() and not _changed(session)
    )


async def _close_bound(session: AsyncSession) -> None:
    """Close a session bound to a connection of its own, and give the connection back."""
    conn = session.bind
    try:
        await session.close()
    finally:
        if isinstance(conn, AsyncConnection):
            await conn.close()


async def _follow_up(callback: Callable[[], Awaitable[None]]) -> None:
    """Run what follows a committed write. Its failure is logged, never raised: the write stands,
    and its answer must say so (not a 5xx that says nothing changed)."""
    try:
        await callback()
    except Exception:
        log.exception("a follow-up of a committed write failed; the write stands")


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations (blocking; run it in a thread from async code)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)
