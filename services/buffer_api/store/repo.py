"""All SQL of the pool service. Functions take an open session and never commit."""

from __future__ import annotations

import functools
import sqlite3
from collections import namedtuple
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from operator import itemgetter
from typing import Any, NamedTuple, NoReturn, cast

import numpy as np
import orjson
from sqlalchemy import (
    JSON,
    ColumnElement,
    Float,
    LargeBinary,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    case,
    delete,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.expression import cast as sql_cast
from sqlalchemy.util import greenlet_spawn

from exgrpo_pool import jsonread
from exgrpo_pool.store import pg_direct, sqlite_inline
from exgrpo_pool.store.models import (
    Batch,
    BatchRow,
    IdempotencyKey,
    LeaseRow,
    PageRow,
    PolicyVersion,
    Pool,
    PoolRow,
    Question,
    Run,
    RunEpoch,
    RunLease,
    RunMetric,
    RunQuestion,
    RunRow,
    Task,
    Trajectory,
    UTCDateTime,
    question_tally,
    state_tally,
    trajectory_tally,
    utcnow,
)

_IN_CHUNK = 5000  # bound on bound parameters per statement (SQLite allows 32766)


def _dialect(session: AsyncSession | Driver) -> str:
    return session.dialect.name if isinstance(session, Driver) else session.get_bind().dialect.name


def _insert(session: AsyncSession, table: Any) -> Any:
    return _insert_for(_dialect(session), table)


def _insert_for(dialect: str, table: Any) -> Any:
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


def _chunks(seq: Sequence[Any], n: int = _IN_CHUNK) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _is_pg(session: AsyncSession | Driver) -> bool:
    return _dialect(session) == "postgresql"


def _locked(session: AsyncSession, stmt: Select[Any]) -> Select[Any]:
    # SQLite has no row locks; its writers are serialised by Database.write().
    return stmt.with_for_update() if _is_pg(session) else stmt


# ------------------------------------------------------- the hot path's statements, run lean
def _innermost(session: AsyncSession) -> object:
    """The session's current transaction: its savepoint's, inside one."""
    sync = session.sync_session
    return sync.get_nested_transaction() or sync.get_transaction()


async def _connection(session: AsyncSession) -> AsyncConnection:
    """`session.connection()`, kept while the session's current transaction lasts: each call is a
    greenlet hop into the session (~20 us), and a request asks for it once per statement. A new
    transaction or savepoint asks the session again (it begins a savepoint on the connection
    when first asked for it there)."""
    return (await _held(session))[1]


async def _held(session: AsyncSession) -> tuple[object, AsyncConnection, Driver]:
    """(transaction, connection, its `Driver`) as `_connection` keeps them in the session."""
    held: tuple[object, AsyncConnection, Driver] | None = session.info.get("exgrpo_connection")
    tx = _innermost(session)
    if held is not None and tx is not None and held[0] is tx and not held[1].closed:
        return held
    conn = await session.connection()
    held = session.info["exgrpo_connection"] = (_innermost(session), conn, Driver(conn))
    return held


class Driver:
    """A checked-out connection's driver, found once: `sqlite3` on the hot path's SQLite
    connections (`inline`), asyncpg on Postgres where `pg_direct` can use its adapter (`adapt`),
    else SQLAlchemy's own execution. Finding it is a walk through SQLAlchemy's connection, pool
    entry and driver objects (~1.5 us); a polled stats read made it six times a request."""

    __slots__ = ("_database", "adapt", "conn", "dialect", "inline", "pg")

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn
        self.dialect = conn.dialect
        self.pg = self.dialect.name == "postgresql"
        self.inline = inline_sqlite(conn)
        self.adapt = None if self.inline is not None else _asyncpg(conn)
        self._database: str | None = None

    @property
    def database(self) -> str | None:
        """The connection's database (a SQLite file's path), found once."""
        if self._database is None:
            self._database = self.conn.engine.url.database
        return self._database

    @property
    def direct(self) -> bool:
        """Whether it runs driver statements without SQLAlchemy (see `_core_rows`)."""
        return self.inline is not None or self.adapt is not None

    async def rows(self, sql: str, args: Sequence[Any]) -> Sequence[Any]:
        """The rows of a driver statement (`_driver_rows`)."""
        if self.inline is not None:
            try:
                return await sqlite_inline.fetch_all(self.inline, sql, args)
            except sqlite3.Error as e:
                raise _sqlite_error(sql, args, e) from e
        conn = self.conn
        if self.adapt is None:
            return (await conn.exec_driver_sql(sql, tuple(args))).all()
        try:
            return await pg_direct.fetch_all(self.adapt, sql, args, _schema_stamp(conn))
        except Exception as e:
            await _pg_failed(conn, self.adapt, sql, args, e)

    async def write(self, sql: str, args: Sequence[Any], *, many: bool = False) -> int:
        """Run a driver statement that returns no rows (`_driver_write`); the rows it changed."""
        if self.inline is not None:
            try:
                return await sqlite_inline.execute(self.inline, sql, args, many=many)
            except sqlite3.Error as e:
                raise _sqlite_error(sql, args, e) from e
        conn = self.conn
        if self.adapt is None:
            return int((await conn.exec_driver_sql(sql, list(args) if many else tuple(args))).rowcount)
        try:
            return await pg_direct.execute(self.adapt, sql, args, _schema_stamp(conn), many=many)
        except Exception as e:
            await _pg_failed(conn, self.adapt, sql, args, e)


#: where a read's statements run: an ORM session (its current transaction's connection), or a
#: connection's driver (`Database.polled`: the polled reads on a kept inline SQLite connection)
Target = AsyncSession | Driver


async def _driver_of(target: Target) -> Driver:
    """The driver a read's statements run on (a session's: its current connection's)."""
    if isinstance(target, Driver):
        return target
    return (await _held(target))[2]


class _Sql:
    """The parameters of one driver statement and their marks, for either backend: `$n` for
    asyncpg, `?` for SQLite; a list of ids is one array parameter on Postgres (`= ANY($n)`: the
    statement's text, so its prepared form, is the same for any number of ids) and one mark per
    id on SQLite. No Core statement is built and looked up in the compiled cache per request, and
    no bound value is coerced one by one: in process on a 10k-question pool, the metadata of 64
    questions' trajectories 6.8 -> 6.1 ms of CPU, the prompts of 192 questions 1.69 -> 1.22."""

    def __init__(self, conn: AsyncConnection | Driver | None, *, pg: bool = False) -> None:
        """`pg`: the backend where no connection is given (a statement's text written ahead)."""
        self.pg = pg if conn is None else conn.dialect.name == "postgresql"
        self.args: list[Any] = []

    def arg(self, value: Any) -> str:
        self.args.append(value)
        return f"${len(self.args)}" if self.pg else "?"

    def ids(self, values: Sequence[int]) -> str:
        self.args.extend(_ids_args(self.pg, values))
        if self.pg:
            return f"= ANY(${len(self.args)}::bigint[])"
        return f"IN ({', '.join('?' * id_marks(len(values)))})"


def _ids_args(pg: bool, values: Sequence[int]) -> list[Any]:
    """The parameters a list of ids binds (`_Sql.ids`): on Postgres one array; on SQLite a mark
    each, rounded up (`id_marks`) with the last id again: the same set, a statement text already
    prepared."""
    if pg:
        return [list(values)]
    pad = id_marks(len(values)) - len(values)
    return [*values, *[values[-1]] * pad] if pad else list(values)


def id_marks(n: int) -> int:
    """The marks of a SQLite list of `n` ids: `n` rounded up to a power of two. Each length of an
    `IN (?, ...)` list is a statement of its own, which SQLite prepares (parses and plans) before
    it runs it; rounded, a statement's lists take at most 14 lengths up to `_IN_CHUNK`, and
    `sqlite3`'s cache of prepared statements keeps them (a commit's removal of the trajectories
    of its 0-30 retired questions was a new statement most of the time, and pushed the plan's and
    the commit's fixed statements out of a 16-statement cache: ~0.5 ms of a commit's CPU spent
    preparing them again)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


async def _driver_rows(conn: AsyncConnection, sql: str, args: Sequence[Any]) -> Sequence[Any]:
    """The rows of a driver statement, as tuples. On the hot path's SQLite connections (called
    from the event loop, `sqlite_inline`) straight from `sqlite3`: through SQLAlchemy a statement
    cost ~0.1 ms more and a read of ~400 trajectories ~0.8 ms more (its execution context, the
    greenlet hops, a Row per row), 5-8% of a plan's or a selection's CPU; on Postgres on asyncpg
    (`pg_direct`). Its errors are SQLAlchemy's all the same."""
    return await Driver(conn).rows(sql, args)


def _sqlite_error(sql: str, args: Sequence[Any], error: sqlite3.Error) -> StatementError:
    """An inline `sqlite3` statement's error as SQLAlchemy raises it for a statement of its own."""
    return DBAPIError.instance(sql, args, error, sqlite3.Error)


def _asyncpg(conn: AsyncConnection) -> Any | None:
    """SQLAlchemy's asyncpg adapter under a Postgres connection, where `pg_direct` can run
    statements on it (None: another driver, or an adapter without the parts it uses)."""
    sync = conn.sync_connection
    if sync is None or conn.dialect.name != "postgresql":
        return None
    return pg_direct.adapter(sync.connection.dbapi_connection)


def _schema_stamp(conn: AsyncConnection) -> float:
    stamp: float = getattr(conn.dialect, "_invalidate_schema_cache_asof", 0)
    return stamp


async def _pg_failed(
    conn: AsyncConnection, adapt: Any, sql: str, args: Sequence[Any], error: Exception
) -> NoReturn:
    """Raise what SQLAlchemy raises for `error` of a statement it ran itself: the adapter's DBAPI
    error, wrapped by the connection (which invalidates itself if the error says the connection is
    lost, and says so in the error's `connection_invalidated`)."""
    sync = conn.sync_connection
    assert sync is not None
    try:
        adapt._handle_exception(error)  # raises the DBAPI error the adapter makes of it
    except Exception as translated:
        await greenlet_spawn(sync._handle_dbapi_exception, translated, sql, tuple(args), None, None)
    raise error  # not reached: both of the above raise


def held_idle(session: AsyncSession) -> bool | None:
    """Whether the driver connection the session's current transaction holds (as `_connection`
    keeps it) is open with no transaction in it: `sqlite3` on the inline driver, asyncpg on
    Postgres. None: no connection kept, or another driver. No I/O."""
    held = session.info.get("exgrpo_connection")
    if held is None or held[0] is not _innermost(session):
        return None
    conn, driver = held[1], held[2]
    if conn.closed:
        return False
    if driver.inline is not None:
        return not driver.inline.in_transaction
    if driver.adapt is None:
        return None
    pg = driver.adapt._connection
    return not pg.is_closed() and not pg.is_in_transaction()


def inline_sqlite(conn: AsyncConnection) -> sqlite3.Connection | None:
    """The `sqlite3` connection under a connection of the inline SQLite driver (None: another
    driver). The connection is checked out already: reading it does no I/O."""
    sync = conn.sync_connection
    if sync is None or conn.dialect.name != "sqlite":
        return None
    driver = sync.connection.driver_connection
    return driver.live() if isinstance(driver, sqlite_inline.InlineConnection) else None


def _result_processor(conn: AsyncConnection, column: Any) -> Callable[[Any], Any] | None:
    """What SQLAlchemy does to a column's driver value (None: nothing)."""
    dialect = conn.dialect
    if dialect.name == "sqlite" and isinstance(column.type, JSON):
        return _json_value
    processor: Callable[[Any], Any] | None = column.type.dialect_impl(dialect).result_processor(dialect, None)
    return processor


