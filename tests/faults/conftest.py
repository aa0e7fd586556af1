"""Fixtures of the fault suite: the storage backends of the service tests (a test runs on SQLite +
the in-process index and on Postgres + Redis), and Postgres with a Redis server of the test's own.

Every module here is marked `faults` (`-m faults` runs the suite alone, `-m 'not faults'` leaves
it out). Its default size is small enough for the normal test command; EXGRPO_FAULT_TRIALS=N runs
the long version (see procs.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from service.conftest import (  # noqa: F401 (fixtures used by the tests here)
    _in_thread,
    _truncate,
    backend,
    client,
    postgres_url,
    redis_client,
    redis_direct,
)
from service.harness import Backend

from .procs import RedisServer


@dataclass(frozen=True)
class OwnRedis:
    """Postgres (emptied for the test) and a Redis server of the test's own, which it may kill,
    restart empty or pause."""

    backend: Backend
    redis: RedisServer


@pytest.fixture
def own_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OwnRedis]:
    url: str = request.getfixturevalue("postgres_url")
    _in_thread(lambda: _truncate(url))
    with RedisServer(tmp_path / "redis") as server:
        yield OwnRedis(Backend("postgres-own-redis", url, server.url, "exgrpo-fault"), server)
