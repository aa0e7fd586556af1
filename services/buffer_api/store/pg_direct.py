"""The hot path's driver statements on Postgres, run on asyncpg itself under SQLAlchemy's adapter.

Through SQLAlchemy a driver statement (`exec_driver_sql`) passes its execution context, a greenlet
hop each way, the adapter's cursor and a Row per row: on Postgres its layer was a third of the
floor's whole CPU (docs/pool-service-passes.md, eleventh pass). Here a statement takes the adapter's own
steps, in its order: its lock, the transaction it begins where none is open (so the statement is
part of the session's transaction), its cache of prepared statements, then asyncpg's fetch. A
failure goes back to SQLAlchemy (`repo._pg_failed`): the adapter translates it, and the connection
handles it as it handles one of its own statements (a lost connection is invalidated, its error
says so), so the 503 answers and the grouped transactions see what they saw before.

The adapter's parts used here are those of SQLAlchemy 2.1 (`AsyncAdapt_asyncpg_connection`);
`adapter` gives None for an adapter without them, and the statements then go through SQLAlchemy
(`tests/service/test_request_rows.py` pins that the installed version takes this path)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

#: what `fetch_all` and `execute` use of SQLAlchemy's asyncpg adapter
_PARTS = (
    "_execute_mutex",
    "_transaction",
    "_start_transaction",
    "_prepare",
    "_check_type_cache_invalidation",
    "_connection",
    "_handle_exception",
)

_ROWCOUNT = re.compile(r"(?:SELECT|UPDATE|DELETE|INSERT \d+) (\d+)")


def adapter(dbapi_connection: Any) -> Any | None:
    """SQLAlchemy's asyncpg adapter `dbapi_connection`, if it has the parts this module uses."""
    return dbapi_connection if all(hasattr(dbapi_connection, p) for p in _PARTS) else None


async def _prepared(adapt: Any, sql: str, stamp: float) -> Any:
    if adapt._transaction is None:
        await adapt._start_transaction()
    statement, _attributes = await adapt._prepare(sql, stamp)
    return statement


async def fetch_all(adapt: Any, sql: str, args: Sequence[Any], stamp: float) -> list[Any]:
    """The rows of `sql` (asyncpg records: by position, as tuples). `stamp`: the dialect's schema
    cache time, as SQLAlchemy's cursor passes it."""
    async with adapt._execute_mutex:
        statement = await _prepared(adapt, sql, stamp)
        rows: list[Any] = await statement.fetch(*args)
        return rows


async def execute(adapt: Any, sql: str, args: Sequence[Any], stamp: float, *, many: bool = False) -> int:
    """Run `sql` (`many`: once per parameter set in `args`, asyncpg's executemany); the rows it
    changed (-1 for `many`, as SQLAlchemy's cursor gives)."""
    async with adapt._execute_mutex:
        if many:
            await adapt._check_type_cache_invalidation(stamp)
            if adapt._transaction is None:
                await adapt._start_transaction()
            await adapt._connection.executemany(sql, args)
            return -1
        statement = await _prepared(adapt, sql, stamp)
        await statement.fetch(*args)
        found = _ROWCOUNT.match(statement.get_statusmsg() or "")
        return int(found.group(1)) if found else -1