def _json_value(value: Any) -> Any:
    """A JSON column's value given as its text (SQLite's JSON columns; a Postgres JSONB column
    read `::text`) as SQLAlchemy's processor reads it on the service's engines (their
    `json_deserializer`, `jsonread.loads`; a number, as SQLite's JSON functions answer, as it is;
    NULL: None), in one call where SQLAlchemy makes three: a page of 50 questions reads 100
    (`tests/unit/test_sqlite_json_reader.py`)."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return value
    return jsonread.loads(value)


@functools.lru_cache(maxsize=64)
def _bind_processors(
    dialect: Any, table: Any, names: tuple[str, ...]
) -> tuple[tuple[int, Callable[[Any], Any]], ...]:
    """What SQLAlchemy does to a value bound to each of `names` (by place; columns it leaves alone
    left out), worked out once per dialect (the polled stats bound a timestamp every request)."""
    impls = [table.c[n].type.dialect_impl(dialect) for n in names]
    # SQLite's driver takes bytes for a BLOB as they are (SQLAlchemy wraps each in a memoryview)
    raw = dialect.name == "sqlite"
    found = [None if raw and isinstance(t, LargeBinary) else t.bind_processor(dialect) for t in impls]
    return tuple((i, p) for i, p in enumerate(found) if p is not None)


#: timestamps as SQLite's `created_at` binds them, kept for the next read (`_stamp_text`)
_STAMP_TEXTS: dict[tuple[datetime, Any], str] = {}


def _stamp_text(dialect: Any, value: datetime) -> Any:
    """A timestamp as SQLite's `created_at` column binds it (`_bound`'s conversion), kept for the
    next call: the stats reads bind a ten-second period's boundary again and again (~2.7 us each)."""
    key = (value, value.tzinfo)
    text = _STAMP_TEXTS.get(key)
    if text is None:
        if len(_STAMP_TEXTS) >= 64:
            _STAMP_TEXTS.clear()
        ((_, convert),) = _bind_processors(dialect, _traj_t, ("created_at",))
        text = _STAMP_TEXTS[key] = convert(value)
    return text


def _bound(
    conn: AsyncConnection | Driver, table: Any, names: Sequence[str]
) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A row's values (in the order of `names`) as SQLAlchemy would bind them to its columns (a
    timestamp as SQLite's text, a JSON value as its text), for a driver statement. A timestamp is
    converted once per distinct value (the rows of one request share theirs)."""
    procs = _bind_processors(conn.dialect, table, tuple(names))
    stamps: dict[tuple[datetime, Any], Any] = {}

    def bind(values: Sequence[Any]) -> tuple[Any, ...]:
        out = list(values)
        for i, p in procs:
            v = out[i]
            if type(v) is datetime:
                # keyed with its zone: equal instants in two zones are equal datetimes
                key = (v, v.tzinfo)
                text = stamps.get(key)
                if text is None:
                    text = stamps[key] = p(v)
                out[i] = text
            else:
                out[i] = p(v)
        return tuple(out)

    return bind


async def _driver_write(conn: AsyncConnection, sql: str, args: Sequence[Any], *, many: bool = False) -> int:
    """Run a driver statement that returns no rows (`many`: once per parameter set in `args`);
    the rows it changed. On the hot path's SQLite connections straight on `sqlite3`, as
    `_driver_rows` reads, with SQLAlchemy's errors all the same."""
    return await Driver(conn).write(sql, args, many=many)


class _Compiled(NamedTuple):
    """A Core statement as the SQLite driver runs it: its text, its parameters' names in the
    order of their marks, what SQLAlchemy does to each value it binds and to each column it
    reads, and the values the statement carries itself (a literal, a LIMIT)."""

    sql: str
    names: tuple[str, ...]
    binds: tuple[Callable[[Any], Any] | None, ...]
    results: tuple[Callable[[Any], Any] | None, ...]
    fixed: dict[str, Any]

    def args(self, params: dict[str, Any]) -> list[Any]:
        out = [params[n] if n in params else self.fixed[n] for n in self.names]
        for i, p in enumerate(self.binds):
            if p is not None:
                out[i] = p(out[i])
        return out

    def rows(self, rows: Sequence[Any]) -> Sequence[Any]:
        procs = [(i, p) for i, p in enumerate(self.results) if p is not None]
        if not procs:
            return rows
        out = []
        for row in rows:
            values = list(row)
            for i, p in procs:
                values[i] = p(values[i])
            out.append(values)
        return out


@functools.lru_cache(maxsize=256)  # keyed by the statement object: only statements built once
def _compiled_once(stmt: Any, dialect: Any, keys: tuple[str, ...] | None) -> _Compiled | None:
    """`stmt` compiled once for a dialect (`keys`: the columns an INSERT or UPDATE sets, given as
    parameters), or None where SQLAlchemy must run it: a Python-side default or onupdate to
    compute, an expanding IN, a RETURNING."""
    compiled = stmt.compile(dialect=dialect, column_keys=None if keys is None else list(keys))
    if (
        any(getattr(compiled, a, None) for a in ("insert_prefetch", "update_prefetch", "postfetch"))
        or getattr(compiled, "effective_returning", None)
        or "POSTCOMPILE" in compiled.string
        or compiled.positiontup is None
    ):
        return None
    names = tuple(compiled.positiontup)
    params = [compiled.binds[n] for n in names]
    results: list[Callable[[Any], Any] | None] = []
    for col in getattr(stmt, "selected_columns", ()):
        if isinstance(col.type, UTCDateTime) and dialect.name == "sqlite":
            results.append(_sqlite_stamp)
            continue
        try:
            results.append(col.type.dialect_impl(dialect).result_processor(dialect, None))
        except TypeError:  # it needs the driver's type of the column (asyncpg's numbers)
            if not isinstance(col.type, Float) or col.type.asdecimal or col.type.precision is not None:
                return None
            # a FLOAT column is double precision, which the driver reads as a Python float
            results.append(None)
    return _Compiled(
        sql=compiled.string,
        names=names,
        binds=tuple(b.type.dialect_impl(dialect).bind_processor(dialect) for b in params),
        results=tuple(results),
        fixed={n: b.effective_value for n, b in zip(names, params, strict=True) if not b.required},
    )


async def _core_rows(session: Target, stmt: Any, params: dict[str, Any]) -> Sequence[Any]:
    """The rows of a Core statement built once (cached), as tuples of the values SQLAlchemy
    gives. Where the connection runs driver statements itself (`Driver.direct`: `sqlite3` on the hot
    path's SQLite connections, asyncpg on Postgres) compiled once and run as one (through
    SQLAlchemy a small statement cost ~0.1-0.2 ms more: the session's execution, its context,
    the greenlet hops, a Row per row); else, or where SQLAlchemy must run it, through the
    session (or the driver's connection)."""
    d = await _driver_of(session)
    compiled = _compiled_once(stmt, d.dialect, None) if d.direct else None
    if compiled is None:
        return (await (d.conn if isinstance(session, Driver) else session).execute(stmt, params)).all()
    return compiled.rows(await d.rows(compiled.sql, compiled.args(params)))


async def _core_write(
    session: AsyncSession, stmt: Any, params: dict[str, Any], keys: tuple[str, ...]
) -> None:
    """Run a Core INSERT or UPDATE built once (cached) that sets the columns `keys` from
    `params` (its other parameters: its own bound names), as `_core_rows` runs a read."""
    d = await _driver_of(session)
    compiled = _compiled_once(stmt, d.dialect, keys) if d.direct else None
    if compiled is None:
        await session.execute(stmt, params)
        return
    await d.write(compiled.sql, compiled.args(params))


@functools.cache
def _update_by(table: Table, column: str) -> Any:
    """UPDATE of `table` for the row whose `column` equals the parameter `where_<column>`; the
    columns it sets are the other parameters' names."""
    return update(table).where(table.c[column] == bindparam(f"where_{column}"))


# -------------------------------------------------------------- plain rows of the hot path
def _columns(table: Any, cls: Any, *, as_text: str | None = None) -> list[Any]:
    """The table's columns of a row dataclass's fields, in the dataclass's order; `as_text`: a JSON
    column read as its text (SQLite's as stored, Postgres's `jsonb::text`), not parsed per row: a
    pool's config and a run's overrides are validated from it once per distinct text in the
    process (`convert.pool_config`, `convert.run_overrides`), not on every request (~8 and ~4.5 us
    of parsing and validating, read by every request of a pool or a run)."""
    out = []
    for f in fields(cls):
        if f.name == as_text:
            out.append(sql_cast(table.c[f.name], Text).label(f"{table.name}_{f.name}"))
        elif f.name != "parsed":
            out.append(table.c[f.name])
    return out


_pool_t, _run_t, _lease_t, _batch_t = (cast(Table, m.__table__) for m in (Pool, Run, RunLease, Batch))
#: (statements on the hot path name table columns, not mapped attributes: a statement with a
#: mapped attribute in it is compiled and its result read through the ORM)
_question_t, _traj_t, _run_question_t = (
    cast(Table, m.__table__) for m in (Question, Trajectory, RunQuestion)
)
_POOL_COLS = _columns(_pool_t, PoolRow, as_text="config")
_RUN_COLS = _columns(_run_t, RunRow, as_text="overrides")
_LEASE_COLS = _columns(_lease_t, LeaseRow)
_BATCH_COLS = _columns(_batch_t, BatchRow)
_NP, _NR, _NB = len(_POOL_COLS), len(_RUN_COLS), len(_BATCH_COLS)


def _lease_row(values: Sequence[Any]) -> LeaseRow | None:
    return None if values[0] is None else LeaseRow(*values)


_LEASE_OF_RUN = select(*_LEASE_COLS).where(_lease_t.c.run_id == bindparam("run_id"))


async def get_lease_row(session: Target, run_id: int) -> LeaseRow | None:
    """The run's lease as a plain row (callers hold the run's row lock)."""
    rows = await _core_rows(session, _LEASE_OF_RUN, {"run_id": run_id})
    return LeaseRow(*rows[0]) if rows else None


@functools.cache
def _run_rows_stmt(joined: bool, for_update: bool) -> Select[Any]:
    """`run_rows`'s statement, built once per form (building it is most of a small request's
    statement cost): the pool and run names are bound at execution."""
    source = _run_t.join(_pool_t, _pool_t.c.id == _run_t.c.pool_id)
    cols = [*_POOL_COLS, *_RUN_COLS]
    if joined:
        source = source.outerjoin(_lease_t, _lease_t.c.run_id == _run_t.c.id)
        cols += _LEASE_COLS
    stmt = select(*cols).select_from(source)
    stmt = stmt.where(_pool_t.c.name == bindparam("pool_name"), _run_t.c.name == bindparam("run_name"))
    return stmt.with_for_update(of=_run_t) if for_update else stmt


async def run_rows(
    session: Target, pool_name: str, run_name: str, *, lock: bool = False, lease: bool = False
) -> tuple[PoolRow, RunRow, LeaseRow | None] | None:
    """The pool and the run (None: either does not exist) in one statement, the run row-locked
    for the caller's transaction with `lock`; with `lease` also the run's lease, read after the
    lock. On Postgres that is a second statement: a statement that waited for the lock answers
    the other tables' rows as they were when it started, and a take-over committed meanwhile
    would go unseen. (SQLite serialises writers before their first statement.)"""
    pg = (lock or lease) and _is_pg(session)
    joined = lease and not (lock and pg)
    stmt = _run_rows_stmt(joined, lock and pg)
    rows = await _core_rows(session, stmt, {"pool_name": pool_name, "run_name": run_name})
    if not rows:
        return None
    values = tuple(rows[0])
    run = RunRow(*values[_NP : _NP + _NR])
    found = None
    if joined:
        found = _lease_row(values[_NP + _NR :])
    elif lease:
        found = await get_lease_row(session, run.id)
    return PoolRow(*values[:_NP]), run, found


