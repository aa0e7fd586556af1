"""Fixtures of the service tests: every test runs once per storage backend.

* ``sqlite-memory``: a SQLite file in the test's tmp_path and the in-process bucket index.
* ``postgres-redis``: the Postgres server on 127.0.0.1:5432 (user postgres, trust auth) and the
  Redis server on 127.0.0.1:6379. One database is created for the test session and dropped at its
  end; its tables are emptied before every test. Each test gets its own Redis key prefix, whose
  keys are deleted afterwards. If either server is down these tests fail (CI starts both).
  EXGRPO_TEST_PG_HOST, EXGRPO_TEST_PG_PORT, EXGRPO_TEST_PG_USER and EXGRPO_TEST_REDIS_URL point
  them elsewhere; ``-m 'not postgres'`` runs the SQLite backend only.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import asyncpg
import httpx
import pytest
import redis

from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store.models import Base

from .harness import PG_HOST, PG_PORT, PG_USER, REDIS_URL, Backend, serve
from .harness import delete_prefix as _delete_prefix
from .harness import pg_admin as _pg_admin

T = TypeVar("T")


def _in_thread(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine on a private event loop in a worker thread (fixtures here are synchronous
    and must not disturb the event loop of the test)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(fn())).result()


def _unreachable(what: str, where: str, err: BaseException) -> NoReturn:
    pytest.fail(
        f"{what} is not reachable at {where} ({type(err).__name__}: {err}). The postgres-redis service "
        f"tests need it running (CI starts it); to run only the SQLite backend use -m 'not postgres'",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated database for the whole session, dropped at its end."""
    name = f"exgrpo_test_{secrets.token_hex(6)}"
    error: BaseException | None = None
    try:
        _in_thread(lambda: _pg_admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError, TimeoutError) as e:
        error = e
    if error is not None:
        _unreachable("Postgres", f"{PG_HOST}:{PG_PORT} (user {PG_USER})", error)
    url = f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    try:
        dbmod.upgrade(url)
        yield url
    finally:
        _in_thread(lambda: _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5, socket_timeout=10)
    error: BaseException | None = None
    try:
        client.ping()
    except redis.RedisError as e:
        error = e
    if error is not None:
        client.close()
        _unreachable("Redis", REDIS_URL, error)
    yield client
    client.close()


async def _truncate(url: str) -> None:
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"), timeout=5)
    try:
        await conn.execute(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
    finally:
        await conn.close()


@pytest.fixture(
    params=[
        pytest.param("sqlite-memory", id="sqlite-memory"),
        pytest.param("postgres-redis", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite-memory":
        yield Backend("sqlite-memory", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
        return
    url: str = request.getfixturevalue("postgres_url")
    client: redis.Redis = request.getfixturevalue("redis_client")
    _in_thread(lambda: _truncate(url))
    prefix = f"exgrpo-test-{secrets.token_hex(6)}"
    try:
        yield Backend("postgres-redis", url, REDIS_URL, prefix)
    finally:
        _delete_prefix(client, prefix)


@pytest.fixture
def redis_direct(backend: Backend, request: pytest.FixtureRequest) -> redis.Redis | None:
    """A plain Redis client on the postgres-redis backend (None on the in-process one)."""
    return request.getfixturevalue("redis_client") if backend.uses_redis else None


@pytest.fixture
async def client(backend: Backend) -> AsyncIterator[httpx.AsyncClient]:
    """An admin client of a service started on the test's backend."""
    async with serve(backend.settings()) as c:
        yield c
