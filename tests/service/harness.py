"""Running the pool service in process: backends, bearer tokens, an HTTP client over ASGI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import redis
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings, TokenGrant

PG_HOST = os.environ.get("EXGRPO_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("EXGRPO_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("EXGRPO_TEST_PG_USER", "postgres")
REDIS_URL = os.environ.get("EXGRPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


async def pg_admin(sql: str) -> None:
    """One statement on the Postgres server's `postgres` database (CREATE / DROP DATABASE)."""
    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database="postgres", timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextlib.contextmanager
def fresh_pg_database(prefix: str) -> Iterator[str]:
    """The URL of an empty Postgres database (not migrated) named `prefix` + a random suffix,
    dropped afterwards. For tests that start service processes of their own (no event loop runs
    here: each statement gets its own)."""
    name = f"{prefix}_{secrets.token_hex(6)}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    """Every Redis key of a service that used this key prefix."""
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


ADMIN_TOKEN = "test-admin-token-0000000001"
READ_TOKEN = "test-read-token-00000000002"
WRITE_P1_TOKEN = "test-write-p1-token-0000003"
WRITE_OTHER_TOKEN = "test-write-other-token-004"

TOKENS = [
    TokenGrant(token=ADMIN_TOKEN, name="admin", scopes=["admin"]),
    TokenGrant(token=READ_TOKEN, name="reader", scopes=["read"]),
    TokenGrant(token=WRITE_P1_TOKEN, name="writer-p1", scopes=["read", "write:p1"]),
    TokenGrant(token=WRITE_OTHER_TOKEN, name="writer-other", scopes=["read", "write:other-pool"]),
]


async def db_execute(database_url: str, *statements: str) -> None:
    """Statements run straight on the service's database, in one transaction (behind its back)."""
    engine = create_async_engine(database_url)
    try:
        async with engine.begin() as conn:
            for sql in statements:
                await conn.execute(text(sql))
    finally:
        await engine.dispose()


async def db_rows(database_url: str, sql: str) -> list[tuple[Any, ...]]:
    """The rows of one statement, read straight from the service's database."""
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            return [tuple(row) for row in (await conn.execute(text(sql))).all()]
    finally:
        await engine.dispose()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass(frozen=True)
class Backend:
    """Where a test's service keeps its state: a database and, optionally, a Redis key prefix."""

    name: str
    database_url: str
    redis_url: str | None
    redis_prefix: str

    @property
    def uses_redis(self) -> bool:
        return self.redis_url is not None

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": self.database_url,
            "redis_url": self.redis_url,
            "redis_prefix": self.redis_prefix,
            "tokens": TOKENS,
            "allow_anonymous": False,
            "log_level": "WARNING",
        }
        values.update(overrides)
        return Settings(**values)


@contextlib.asynccontextmanager
async def serve(settings: Settings, token: str = ADMIN_TOKEN) -> AsyncIterator[httpx.AsyncClient]:
    """A started app (lifespan included) and a client that talks to it with `token`."""
    async with serve_app(settings, token) as (_app, client):
        yield client


@contextlib.asynccontextmanager
async def serve_app(
    settings: Settings, token: str = ADMIN_TOKEN
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """`serve`, with the app (for tests that look at its state while requests are in flight).

    Requests go to the app itself, not to the lifespan manager's wrapper: that wrapper hands every
    request the same `state` dict, so concurrent requests would share `request.state` (a server
    gives each request its own copy)."""
    app = create_app(settings)
    async with (
        LifespanManager(app, startup_timeout=30, shutdown_timeout=30),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
            base_url="http://pool.test",
            headers=bearer(token),
            timeout=60,
        ) as client,
    ):
        yield app, client