@functools.cache
def _batch_rows_stmts(lock: bool, pg: bool) -> tuple[Select[Any], Select[Any] | None]:
    """`batch_rows`'s statement, and its second one (None: no second), built once per form; the
    pool name and the batch id are bound at execution. Locked on Postgres: the pool and run,
    row-locked, then the batch and the lease."""
    source = _batch_t.join(_run_t, _run_t.c.id == _batch_t.c.run_id).join(
        _pool_t, _pool_t.c.id == _run_t.c.pool_id
    )
    where = (_batch_t.c.id == bindparam("batch_id"), _pool_t.c.name == bindparam("pool_name"))
    if lock and pg:
        locked = select(*_POOL_COLS, *_RUN_COLS).select_from(source).where(*where).with_for_update(of=_run_t)
        after = select(*_BATCH_COLS, *_LEASE_COLS).select_from(
            _batch_t.outerjoin(_lease_t, _lease_t.c.run_id == _batch_t.c.run_id)
        )
        return locked, after.where(_batch_t.c.id == bindparam("batch_id"))
    cols = [*_POOL_COLS, *_RUN_COLS, *_BATCH_COLS]
    if lock:
        source = source.outerjoin(_lease_t, _lease_t.c.run_id == _run_t.c.id)
        cols += _LEASE_COLS
    return select(*cols).select_from(source).where(*where), None


async def batch_rows(
    session: AsyncSession, pool_name: str, batch_id: str, *, lock: bool = False
) -> tuple[PoolRow, RunRow, BatchRow, LeaseRow | None] | None:
    """A batch of a pool with its run and pool (None: no such batch in that pool). With `lock`
    the run is row-locked and the batch and the run's lease are read after the lock (a second
    statement on Postgres, see `run_rows`): a concurrent commit of the batch that finished while
    this one waited is seen."""
    first, after = _batch_rows_stmts(lock, lock and _is_pg(session))
    rows = await _core_rows(session, first, {"pool_name": pool_name, "batch_id": batch_id})
    if not rows:
        return None
    values = tuple(rows[0])
    if after is not None:
        more = await _core_rows(session, after, {"batch_id": batch_id})
        if not more:
            return None
        values += tuple(more[0])
    b = _NP + _NR
    lease = _lease_row(values[b + _NB :]) if lock else None
    return PoolRow(*values[:_NP]), RunRow(*values[_NP:b]), BatchRow(*values[b : b + _NB]), lease


_POOL_BY_NAME = select(*_POOL_COLS).where(_pool_t.c.name == bindparam("pool_name"))


async def pool_row(session: AsyncSession, name: str) -> PoolRow | None:
    """The pool as a plain row (None: no such pool)."""
    rows = await _core_rows(session, _POOL_BY_NAME, {"pool_name": name})
    return PoolRow(*rows[0]) if rows else None


@functools.cache
def _pool_with_totals_stmt() -> Select[Any]:
    """The pool by name and `pool_totals`'s four counts, in one statement built once."""
    return select(*_POOL_COLS, *_pool_counts(_pool_t.c.id)).where(_pool_t.c.name == bindparam("pool_name"))


async def pool_with_totals(session: Target, name: str) -> tuple[PoolRow, tuple[int, int, int, int]] | None:
    """The pool as a plain row and its (questions, trajectories, runs, payload tokens), from the
    tallies, in one statement (None: no such pool)."""
    rows = await _core_rows(session, _pool_with_totals_stmt(), {"pool_name": name})
    if not rows:
        return None
    values = tuple(rows[0])
    nq, nt, nr, tokens = (int(v) for v in values[_NP:])
    return PoolRow(*values[:_NP]), (nq, nt, nr, tokens)


_RUNS_OF_POOL = select(*_RUN_COLS).where(_run_t.c.pool_id == bindparam("pool_id")).order_by(_run_t.c.id)


async def run_rows_of_pool(session: Target, pool_id: int) -> list[RunRow]:
    """The pool's runs as plain rows, in id order."""
    return [RunRow(*r) for r in await _core_rows(session, _RUNS_OF_POOL, {"pool_id": pool_id})]


async def question_page(session: AsyncSession, pool_name: str, after: int, limit: int) -> list[PageRow]:
    """Up to `limit` of the pool's questions with ids above `after`, in id order, as plain rows
    read by one driver statement that finds the pool by its name too (a page is polled: the pool's
    own read was a second statement, on Postgres a second round trip). No row: no such pool, or
    none left (the caller tells which). Tuples, not objects: the page's answer is written from
    them in one pass (`convert.question_bodies`)."""
    conn = await _connection(session)
    q = _Sql(conn)
    # Postgres: the JSONB columns as their text (asyncpg reads text in C), kept as text for the
    # answer (`_json_text`), not through SQLAlchemy's JSONB codec, a Python call a value (100 a page)
    json_as = "::text" if q.pg else ""
    sql = (
        f"SELECT q.id, q.prompt{json_as}, q.ground_truth, q.data_source, q.external_id, "
        f"q.metadata{json_as}, q.created_at "
        f"FROM question q JOIN pool p ON q.pool_id = p.id WHERE p.name = {q.arg(pool_name)} "
        f"AND q.id > {q.arg(after)} ORDER BY q.id LIMIT {q.arg(limit)}"
    )
    rows = await _driver_rows(conn, sql, q.args)
    prompt: Callable[[Any], Any]
    meta: Callable[[Any], Any]
    if q.pg:
        prompt = meta = _json_text
    else:
        prompt = _result_processor(conn, _question_t.c.prompt) or _as_is
        meta = _result_processor(conn, _question_t.c["metadata"]) or _as_is
    stamp = _stamp(conn) or _as_is
    return [(i, prompt(p), t, source, ext, meta(m), stamp(at)) for i, p, t, source, ext, m, at in rows]


def _json_text(value: str | None) -> Any:
    """A JSONB column read `::text`, to be written into a JSON answer as it is: Postgres writes a
    JSONB value's text itself, always strict JSON (JSONB holds no NaN, no infinity, no NUL), with
    the value's keys in JSONB's order and its own spaces (`{"a": 1}`). The values read back are
    those parsed and written again (`tests/service/test_pools.py`); a page of 50 questions skips
    100 parses and their writes (~64 of ~320 us of the service's call, in process). Only orjson
    writes it (`jsonwrite.dumps`)."""
    return None if value is None else orjson.Fragment(value)


def _as_is(value: Any) -> Any:
    """A column's driver value where SQLAlchemy does nothing to it."""
    return value


async def pool_exists(session: Target, name: str) -> bool:
    runner = session.conn if isinstance(session, Driver) else session
    return (await runner.scalar(select(_pool_t.c.id).where(_pool_t.c.name == name))) is not None


async def update_run(session: AsyncSession, run_id: int, values: dict[str, Any]) -> None:
    await _core_write(session, _update_by(_run_t, "id"), {**values, "where_id": run_id}, tuple(values))


async def update_batch(session: AsyncSession, batch_id: str, values: dict[str, Any]) -> None:
    await _core_write(session, _update_by(_batch_t, "id"), {**values, "where_id": batch_id}, tuple(values))


_BATCH_INSERT = _batch_t.insert()
_BATCH_NAMES = tuple(c.name for c in _BATCH_COLS)


async def insert_batch(session: AsyncSession, batch: BatchRow) -> None:
    await _core_write(session, _BATCH_INSERT, {n: getattr(batch, n) for n in _BATCH_NAMES}, _BATCH_NAMES)


async def extend_lease(session: AsyncSession, run_id: int, expires_at: datetime) -> None:
    params = {"expires_at": expires_at, "where_run_id": run_id}
    await _core_write(session, _update_by(_lease_t, "run_id"), params, ("expires_at",))


# ------------------------------------------------------------------------------------ pools
async def get_pool(session: AsyncSession, name: str) -> Pool | None:
    return (await session.execute(select(Pool).where(Pool.name == name))).scalar_one_or_none()


async def lock_pool(session: AsyncSession, pool_id: int) -> None:
    """Hold the pool's row lock until the transaction ends (a no-op on SQLite)."""
    await session.execute(_locked(session, select(Pool.id).where(Pool.id == pool_id)))


async def list_pools(session: AsyncSession) -> list[Pool]:
    return list((await session.execute(select(Pool).order_by(Pool.id))).scalars())


async def pool_counts(session: AsyncSession, pool_id: int) -> tuple[int, int, int]:
    """(questions, trajectories, runs) of a pool, in one statement."""
    nq, nt, nr, _ = await pool_totals(session, pool_id, tokens=False)
    return nq, nt, nr


async def pool_totals(
    session: AsyncSession, pool_id: int, *, tokens: bool = True
) -> tuple[int, int, int, int]:
    """(questions, trajectories, runs, payload tokens) of a pool in one statement, from the
    tallies (a few rows, whatever the pool's size) and the pool's runs. Without `tokens` 0 is
    returned for the tokens."""
    row = (await session.execute(_pool_totals_stmt(), {"pool_id": pool_id})).one()
    return int(row[0]), int(row[1]), int(row[2]), int(row[3]) if tokens else 0


@functools.cache
def _pool_totals_stmt() -> Select[Any]:
    pool_id: BindParameter[int] = bindparam("pool_id")
    return select(*_pool_counts(pool_id))


def _pool_counts(pool_id: Any) -> list[Any]:
    """A pool's questions, trajectories, runs and payload tokens as four one-row aggregates over
    the tallies and the pool's runs, for the pool `pool_id` (a parameter, or a pool row's column)."""
    qt, tt = question_tally.c, trajectory_tally.c
    counts = (
        select(func.coalesce(func.sum(qt.n), 0)).where(qt.pool_id == pool_id),
        select(func.coalesce(func.sum(tt.n), 0)).where(tt.pool_id == pool_id),
        select(func.count()).select_from(_run_t).where(_run_t.c.pool_id == pool_id),
        select(func.coalesce(func.sum(tt.tokens), 0)).where(tt.pool_id == pool_id),
    )
    return [c.scalar_subquery() for c in counts]


async def pool_tokens(session: AsyncSession, pool_id: int) -> int:
    tt = trajectory_tally.c
    total = await session.scalar(select(func.coalesce(func.sum(tt.tokens), 0)).where(tt.pool_id == pool_id))
    return int(total or 0)


#: the trajectory tally's periods: ten seconds of `created_at` each, counted from the epoch
#: (migration 0014); a run's stats sum its whole periods of the last five minutes from the tally
TALLY_PERIOD_S = 10
#: periods that ended this long ago are folded into their cell's period 0 (`fold_tallies`): far
#: past the five minutes the stats read, so no reader needs a period folded under it
TALLY_FOLD_AFTER = 600
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_PERIOD = timedelta(seconds=TALLY_PERIOD_S)


def tally_period(at: datetime) -> int:
    """The trajectory tally's period of a creation time (a naive time taken as UTC)."""
    return ((at if at.tzinfo is not None else at.replace(tzinfo=UTC)) - _EPOCH) // _PERIOD


def _fold_cut(now: datetime | None) -> int:
    """The first period a fold keeps: those before it ended `TALLY_FOLD_AFTER` ago or earlier."""
    return tally_period((now or datetime.now(UTC)) - timedelta(seconds=TALLY_FOLD_AFTER))


