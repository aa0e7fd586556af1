"""Database engine, sessions and migrations (SQLite file by default, Postgres via asyncpg)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: object) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        # Python's sqlite3 keeps 128 prepared statements per connection; multi-row INSERTs of varying
        # length are each a new statement of ~2 MB, so the default cache grew RSS by ~2 MB per step
        engine = create_async_engine(url, connect_args={"cached_statements": 16})
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


class Database:
    """Owns the engine. `write()` opens one transaction; on SQLite writes are serialised in
    process (SQLite allows one writer at a time and would otherwise answer `database is locked`)."""

    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        self.url = url
        self.engine = make_engine(url, pool_size=pool_size)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._write_lock = asyncio.Lock() if self.is_sqlite else None

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        lock = self._write_lock or contextlib.nullcontext()
        async with lock, self.sessions() as session, session.begin():
            yield session

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as session:
            yield session

    async def close(self) -> None:
        await self.engine.dispose()


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
