"""Fixtures shared by the test folders: a real pool service on a free loopback port, and a reader
of the JSON lines our processes log; every test leaves the service's log levels as it found them.

`live_server` runs uvicorn with the real app (SQLite in a temporary folder, anonymous access,
which the service grants every scope on a loopback bind) in a background thread, once per
session. Tests that use it create pools under unique names, so they do not see each other.

Property tests run without hypothesis's per-example deadline: the suite runs in several processes on
shared machines, and speed is measured in bench/, never asserted in a test.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from log_levels import service_log_levels_kept

settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@dataclass(frozen=True)
class LiveServer:
    url: str
    database_url: str


@contextlib.contextmanager
def run_live_server(database_url: str, **settings: object) -> Iterator[LiveServer]:
    """The app under uvicorn in a thread, on an ephemeral 127.0.0.1 port, until the block ends."""
    from exgrpo_pool.config import Settings
    from exgrpo_pool.embedded import serve_in_thread

    values: dict[str, object] = {"allow_anonymous": True, "log_level": "WARNING", "port": 0, **settings}
    with serve_in_thread(Settings(database_url=database_url, **values)) as srv:  # type: ignore[arg-type]  # Settings checks them
        yield LiveServer(url=srv.url, database_url=database_url)


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    db: Path = tmp_path_factory.mktemp("live-server") / "pool.db"
    with run_live_server(f"sqlite+aiosqlite:///{db}") as server:
        yield server


@pytest.fixture
def start_live_server() -> Callable[..., contextlib.AbstractContextManager[LiveServer]]:
    """`run_live_server` itself, for tests that need a server with their own settings."""
    return run_live_server


@pytest.fixture(autouse=True)
def _service_log_levels() -> Iterator[None]:
    """No test leaves the service's log levels changed for the next (`service_log_levels_kept`)."""
    with service_log_levels_kept():
        yield


@pytest.fixture
def pool_name() -> str:
    """A pool name no other test uses."""
    return f"t-{uuid.uuid4().hex[:10]}"


def _json_events(log: Path) -> list[dict[str, Any]]:
    """The JSON-object lines of a process's log, in order (other lines, half-written ones too, skipped)."""
    out = []
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@pytest.fixture
def json_events() -> Callable[[Path], list[dict[str, Any]]]:
    """Read the structured events a worker or service wrote to its log file."""
    return _json_events