#: each tally: the table it counts, its cell's key columns and its counts, each as the counted
#: rows' expression (what migration 0010's triggers add per row, grouped; `{period}`: the row's
#: period, or 0 where it is folded)
_TALLIES: dict[Table, tuple[str, dict[str, str], dict[str, str]]] = {
    state_tally: (
        "run_question",
        {"scope": "scope", "bucket": "coalesce(bucket, -1)", "retired": "retired"},
        {"n": "count(*)"},
    ),
    trajectory_tally: (
        "trajectory",
        {"pool_id": "pool_id", "run_id": "coalesce(source_run_id, 0)", "period": "{period}"},
        {"n": "count(*)", "tokens": "sum(num_tokens)"},
    ),
    question_tally: ("question", {"pool_id": "pool_id"}, {"n": "count(*)"}),
}


def _counted(table: Table, source: str | None = None, *, fold_before: int | None = None) -> str:
    """The rows a tally counts, a row per cell, in the tally's columns; from `source` (a CTE of
    rows shaped like the counted table's) instead of the whole counted table; with `fold_before`,
    the trajectory tally's periods before it counted in period 0, as a fold leaves them."""
    counted, keys, values = _TALLIES[table]
    period = "period"
    if fold_before is not None:
        period = f"CASE WHEN period < {int(fold_before)} THEN 0 ELSE period END"
    exprs = ", ".join([*keys.values(), *values.values()]).replace("{period}", period)
    groups = ", ".join(str(i + 1) for i in range(len(keys)))
    return f"SELECT {exprs} FROM {source or counted} GROUP BY {groups}"


def _recount(table: Table, source: str | None = None, *, fold_before: int | None = None) -> str:
    """The tally rows of what `_counted` counts."""
    _, keys, values = _TALLIES[table]
    counted = _counted(table, source, fold_before=fold_before)
    return f"INSERT INTO {table.name} ({', '.join([*keys, *values])}) {counted}"


def _unnest(types: Iterable[str]) -> str:
    """`unnest`'s arguments: one Postgres array parameter per column, of the columns' types."""
    return ", ".join(f"${i + 1}::{t}[]" for i, t in enumerate(types))


def tally_trajectories() -> str:
    """The trajectory tally's rows of every stored trajectory, for a database whose trajectories
    were loaded without `insert_trajectories` (which counts its own: there is no INSERT trigger on
    `trajectory`, migrations 0010 and 0013) into an empty trajectory tally; the periods long past
    counted as folded (a tally row per ten seconds of a long history would be read by every stats
    request until the next fold)."""
    return _recount(trajectory_tally, fold_before=_fold_cut(None))


async def fold_tallies(session: AsyncSession, *, now: datetime | None = None) -> int:
    """Fold each tally cell that has more than one row (Postgres adds one per statement that
    changed it) into one row, and drop cells that sum to nothing; fold the trajectory tally's
    periods that ended `TALLY_FOLD_AFTER` before `now` into period 0. How many rows were folded.
    Safe beside writers and other folds: each statement moves the committed rows it deletes into
    their sums, and writers only add rows. SQLite keeps one row per cell (its writers add to it)
    and has one writer at a time: only its periods long past are folded (`_fold_periods_sqlite`;
    an insert folds its run's as it opens a new period)."""
    conn = await _connection(session)
    if conn.dialect.name != "postgresql":
        return await _fold_periods_sqlite(conn, _fold_cut(now))
    # the periods long past become period 0 rows, which the cells' fold below sums with the rest
    folded = await _driver_write(
        conn, "UPDATE trajectory_tally SET period = 0 WHERE period > 0 AND period < $1", (_fold_cut(now),)
    )
    for table, (_, key_exprs, value_exprs) in _TALLIES.items():
        keys, values = list(key_exprs), list(value_exprs)
        key_list = ", ".join(keys)
        sums = ", ".join(f"sum({v})" for v in values)
        nonzero = " OR ".join(f"sum({v}) <> 0" for v in values)
        stmt = text(
            f"WITH gone AS (DELETE FROM {table.name} WHERE ({key_list}) IN ("
            f"SELECT {key_list} FROM {table.name} GROUP BY {key_list} "
            f"HAVING count(*) > 1 OR NOT ({nonzero})) RETURNING *), "
            f"kept AS (INSERT INTO {table.name} ({key_list}, {', '.join(values)}) "
            f"SELECT {key_list}, {sums} FROM gone GROUP BY {key_list} HAVING {nonzero} RETURNING 1) "
            "SELECT (SELECT count(*) FROM gone)"
        )
        folded += int(await session.scalar(stmt) or 0)
    return folded


class TallyDrift(NamedTuple):
    """A tally cell whose counts differ from the rows it counts."""

    tally: str
    cell: dict[str, int]
    kept: dict[str, int]
    counted: dict[str, int]


async def _cells(session: AsyncSession, sql: str, keys: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    rows = await session.execute(text(sql))
    return {tuple(int(v) for v in row[:keys]): tuple(int(v) for v in row[keys:]) for row in rows}


def _folded_cells(
    cells: dict[tuple[int, ...], tuple[int, ...]], at: int, cut: int
) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Tally cells with their periods before `cut` (the key at `at`) summed into period 0."""
    out: dict[tuple[int, ...], tuple[int, ...]] = {}
    for cell, counts in cells.items():
        if cell[at] < cut:
            cell = (*cell[:at], 0, *cell[at + 1 :])
        had = out.get(cell)
        out[cell] = counts if had is None else tuple(a + b for a, b in zip(had, counts, strict=True))
    return out


async def tally_drift(session: AsyncSession, *, now: datetime | None = None) -> list[TallyDrift]:
    """Every tally cell whose counts are not what counting the rows gives (a full count of the
    questions, states and trajectories: a repair's check, not a request's); the trajectory tally's
    periods that a fold at `now` would fold compared as folded."""
    drift: list[TallyDrift] = []
    cut = _fold_cut(now)
    for table, (_, key_exprs, value_exprs) in _TALLIES.items():
        keys, values = list(key_exprs), list(value_exprs)
        sums = ", ".join(f"sum({v})" for v in values)
        summed = f"SELECT {', '.join(keys)}, {sums} FROM {table.name} GROUP BY {', '.join(keys)}"
        kept, counted = [await _cells(session, sql, len(keys)) for sql in (summed, _counted(table))]
        if "period" in keys:  # periods long past compared as folded, whether folded yet or not
            at = keys.index("period")
            kept, counted = (_folded_cells(cells, at, cut) for cells in (kept, counted))
        zero = (0,) * len(values)
        for cell in sorted(kept.keys() | counted.keys()):
            has, should = kept.get(cell, zero), counted.get(cell, zero)
            if has != should:
                drift.append(
                    TallyDrift(
                        table.name,
                        dict(zip(keys, cell, strict=True)),
                        dict(zip(values, has, strict=True)),
                        dict(zip(values, should, strict=True)),
                    )
                )
    return drift


async def recount_tallies(session: AsyncSession) -> list[TallyDrift]:
    """Set every tally that drifted to the counts of its rows; the cells that differed.

    On Postgres the session's transaction must be REPEATABLE READ: the tally rows it deletes and
    the rows it counts are then of one snapshot, and a writer that commits meanwhile keeps the rows
    its statements added to the tallies (invisible to the snapshot, so not deleted), so its changes
    count once, and no writer waits. A fold that deletes the same tally rows waits for the repair,
    or, if it committed first, makes the repair fail with a serialization error (run again)."""
    drift = await tally_drift(session)
    for table in _TALLIES:
        if any(d.tally == table.name for d in drift):
            await session.execute(table.delete())
            await session.execute(text(_recount(table, fold_before=_fold_cut(None))))
    return drift


# -------------------------------------------------------------------------------- questions
async def insert_questions(session: AsyncSession, rows: list[dict[str, Any]]) -> int:
    """Insert, skipping rows whose (pool, content hash) exists. Returns how many were new."""
    inserted = 0
    for chunk in _chunks(rows, 1000):
        stmt = (
            _insert(session, Question)
            .values(list(chunk))
            .on_conflict_do_nothing(index_elements=["pool_id", "content_hash"])
            .returning(Question.id)
        )
        inserted += len((await session.execute(stmt)).all())
    return inserted


async def count_questions(session: AsyncSession, pool_id: int) -> int:
    qt = question_tally.c
    n = await session.scalar(select(func.coalesce(func.sum(qt.n), 0)).where(qt.pool_id == pool_id))
    return int(n or 0)


async def list_questions(session: AsyncSession, pool_id: int, after: int, limit: int) -> list[Question]:
    stmt = (
        select(Question)
        .where(Question.pool_id == pool_id, Question.id > after)
        .order_by(Question.id)
        .limit(limit)
    )
    return list((await session.execute(stmt)).scalars())


async def question_prompts(session: AsyncSession, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The questions of a plan or a selection as their answer shows them: `question_id`,
    `prompt`, `ground_truth` and `data_source`, in that order, a dict per question (the answer's
    item is this dict with its own fields after), read by a driver statement: no mapped object, no
    row object between the driver's row and the answer."""
    conn = await _connection(session)
    prompt = _result_processor(conn, _question_t.c.prompt)
    out: dict[int, dict[str, Any]] = {}
    for chunk in _chunks(sorted(set(ids))):
        q = _Sql(conn)
        sql = f"SELECT id, prompt, ground_truth, data_source FROM question WHERE id {q.ids(chunk)}"
        for qid, value, truth, source in await _driver_rows(conn, sql, q.args):
            out[qid] = _prompt_item(qid, value, truth, source, prompt)
    return out


def _prompt_item(
    qid: int, value: Any, truth: str, source: str, prompt: Callable[[Any], Any] | None
) -> dict[str, Any]:
    """A question as a plan's or a selection's answer shows it, in the answer's key order, from
    its driver values (`prompt`: what SQLAlchemy does to the prompt's, None: nothing)."""
    return {
        "question_id": qid,
        "prompt": value if prompt is None else prompt(value),
        "ground_truth": truth,
        "data_source": source,
    }


async def questions_in_pool(session: AsyncSession, pool_id: int, ids: Sequence[int]) -> set[int]:
    """Which of `ids` are questions of the pool."""
    conn = await _connection(session)
    out: set[int] = set()
    for chunk in _chunks(sorted(set(ids))):
        q = _Sql(conn)
        sql = f"SELECT id FROM question WHERE pool_id = {q.arg(pool_id)} AND id {q.ids(chunk)}"
        out.update(int(qid) for (qid,) in await _driver_rows(conn, sql, q.args))
    return out


async def get_questions(session: AsyncSession, ids: Sequence[int]) -> dict[int, Question]:
    out: dict[int, Question] = {}
    for chunk in _chunks(list(ids)):
        for q in (await session.execute(select(Question).where(Question.id.in_(chunk)))).scalars():
            out[q.id] = q
    return out


async def question_ids_by_hash(
    session: AsyncSession, pool_id: int, hashes: Sequence[bytes]
) -> dict[bytes, int]:
    stmt = select(Question.content_hash, Question.id).where(
        Question.pool_id == pool_id, Question.content_hash.in_(list(hashes))
    )
    return {bytes(h): int(i) for h, i in (await session.execute(stmt))}


async def question_ids(session: AsyncSession, pool_id: int) -> np.ndarray:
    # one aggregated value instead of a million result rows (about 5x faster at 1M questions)
    if _is_pg(session):
        agg = func.array_agg(aggregate_order_by(Question.id, Question.id))
        ids = await session.scalar(select(agg).where(Question.pool_id == pool_id))
        return np.array(ids or [], dtype=np.int64)
    inner = select(Question.id).where(Question.pool_id == pool_id).order_by(Question.id).subquery()
    text_ids = await session.scalar(select(func.group_concat(inner.c.id)))
    return np.sort(np.array(text_ids.split(",") if text_ids else [], dtype=np.int64))


# ------------------------------------------------------------------------------------- runs
async def get_run(session: AsyncSession, pool_id: int, name: str, *, lock: bool = False) -> Run | None:
    stmt = select(Run).where(Run.pool_id == pool_id, Run.name == name)
    if lock:
        stmt = _locked(session, stmt)
    return (await session.execute(stmt)).scalar_one_or_none()


async def get_run_by_id(session: AsyncSession, run_id: int, *, lock: bool = False) -> Run | None:
    stmt = select(Run).where(Run.id == run_id)
    if lock:
        stmt = _locked(session, stmt)
    return (await session.execute(stmt)).scalar_one_or_none()


async def list_runs(session: AsyncSession, pool_id: int | None = None) -> list[Run]:
    stmt = select(Run).order_by(Run.id)
    if pool_id is not None:
        stmt = stmt.where(Run.pool_id == pool_id)
    return list((await session.execute(stmt)).scalars())


async def run_names(session: AsyncSession, run_ids: Iterable[int]) -> dict[int, str]:
    ids = sorted(set(run_ids))
    if not ids:
        return {}
    return dict((await session.execute(select(Run.id, Run.name).where(Run.id.in_(ids)))).all())


async def get_lease(session: AsyncSession, run_id: int) -> RunLease | None:
    """The run's lease row (callers hold the run's row lock)."""
    return await session.get(RunLease, run_id, populate_existing=True)


async def get_epoch(session: AsyncSession, run_id: int, epoch: int) -> np.ndarray | None:
    blob = await session.scalar(
        select(RunEpoch.order).where(RunEpoch.run_id == run_id, RunEpoch.epoch == epoch)
    )
    return None if blob is None else np.frombuffer(blob, dtype="<i8").astype(np.int64)


async def put_epoch(session: AsyncSession, run_id: int, epoch: int, order: np.ndarray) -> None:
    await session.execute(delete(RunEpoch).where(RunEpoch.run_id == run_id))
    session.add(RunEpoch(run_id=run_id, epoch=epoch, order=order.astype("<i8").tobytes()))


# ------------------------------------------------------------------------ run_question states
async def get_states(
    session: AsyncSession, scope: int, qids: Sequence[int]
) -> dict[int, tuple[int | None, bool]]:
    """(bucket, retired) of the questions of one scope that have a state row."""
    conn = await _connection(session)
    out: dict[int, tuple[int | None, bool]] = {}
    for chunk in _chunks(list(qids)):
        q = _Sql(conn)
        sql = (
            "SELECT question_id, bucket, retired FROM run_question "
            f"WHERE scope = {q.arg(scope)} AND question_id {q.ids(chunk)}"
        )
        for qid, bucket, retired in await _driver_rows(conn, sql, q.args):
            out[int(qid)] = (bucket, bool(retired))
    return out


#: what `picked_states` reads of a replay pick: (bucket, retired, stored, question)
PickedState = tuple[int | None, bool, bool, dict[str, Any] | None]


async def picked_states(
    session: AsyncSession,
    scope: int,
    qids: Sequence[int],
    *,
    stored_in: int,
    min_step: int | None = None,
    prompts: bool = False,
) -> dict[int, PickedState]:
    """What an ids-only replay needs of its picks, in one statement: of the questions of `qids`
    that have a state row in `scope`, (bucket, retired) as `get_states` reads them; whether a
    trajectory of the question is stored in `stored_in` (collected at step `min_step` or later) as
    `questions_with_trajectories` tells; and with `prompts` the question as `question_prompts`
    writes it (else None). Three statements before: on Postgres three round trips."""
    conn = await _connection(session)
    prompt = _result_processor(conn, _question_t.c.prompt) if prompts else None
    out: dict[int, PickedState] = {}
    for chunk in _chunks(sorted(set(qids))):
        q = _Sql(conn)
        stored = f"t.question_id = s.question_id AND t.scope = {q.arg(stored_in)}"
        if min_step is not None:
            stored += f" AND t.step >= {q.arg(min_step)}"
        cols, source = "", "run_question s"
        if prompts:
            cols = ", q.prompt, q.ground_truth, q.data_source"
            source += " JOIN question q ON q.id = s.question_id"
        sql = (
            f"SELECT s.question_id, s.bucket, s.retired, EXISTS (SELECT 1 FROM trajectory t WHERE {stored})"
            f"{cols} FROM {source} WHERE s.scope = {q.arg(scope)} AND s.question_id {q.ids(chunk)}"
        )
        for row in await _driver_rows(conn, sql, q.args):
            qid = int(row[0])
            question = _prompt_item(qid, row[4], row[5], row[6], prompt) if prompts else None
            out[qid] = (row[1], bool(row[2]), bool(row[3]), question)
    return out


async def upsert_decided_states(session: AsyncSession, rows: list[dict[str, Any]]) -> None:
    """The states a commit or an ingest decided, in one statement whatever their kinds: a row with
    `retired` retires the question and clears its bucket; a row with a bucket collects it (unless it
    is retired); any other row only records the latest k and step. A retired question never leaves
    the retired set."""
    if not rows:
        return
    conn = await _connection(session)
    if conn.dialect.name == "postgresql" and len({(r["scope"], r["question_id"]) for r in rows}) == len(rows):
        # one statement over arrays: one round trip, and the tallies' statement triggers fire once
        # (a statement per row fired them per row: ~0.2 ms each at 128 rows a commit); in one
        # order for every writer, so two writers of the same states wait instead of deadlocking
        rows = sorted(rows, key=itemgetter("scope", "question_id"))
        await _driver_write(conn, _STATES_UPSERT_PG, [[r[c] for r in rows] for c in _STATE_ARRAY_TYPES])
        return
    # otherwise (SQLite; a question twice on Postgres, which one INSERT cannot upsert twice) one
    # prepared statement run for every row in their order, a later row of a question upserting
    # over an earlier one
    bind = _bound(conn, _run_question_t, list(_STATE_ARRAY_TYPES))
    get = itemgetter(*_STATE_ARRAY_TYPES)
    sql = _STATES_UPSERT_ROW_PG if conn.dialect.name == "postgresql" else _STATES_UPSERT_SQLITE
    await _driver_write(conn, sql, [bind(get(r)) for r in rows], many=True)


#: the columns of a decided state row, with their Postgres array types
_STATE_ARRAY_TYPES = {
    "scope": "bigint",
    "question_id": "bigint",
    "pool_id": "bigint",
    "last_k": "int",
    "bucket": "int",
    "retired": "boolean",
    "last_step": "int",
    "last_run_id": "bigint",
    "updated_at": "timestamptz",
}
#: a decided state over the stored one: a retired question stays retired and has no bucket, a
#: state without a bucket keeps the stored one
_STATES_CONFLICT = (
    "ON CONFLICT (scope, question_id) DO UPDATE SET last_k = excluded.last_k, "
    "last_step = excluded.last_step, last_run_id = excluded.last_run_id, updated_at = excluded.updated_at, "
    "bucket = CASE WHEN excluded.retired THEN NULL WHEN excluded.bucket IS NULL THEN run_question.bucket "
    "WHEN run_question.retired THEN NULL ELSE excluded.bucket END, "
    "retired = run_question.retired OR excluded.retired"
)
_STATES_UPSERT_PG = (
    f"INSERT INTO run_question ({', '.join(_STATE_ARRAY_TYPES)}) "
    f"SELECT * FROM unnest({_unnest(_STATE_ARRAY_TYPES.values())}) {_STATES_CONFLICT}"
)
_STATES_UPSERT_SQLITE = (
    f"INSERT INTO run_question ({', '.join(_STATE_ARRAY_TYPES)}) "
    f"VALUES ({', '.join('?' * len(_STATE_ARRAY_TYPES))}) {_STATES_CONFLICT}"
)
_STATES_UPSERT_ROW_PG = (
    f"INSERT INTO run_question ({', '.join(_STATE_ARRAY_TYPES)}) "
    f"VALUES ({', '.join(f'${i + 1}' for i in range(len(_STATE_ARRAY_TYPES)))}) {_STATES_CONFLICT}"
)


async def bucket_members(session: AsyncSession, scope: int) -> dict[int, list[int]]:
    stmt = (
        select(RunQuestion.bucket, RunQuestion.question_id)
        .where(RunQuestion.scope == scope, RunQuestion.retired.is_(False), RunQuestion.bucket.is_not(None))
        .order_by(RunQuestion.question_id)
    )
    out: dict[int, list[int]] = {}
    for bucket, qid in await session.execute(stmt):
        if bucket is not None:  # the query leaves these out; this tells the type checker
            out.setdefault(int(bucket), []).append(int(qid))
    return out


async def retired_ids(session: AsyncSession, scope: int) -> np.ndarray:
    stmt = select(RunQuestion.question_id).where(RunQuestion.scope == scope, RunQuestion.retired.is_(True))
    return np.fromiter((r[0] for r in await session.execute(stmt)), dtype=np.int64)


async def question_states(session: AsyncSession, qid: int) -> list[RunQuestion]:
    return list((await session.execute(select(RunQuestion).where(RunQuestion.question_id == qid))).scalars())


async def pool_states(
    session: AsyncSession, pool_id: int, after: tuple[int, int], limit: int
) -> list[RunQuestion]:
    stmt = (
        select(RunQuestion)
        .where(
            RunQuestion.pool_id == pool_id,
            or_(
                RunQuestion.scope > after[0],
                and_(RunQuestion.scope == after[0], RunQuestion.question_id > after[1]),
            ),
        )
        .order_by(RunQuestion.scope, RunQuestion.question_id)
        .limit(limit)
    )
    return list((await session.execute(stmt)).scalars())


# ------------------------------------------------------------------------------ trajectories
#: the trajectory columns an insert writes, in order (all but the id; the timestamp last)
_TRAJECTORY_COLUMNS = [c.name for c in Trajectory.__table__.c if c.name not in ("id", "created_at")] + [
    "created_at"
]
#: their Postgres array types, for one INSERT ... SELECT FROM unnest(...) per request
_PG_ARRAY_TYPES = {
    "question_id": "bigint",
    "pool_id": "bigint",
    "scope": "bigint",
    "source_run_id": "bigint",
    "policy_version": "int",
    "step": "int",
    "token_ids": "bytea",
    "logprobs": "bytea",
    "num_tokens": "int",
    "reward": "float8",
    "entropy": "float8",
    "dedup_key": "bytea",
    "text": "text",
    "created_at": "timestamptz",
    "period": "bigint",
}
_TRAJECTORY_CONFLICT = "ON CONFLICT (question_id, scope, dedup_key) DO NOTHING"
#: Postgres: the trajectories over arrays, with the tally rows of what was inserted in the same
#: statement (migration 0010: no INSERT trigger on `trajectory`); how many were new
_TRAJECTORIES_INSERT_PG = (
    f"WITH stored AS (INSERT INTO trajectory ({', '.join(_TRAJECTORY_COLUMNS)}) "
    f"SELECT * FROM unnest({_unnest(_PG_ARRAY_TYPES[c] for c in _TRAJECTORY_COLUMNS)}) "
    f"{_TRAJECTORY_CONFLICT} "
    "RETURNING pool_id, source_run_id, num_tokens, period), "
    f"counted AS ({_recount(trajectory_tally, 'stored')}) "
    "SELECT count(*) FROM stored"
)
#: SQLite: one row's insert, run for every row
_TRAJECTORY_INSERT_SQLITE = (
    f"INSERT INTO trajectory ({', '.join(_TRAJECTORY_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(_TRAJECTORY_COLUMNS))}) {_TRAJECTORY_CONFLICT}"
)
#: SQLite: the largest trajectory id, and the tally's cells of the trajectories above an id
_LAST_TRAJECTORY_SQLITE = "SELECT max(id) FROM trajectory"
_COUNTED_AFTER_SQLITE = (
    "SELECT pool_id, coalesce(source_run_id, 0), period, count(*), sum(num_tokens) FROM trajectory "
    "WHERE id > ? GROUP BY 1, 2, 3"
)
#: SQLite: add (n, tokens) to a cell of the trajectory tally, which holds one row per cell there
_CELL_SQLITE = "pool_id = ? AND run_id = ? AND period = ?"
_BUMP_SQLITE = f"UPDATE OR IGNORE trajectory_tally SET n = n + ?, tokens = tokens + ? WHERE {_CELL_SQLITE}"
_ADD_CELL_SQLITE = (
    "INSERT OR IGNORE INTO trajectory_tally (pool_id, run_id, period, n, tokens) SELECT ?, ?, ?, ?, ? "
    f"WHERE NOT EXISTS (SELECT 1 FROM trajectory_tally WHERE {_CELL_SQLITE})"
)
#: SQLite: the periods long past of the tally (of one pool and run, where the cell is given)
_LONG_PAST_SQLITE = "period > 0 AND period < ?"
_OF_RUN_SQLITE = " AND pool_id = ? AND run_id = ?"


async def _add_to_cell_sqlite(conn: AsyncConnection, cell: tuple[int, int, int], n: int, tokens: int) -> bool:
    """SQLite: add to a trajectory tally cell (pool, run, period); whether it was a new one."""
    if await _driver_write(conn, _BUMP_SQLITE, (n, tokens, *cell)):
        return False
    await _driver_write(conn, _ADD_CELL_SQLITE, (*cell, n, tokens, *cell))
    return True


async def _fold_periods_sqlite(conn: AsyncConnection, cut: int, run: tuple[int, int] | None = None) -> int:
    """SQLite: the trajectory tally's periods before `cut` (of one (pool, run), where given)
    added to their cells' period 0 and removed, with the cells that sum to nothing; how many rows
    were folded or removed. A handful of rows: an insert folds its run's each time it opens a
    period, so they are those of one fold's wait (and of trajectories deleted after their periods
    were folded)."""
    where = _LONG_PAST_SQLITE + (_OF_RUN_SQLITE if run else "")
    args = (cut, *(run or ()))
    sums = "SELECT pool_id, run_id, sum(n), sum(tokens), count(*) FROM trajectory_tally"
    summed = await _driver_rows(conn, f"{sums} WHERE {where} GROUP BY 1, 2", args)
    for pool, run_id, n, tokens, _ in summed:
        await _add_to_cell_sqlite(conn, (int(pool), int(run_id), 0), int(n), int(tokens))
    # the folded rows, and the cells that sum to nothing (their trajectories all deleted)
    gone = f"({where}) OR (n = 0 AND tokens = 0{_OF_RUN_SQLITE if run else ''})"
    return await _driver_write(conn, f"DELETE FROM trajectory_tally WHERE {gone}", (*args, *(run or ())))


async def insert_trajectories(session: AsyncSession, rows: list[dict[str, Any]]) -> int:
    """Insert trajectories, skipping those their scope already holds (same dedup key); returns
    how many were new, counted in the trajectory tally. One driver statement per request: on
    Postgres one INSERT over arrays (`unnest`) that also adds the tally rows of what it stored, on
    SQLite one prepared INSERT run for every row (the driver's executemany), then a tally update
    per cell (no row trigger: migration 0013); no per-row statement building in SQLAlchemy."""
    # one order for every writer (stable: a question's rollouts keep theirs), so two transactions
    # inserting the same trajectories wait for each other instead of deadlocking
    rows = sorted(rows, key=itemgetter("question_id"))
    if not rows:
        return 0
    # the tally's period of each, stored with it (migration 0015): worked out once per creation
    # time, which a request's rows share
    periods: dict[datetime, int] = {}
    for r in rows:
        at = r["created_at"]
        period = periods.get(at)
        if period is None:
            period = periods[at] = tally_period(at)
        r["period"] = period
    conn = await _connection(session)
    if conn.dialect.name == "postgresql":
        columns = [[r[c] for r in rows] for c in _TRAJECTORY_COLUMNS]
        return int((await _driver_rows(conn, _TRAJECTORIES_INSERT_PG, columns))[0][0])
    # bound as SQLAlchemy binds the columns (the timestamps in their text form, once each)
    bind = _bound(conn, _traj_t, _TRAJECTORY_COLUMNS)
    get = itemgetter(*_TRAJECTORY_COLUMNS)
    values = [bind(get(r)) for r in rows]
    # a new row's id is the largest one's + 1 (SQLite's rowid), and the transaction holds the
    # file's write lock: what this insert stored is what lies above the largest id before it
    last = (await _driver_rows(conn, _LAST_TRAJECTORY_SQLITE, ()))[0][0]
    # the driver sums the rows each parameter set inserted (a conflict inserts none)
    stored = await _driver_write(conn, _TRAJECTORY_INSERT_SQLITE, values, many=True)
    cells: dict[tuple[int, int, int], list[int]] = {}
    if stored == len(rows):  # every row new (the usual case): counted from the rows sent
        for r in rows:
            counts = cells.setdefault((r["pool_id"], r["source_run_id"] or 0, r["period"]), [0, 0])
            counts[0] += 1
            counts[1] += r["num_tokens"]
    elif stored:
        for pool, run, period, n, tokens in await _driver_rows(conn, _COUNTED_AFTER_SQLITE, (last or 0,)):
            cells[(int(pool), int(run), int(period))] = [int(n), int(tokens)]
    opened: set[tuple[int, int]] = set()
    for (pool, run, period), (n, tokens) in cells.items():
        if await _add_to_cell_sqlite(conn, (pool, run, period), n, tokens):
            opened.add((pool, run))
    # a run's new period: its periods long past folded now, so its cells stay a few dozen rows
    for cell in opened:
        await _fold_periods_sqlite(conn, _fold_cut(None), cell)
    return stored


async def trajectories_of(
    session: AsyncSession,
    qids: Sequence[int],
    *,
    scope: int | None,
    payload: bool = True,
    text: bool = False,
    only: Sequence[str] | None = None,
) -> dict[int, list[Trajectory]]:
    """The stored trajectories of questions, of one scope (None: of every scope); token ids and
    log-probs with `payload`, the response text with `text`; `only`: just these columns (the
    question id and the id among them), in id order all the same. Plain rows (attribute access
    like the ORM class) read by a driver statement: building ~300 mapped objects per plan was ~15%
    of its time in a profile, and the Core statement's own work half of the rest."""
    out: dict[int, list[Trajectory]] = {q: [] for q in qids}
    skip = ("period",) + (() if payload else ("token_ids", "logprobs", "dedup_key"))
    skip += () if text else ("text",)
    names = [c.name for c in _traj_t.c if c.name not in skip and (only is None or c.name in only)]
    for chunk in _chunks(list(qids)):
        q = _Sql(await _connection(session))
        where = f"question_id {q.ids(chunk)}" + ("" if scope is None else f" AND scope = {q.arg(scope)}")
        for row in await _trajectory_rows(session, names, where, q):
            out[row.question_id].append(row)  # a row read like a Trajectory
    return out


async def questions_with_trajectories(
    session: AsyncSession, qids: Sequence[int], *, scope: int, min_step: int | None = None
) -> set[int]:
    """Which of `qids` have a trajectory stored in `scope` (collected at step `min_step` or later):
    an ids-only selection's questions. One row per question, not one per trajectory; without
    `min_step` read from the trajectories' unique index alone (question, scope, dedup key): on
    SQLite it never touches the rows (one random page each on a pool larger than the page cache:
    1.7 -> 0.4 ms for 64 questions of the seeded 1M pool, when it read the ids)."""
    conn = await _connection(session)
    out: set[int] = set()
    for chunk in _chunks(sorted(set(qids))):
        q = _Sql(conn)
        sql = (
            f"SELECT DISTINCT question_id FROM trajectory WHERE question_id {q.ids(chunk)} "
            f"AND scope = {q.arg(scope)}"
        )
        if min_step is not None:
            sql += f" AND step >= {q.arg(min_step)}"
        out.update(int(qid) for (qid,) in await _driver_rows(conn, sql, q.args))
    return out


async def trajectories_by_id(
    session: AsyncSession, ids: Sequence[int], *, payload: bool = True
) -> dict[int, Any]:
    """Stored trajectories by id (those that still exist), as plain rows; token ids and
    log-probs with `payload`."""
    skip = ("dedup_key", "text", "period") + (() if payload else ("token_ids", "logprobs"))
    names = [c.name for c in _traj_t.c if c.name not in skip]
    out: dict[int, Any] = {}
    for chunk in _chunks(sorted(set(ids))):
        q = _Sql(await _connection(session))
        for row in await _trajectory_rows(session, names, f"id {q.ids(chunk)}", q):
            out[row.id] = row
    return out


@functools.lru_cache(maxsize=4096)  # once per distinct value: a commit's trajectories share theirs
def _sqlite_stamp(value: str | None) -> datetime | None:
    """A SQLite timestamp column's text as SQLAlchemy reads it into `UTCDateTime`, at C speed
    (SQLAlchemy's own processor matches a regular expression per value: half of a 400-row read)."""
    return None if value is None else datetime.fromisoformat(value).replace(tzinfo=UTC)


def _stamp(conn: AsyncConnection) -> Callable[[Any], Any] | None:
    """What a timestamp column's driver value needs to be what SQLAlchemy gives (None: nothing)."""
    if conn.dialect.name == "sqlite":
        return _sqlite_stamp
    return _result_processor(conn, _traj_t.c.created_at)


@functools.cache
def _trajectory_row(names: tuple[str, ...]) -> Any:
    """A named-tuple class of these trajectory columns."""
    return namedtuple("TrajectoryRow", names)


async def _trajectory_rows(session: AsyncSession, names: list[str], where: str, q: _Sql) -> list[Any]:
    """Trajectory rows of `names` in id order, the timestamp as SQLAlchemy would give it."""
    conn = await _connection(session)
    sql = f"SELECT {', '.join(names)} FROM trajectory WHERE {where} ORDER BY id"
    make = _trajectory_row(tuple(names))._make
    rows = await _driver_rows(conn, sql, q.args)
    stamp = _stamp(conn) if "created_at" in names else None
    if stamp is None:
        return [make(r) for r in rows]
    at = names.index("created_at")
    return [make((*r[:at], stamp(r[at]), *r[at + 1 :])) for r in rows]


async def delete_trajectories(session: AsyncSession, scope: int, qids: Sequence[int]) -> int:
    """Remove the trajectories of questions in one scope (retired questions are never replayed)."""
    conn = await _connection(session)
    removed = 0
    for chunk in _chunks(sorted(set(qids))):
        q = _Sql(conn)
        sql = (
            f"DELETE FROM trajectory WHERE scope = {q.arg(scope)} AND question_id {q.ids(chunk)} RETURNING id"
        )
        removed += len(await _driver_rows(conn, sql, q.args))
    return removed


async def trim_trajectories(session: AsyncSession, scope: int, qids: Sequence[int], keep: int) -> int:
    """Keep the newest `keep` trajectories of each question in one scope; remove the rest."""
    removed = 0
    for chunk in _chunks(sorted(set(qids))):
        rank = (
            func.row_number()
            .over(partition_by=Trajectory.question_id, order_by=Trajectory.id.desc())
            .label("rank")
        )
        ranked = (
            select(Trajectory.id, rank)
            .where(Trajectory.scope == scope, Trajectory.question_id.in_(chunk))
            .subquery()
        )
        victims = select(ranked.c.id).where(ranked.c.rank > keep)
        stmt = delete(Trajectory).where(Trajectory.id.in_(victims)).returning(Trajectory.id)
        removed += len((await session.execute(stmt)).all())
    return removed


async def evict_oldest(session: AsyncSession, pool_id: int, num_bytes: int) -> list[tuple[int, int]]:
    """Remove the pool's oldest trajectories (lowest ids) until `num_bytes` of payload (8 bytes per
    token) are freed. Returns the (scope, question id) of each removed one."""
    victims: list[int] = []
    where: list[tuple[int, int]] = []
    freed, after = 0, 0
    while freed < num_bytes:
        stmt = (
            select(Trajectory.id, Trajectory.num_tokens, Trajectory.scope, Trajectory.question_id)
            .where(Trajectory.pool_id == pool_id, Trajectory.id > after)
            .order_by(Trajectory.id)
            .limit(500)
        )
        rows = (await session.execute(stmt)).all()
        if not rows:
            break
        for tid, ntok, scope, qid in rows:
            victims.append(int(tid))
            where.append((int(scope), int(qid)))
            freed += 8 * int(ntok)
            if freed >= num_bytes:
                break
        after = int(rows[-1][0])
    for chunk in _chunks(victims):
        await session.execute(delete(Trajectory).where(Trajectory.id.in_(chunk)))
    return where


async def clear_buckets(
    session: AsyncSession, pool_id: int, qids: Sequence[int], scope: int | None
) -> list[tuple[int, int]]:
    """Take questions out of their buckets (in one state scope, or in every scope of the pool when
    `scope` is None). Returns the (scope, question id) of each state that left a bucket."""
    out: list[tuple[int, int]] = []
    for chunk in _chunks(sorted(set(qids))):
        stmt = (
            update(RunQuestion)
            .where(
                RunQuestion.pool_id == pool_id,
                RunQuestion.question_id.in_(chunk),
                RunQuestion.bucket.is_not(None),
            )
            .values(bucket=None, updated_at=utcnow())
            .returning(RunQuestion.scope, RunQuestion.question_id)
        )
        if scope is not None:
            stmt = stmt.where(RunQuestion.scope == scope)
        out += [(int(s), int(q)) for s, q in (await session.execute(stmt)).all()]
    return out


async def delete_run(session: AsyncSession, run_id: int) -> None:
    """A run and everything it owns: its states and own trajectories (sharing per_run), batches,
    tasks, policy versions, metrics, epoch orders and lease (the last ones by cascade)."""
    await session.execute(delete(RunQuestion).where(RunQuestion.scope == run_id))
    await session.execute(delete(Trajectory).where(Trajectory.scope == run_id))
    await session.execute(delete(Run).where(Run.id == run_id))


async def delete_pool(session: AsyncSession, pool_id: int) -> None:
    """A pool and everything in it (questions, runs, states, trajectories: by cascade)."""
    await session.execute(delete(Pool).where(Pool.id == pool_id))


async def pool_trajectories(session: AsyncSession, pool_id: int, after: int, limit: int) -> list[Trajectory]:
    stmt = (
        select(Trajectory)
        .where(Trajectory.pool_id == pool_id, Trajectory.id > after)
        .order_by(Trajectory.id)
        .limit(limit)
    )
    return list((await session.execute(stmt)).scalars())


#: SQLite on the event loop (the inline driver): a stats statement counts runs' recent
#: trajectories there up to about this many index entries in all (~0.8 ms here); one that needs
#: more is run again in a worker thread, so that the stats of a run ingesting fast (300k
#: trajectories in five minutes at 1k/s: ~11 ms of counting) do not hold up every other request
RECENT_ON_LOOP = 20_000
#: SQLite's virtual machine steps of counting one index entry (~3.4), a statement's own per run
#: beside it (the run's trajectory tally cells, whole and recent, its index seek, its state tally
#: cells: ~140 with eight rollouts a question) and per run's last batch read (~30), as `tests/
#: service/test_run_stats_counts.py` measures them: a statement's budget on the loop is
#: `RECENT_ON_LOOP` entries of counting and its runs' own steps. (A run's state cells are one a
#: bucket and retirement, at most ~2(k + 1) of them on SQLite, whose writers add to a cell's row.)
#: Counted in steps, not with a `LIMIT` on each count: SQLite counts a limited subquery's rows one
#: by one through a co-routine, ~45% slower per entry than its count over the index.
STEPS_PER_ENTRY = 3
STEPS_PER_RUN = 160
STEPS_PER_REPLAY = 40

#: (database, runs) of the stats statements whose last count went past `RECENT_ON_LOOP`: run in
#: the worker thread at once (not on the loop up to the budget first, then again), until a count
#: falls under it. It decides where a statement runs, never what it counts.
_COUNTED_OFF_LOOP: set[tuple[str | None, tuple[int, ...]]] = set()


def _boundary(since: datetime) -> tuple[int, datetime, datetime, int]:
    """What a count from `since` reads besides the tally: (the first whole period summed from the
    tally, the range of `created_at` counted row by row, its sign). `since`'s period is split at
    `since`: the shorter side is counted, subtracted from the whole period when it lies before
    `since`, added to the periods after it when it lies after."""
    first = tally_period(since)
    start = _EPOCH + first * _PERIOD
    end = start + _PERIOD
    if since - start <= end - since:
        return first, start, since, -1
    return first + 1, since, end, 1


class StatsCounts(NamedTuple):
    """What a stats read counts for runs of one pool (`stats_counts`)."""

    #: per state scope: (bucket histogram of eligible questions, retired, seen), from the state tally
    states: dict[int, tuple[dict[int, int], int, int]]
    #: per run: (trajectories it stored, of which since `since`)
    trajectories: dict[int, tuple[int, int]]
    #: per run: how many replayed questions its last committed batch had (0: none committed)
    replayed: dict[int, int]


async def stats_counts(
    session: Target, pool_id: int, scopes: dict[int, int], since: datetime, *, replays: bool = True
) -> StatsCounts:
    """The counts of runs' stats (`scopes`: each run's state scope, by run id) in one statement:

    * each scope's cells of the state tally;
    * each run's trajectories: the total from the trajectory tally, the recent ones from the
      tally's whole periods from `since`'s on, with the rows of part of `since`'s period counted
      over the run's part of the (run, created) index (`_boundary`: at most half a period's rows,
      whatever the run's ingest rate; every row of the five minutes before migrations 0014 and
      0015, 6-9 ms of Postgres, ~1.4 ms of SQLite, for a run ingesting at full speed);
    * with `replays`, each run's replays in its last committed batch, counted by the database in
      the stored plan (its `replay` list): the plans themselves (~6 KB each) are neither sent nor
      parsed. Each run's batches are read from its newest step down (the (run, step) index
      backwards) to the first committed one, however many steps it has made.

    One statement, not one per kind of count: a polled read's statements each cost a cursor, an
    execution and their Python beside SQLite's own work, and a round trip on Postgres. SQLite
    runs it on the loop within a budget (see `RECENT_ON_LOOP`)."""
    ids = sorted(scopes)
    if not ids:
        return StatsCounts({}, {}, {})
    d = await _driver_of(session)
    inline = d.inline
    first, lo, hi, sign = _boundary(since)
    pg = d.pg
    if not pg:  # SQLite compares times as its column's text
        lo, hi = _stamp_text(d.dialect, lo), _stamp_text(d.dialect, hi)
    states = sorted(set(scopes.values()))
    sql = _stats_sql(pg, inline is not None, len(states), len(ids), replays)
    args = [*_ids_args(pg, states), pool_id, *_ids_args(pg, ids), pool_id, *_ids_args(pg, ids), first]
    if replays:
        args += _ids_args(pg, ids)
    if inline is None:  # on Postgres's server, or SQLite's thread driver: off the loop anyway
        args += [*_ids_args(pg, ids), lo, hi]
        rows = list(await d.rows(sql, args))
    else:
        for r in ids:
            args += (r, r, lo, hi)
        statement = (d.database, tuple(ids))
        found: list[Any] | None = None
        try:
            if statement not in _COUNTED_OFF_LOOP:
                own = STEPS_PER_RUN + (STEPS_PER_REPLAY if replays else 0)
                steps = RECENT_ON_LOOP * STEPS_PER_ENTRY + own * len(ids)
                found = await sqlite_inline.fetch_all_within(inline, sql, args, steps)
            if found is None:
                found = await sqlite_inline.fetch_all_off_loop(inline, sql, args)
        except sqlite3.Error as e:
            raise _sqlite_error(sql, args, e) from e
        rows = found
    cells: dict[int, list[Any]] = {sc: [{}, 0, 0] for sc in states}
    stored: dict[int, int] = {}
    lately: dict[int, int] = {}
    replayed: dict[int, int] = {}
    counted = 0  # rows of part of `since`'s period, counted over the index
    for kind, key, bucket, is_retired, total in rows:
        n = int(total or 0)
        if kind == 3:
            if n == 0:
                continue
            c = cells[int(key)]
            c[2] += n
            if is_retired:
                c[1] += n
            elif bucket >= 0:
                c[0][int(bucket)] = c[0].get(int(bucket), 0) + n
        elif kind == 0:
            stored[int(key)] = n
        elif kind == 4:
            replayed[int(key)] = n
        else:  # the part of the first period: added after `since`, subtracted before it
            if kind == 2:
                counted += n
                n *= sign
            lately[int(key)] = lately.get(int(key), 0) + n
    if inline is not None:
        if counted >= RECENT_ON_LOOP:
            if len(_COUNTED_OFF_LOOP) >= 4096:  # statements of runs and pools long gone
                _COUNTED_OFF_LOOP.clear()
            _COUNTED_OFF_LOOP.add(statement)
        else:
            _COUNTED_OFF_LOOP.discard(statement)
    return StatsCounts(
        states={sc: (hist, retired, seen) for sc, (hist, retired, seen) in cells.items()},
        trajectories={r: (stored.get(r, 0), lately.get(r, 0)) for r in ids},
        replayed=replayed,
    )


@functools.lru_cache(maxsize=256)
def _stats_sql(pg: bool, inline: bool, n_states: int, n_ids: int, replays: bool) -> str:
    """`stats_counts`'s statement for its shape, written once (~5 us a request): its parameters
    in the order `stats_counts` gives them. Five columns in every part: (kind, id, bucket,
    retired, count), NULL where a kind has none; the state tally's part first, whose columns give
    Postgres the types of the NULLs after it."""
    q = _Sql(None, pg=pg)
    states, ids = list(range(1, n_states + 1)), list(range(1, n_ids + 1))
    sql = (
        f"SELECT 3, scope, bucket, retired, sum(n) FROM state_tally WHERE scope "
        f"{q.ids(states)} GROUP BY scope, bucket, retired UNION ALL "
        f"SELECT 0, run_id, NULL, NULL, sum(n) FROM trajectory_tally WHERE pool_id = {q.arg(0)} "
        f"AND run_id {q.ids(ids)} GROUP BY run_id UNION ALL "
        f"SELECT 1, run_id, NULL, NULL, sum(n) FROM trajectory_tally WHERE pool_id = {q.arg(0)} "
        f"AND run_id {q.ids(ids)} AND period >= {q.arg(0)} GROUP BY run_id"
    )
    if replays:
        length = "jsonb_array_length(b.plan -> 'replay')" if pg else "json_array_length(b.plan, '$.replay')"
        sql += (
            f" UNION ALL SELECT 4, r.id, NULL, NULL, (SELECT {length} FROM batch b WHERE b.run_id = r.id "
            f"AND b.status = 'committed' ORDER BY b.step DESC LIMIT 1) FROM run r WHERE r.id {q.ids(ids)}"
        )
    if not inline:
        return sql + (
            f" UNION ALL SELECT 2, source_run_id, NULL, NULL, count(*) FROM trajectory WHERE source_run_id "
            f"{q.ids(ids)} AND created_at >= {q.arg(0)} AND created_at < {q.arg(0)} GROUP BY source_run_id"
        )
    # a count per run over its part of the (run, created) index: with `IN (...) GROUP BY` SQLite
    # takes ~2.3x as long (1.4 against 0.62 ms for 34k entries)
    return sql + "".join(
        f" UNION ALL SELECT 2, {q.arg(0)}, NULL, NULL, (SELECT count(*) FROM trajectory WHERE "
        f"source_run_id = {q.arg(0)} AND created_at >= {q.arg(0)} AND created_at < {q.arg(0)})"
        for _ in ids
    )


# ----------------------------------------------------------------------------------- batches
async def get_batch(session: AsyncSession, batch_id: str, *, lock: bool = False) -> Batch | None:
    stmt = select(Batch).where(Batch.id == batch_id)
    if lock:
        stmt = _locked(session, stmt)
    return (await session.execute(stmt)).scalar_one_or_none()


_OPEN_BATCH = (
    select(*_BATCH_COLS)
    .where(_batch_t.c.run_id == bindparam("run_id"), _batch_t.c.step == bindparam("step"))
    .where(_batch_t.c.status == "planned")
    .limit(1)
)


async def open_batch(session: AsyncSession, run_id: int, step: int) -> BatchRow | None:
    rows = await _core_rows(session, _OPEN_BATCH, {"run_id": run_id, "step": step})
    return BatchRow(*rows[0]) if rows else None


# ------------------------------------------------------------------------------------- tasks
async def insert_tasks(session: AsyncSession, rows: list[dict[str, Any]]) -> None:
    if rows:
        await session.execute(_insert(session, Task.__table__), rows)


def _claimable(now: datetime) -> ColumnElement[bool]:
    """Pending, or leased with a lease that ran out."""
    return or_(Task.status == "pending", and_(Task.status == "leased", Task.lease_expires_at < now))


def _lease(
    tasks: list[Task], worker: str, expires_at: datetime, token_factory: Callable[[], str], now: datetime
) -> int:
    """Give `tasks` to `worker`; returns how many were taken over from an expired lease."""
    expired = 0
    for t in tasks:
        if t.status == "leased":
            expired += 1
        t.status = "leased"
        t.worker = worker
        t.lease_token = token_factory()
        t.lease_expires_at = expires_at
        t.attempts += 1
        t.updated_at = now
    return expired


def _skip_locked(session: AsyncSession, stmt: Select[Any]) -> Select[Any]:
    # Postgres: concurrent claimers skip each other's rows instead of waiting on them
    if _is_pg(session):
        return stmt.with_for_update(skip_locked=True)
    return stmt


async def claim_tasks(
    session: AsyncSession,
    run_id: int,
    worker: str,
    limit: int,
    expires_at: datetime,
    token_factory: Callable[[], str],
) -> tuple[list[Task], int]:
    """Lease up to `limit` tasks that are pending or whose lease ran out. Returns the tasks and
    how many of them were taken over from an expired lease."""
    now = utcnow()
    stmt = select(Task).where(Task.run_id == run_id, _claimable(now)).order_by(Task.id).limit(limit)
    tasks = list((await session.execute(_skip_locked(session, stmt))).scalars())
    return tasks, _lease(tasks, worker, expires_at, token_factory, now)


async def claim_pool_tasks(
    session: AsyncSession,
    pool_id: int,
    run_ids: Sequence[int] | None,
    worker: str,
    limit: int,
    expires_at: datetime,
    token_factory: Callable[[], str],
) -> tuple[list[Task], int]:
    """Lease up to `limit` claimable tasks of ONE run of the pool (of `run_ids` when given), all
    with the policy version, exactness and sampling settings of that run's oldest claimable task.
    The run is the one with the fewest live leases, then the one whose oldest claimable task is
    oldest (lowest id). Returns the tasks and how many were taken over from an expired lease."""
    now = utcnow()
    claimable = _claimable(now)
    leased = func.count().filter(and_(Task.status == "leased", Task.lease_expires_at >= now))
    oldest = func.min(case((claimable, Task.id)))
    runs = (
        select(Task.run_id, oldest)
        .join(Run, Run.id == Task.run_id)
        .where(Run.pool_id == pool_id, Task.status.in_(["pending", "leased"]))
        .group_by(Task.run_id)
        .having(oldest.is_not(None))
        .order_by(leased, oldest, Task.run_id)
    )
    if run_ids is not None:
        runs = runs.where(Task.run_id.in_(list(run_ids)))
    for run_id, first_id in (await session.execute(runs)).all():
        # plain values, not a mapped Task: the claim below must load the rows it locks afresh
        first = (
            await session.execute(select(Task.policy_version, Task.policy_exact).where(Task.id == first_id))
        ).one_or_none()
        if first is None:
            continue
        same_sampling = select(Task.sampling).where(Task.id == first_id).scalar_subquery()
        stmt = (
            select(Task)
            .where(
                Task.run_id == run_id,
                claimable,
                Task.policy_version == first.policy_version,
                Task.policy_exact == first.policy_exact,
                # compared as stored (JSON null and SQL NULL alike), not through a bound value
                Task.sampling.is_not_distinct_from(same_sampling),
            )
            .order_by(Task.id)
            .limit(limit)
        )
        tasks = list((await session.execute(_skip_locked(session, stmt))).scalars())
        if tasks:  # else concurrent claimers took this run's tasks meanwhile: the next run
            return tasks, _lease(tasks, worker, expires_at, token_factory, now)
    return [], 0


async def get_task(session: AsyncSession, task_id: int, *, lock: bool = False) -> Task | None:
    stmt = select(Task).where(Task.id == task_id)
    if lock:
        stmt = _locked(session, stmt)
    return (await session.execute(stmt)).scalar_one_or_none()


async def batch_tasks(session: AsyncSession, batch_id: str) -> list[Task]:
    return list(
        (await session.execute(select(Task).where(Task.batch_id == batch_id).order_by(Task.id))).scalars()
    )


async def task_status_counts(session: AsyncSession, batch_id: str) -> dict[str, int]:
    stmt = select(Task.status, func.count()).where(Task.batch_id == batch_id).group_by(Task.status)
    return {s: int(n) for s, n in (await session.execute(stmt))}


async def cancel_batch_tasks(session: AsyncSession, batch_id: str) -> None:
    await session.execute(
        update(Task)
        .where(Task.batch_id == batch_id, Task.status.in_(["pending", "leased"]))
        .values(status="failed", error="batch abandoned", lease_token=None, updated_at=utcnow())
    )


async def queue_depth(session: AsyncSession) -> int:
    n = await session.scalar(select(func.count()).select_from(Task).where(Task.status == "pending"))
    return int(n or 0)


# ------------------------------------------------------------------------------ run metrics
async def merge_run_metrics(session: AsyncSession, run_id: int, step: int, metrics: dict[str, float]) -> None:
    """Add `metrics` to the run's numbers of `step` (a name sent again takes the new value), in
    one statement. Callers hold the run's row lock, which serialises writers of one run."""
    row = {"run_id": run_id, "step": step, "metrics": dict(metrics), "updated_at": utcnow()}
    await _core_write(session, _run_metrics_upsert(_dialect(session)), row, tuple(row))


@functools.cache
def _run_metrics_upsert(dialect: str) -> Any:
    """The statement of `merge_run_metrics`, built once per dialect (every commit runs it)."""
    table = RunMetric.__table__
    ins = _insert_for(dialect, table)
    old, new = table.c.metrics, ins.excluded.metrics
    # the stored object's keys, then the new ones (a JSON object merge on either backend)
    merged = old.op("||", return_type=old.type)(new) if dialect == "postgresql" else func.json_patch(old, new)
    return ins.on_conflict_do_update(
        index_elements=["run_id", "step"], set_={"metrics": merged, "updated_at": ins.excluded.updated_at}
    )


async def run_metrics(session: AsyncSession, run_id: int, after_step: int, limit: int) -> list[RunMetric]:
    stmt = (
        select(RunMetric)
        .where(RunMetric.run_id == run_id, RunMetric.step > after_step)
        .order_by(RunMetric.step)
        .limit(limit)
    )
    return list((await session.execute(stmt)).scalars())


# --------------------------------------------------------------------------- policy versions
async def policy_versions(session: AsyncSession, run_id: int) -> list[PolicyVersion]:
    stmt = select(PolicyVersion).where(PolicyVersion.run_id == run_id).order_by(PolicyVersion.version)
    return list((await session.execute(stmt)).scalars())


async def get_policy_version(session: AsyncSession, run_id: int, version: int) -> PolicyVersion | None:
    return await session.get(PolicyVersion, (run_id, version))


async def policy_uris(session: AsyncSession, pairs: Iterable[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """The uri of each published (run id, version) among `pairs` (unpublished ones are absent)."""
    wanted = sorted(set(pairs))
    out: dict[tuple[int, int], str] = {}
    for run_id in sorted({r for r, _ in wanted}):
        versions = [v for r, v in wanted if r == run_id]
        stmt = select(PolicyVersion.version, PolicyVersion.uri).where(
            PolicyVersion.run_id == run_id, PolicyVersion.version.in_(versions)
        )
        out.update({(run_id, int(v)): uri for v, uri in await session.execute(stmt)})
    return out


async def run_ids_by_name(session: AsyncSession, pool_id: int, names: Sequence[str]) -> dict[str, int]:
    stmt = select(Run.name, Run.id).where(Run.pool_id == pool_id, Run.name.in_(list(set(names))))
    return {str(n): int(i) for n, i in await session.execute(stmt)}


# ------------------------------------------------------------------------------- idempotency
async def get_idempotent(session: AsyncSession, key: str, principal: str) -> IdempotencyKey | None:
    return await session.get(IdempotencyKey, (key, principal))


async def record_idempotent(session: AsyncSession, values: dict[str, Any]) -> None:
    """Record a new key (an IntegrityError if it is recorded already): every column of the table
    in `values`, written by a driver statement (a Core INSERT of a new values clause was built and
    looked up in the statement cache on every request)."""
    conn = await _connection(session)
    q = _Sql(conn)
    names = [c.name for c in _idem_t.c]
    bind = _bound(conn, _idem_t, names)
    marks = ", ".join(q.arg(v) for v in bind([values[n] for n in names]))
    quoted = ", ".join(conn.dialect.identifier_preparer.quote(n) for n in names)  # "key" on SQLite
    await _driver_write(conn, f"INSERT INTO idempotency_key ({quoted}) VALUES ({marks})", q.args)


async def complete_idempotent(
    session: AsyncSession, key: str, principal: str, response: Any, request_hash: str
) -> None:
    """Store the answer, and the request's hash, of a key recorded in this transaction."""
    params = {"response": response, "request_hash": request_hash}
    params |= {"where_key": key, "where_principal": principal}
    await _core_write(session, _IDEM_COMPLETE, params, ("response", "request_hash"))


_idem_t = cast(Table, IdempotencyKey.__table__)
_IDEM_COMPLETE = update(_idem_t).where(
    _idem_t.c.key == bindparam("where_key"), _idem_t.c.principal == bindparam("where_principal")
)
