"""SQLite's page cache per connection (`sqlite_cache_mb`): a plan reads its candidates' payloads
(~2.6 MB for 64 questions of the benchmark's pool), more than SQLite's default cache of 2 MB holds,
so without a larger one every read of them went back to the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import text

from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings
from exgrpo_pool.store.db import Database

#: SQLite's own default, in KiB (a negative cache_size is KiB, a positive one pages)
SQLITE_DEFAULT_CACHE = -2000


def _read_syscalls() -> int:
    """Read system calls of this process so far (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError("no syscr in /proc/self/io")


async def _reads_of_a_second_pass(db: Database) -> tuple[int, int]:
    """Writes 8 MB of blobs, then reads them all twice in one connection: the cache size it has
    and the read system calls of the second pass."""
    async with db.write() as session:
        await session.execute(text("CREATE TABLE blob (id INTEGER PRIMARY KEY, b BLOB)"))
        for _ in range(32):
            await session.execute(text("INSERT INTO blob (b) VALUES (:b)"), {"b": os.urandom(256 * 1024)})
    await db.settle()  # the pages are in the database file, not in the WAL
    async with db.read() as session:
        size = (await session.execute(text("PRAGMA cache_size"))).scalar_one()
        total = (await session.execute(text("SELECT sum(length(b)) FROM blob"))).scalar_one()
        assert total == 32 * 256 * 1024
        await session.execute(text("SELECT b FROM blob"))
        before = _read_syscalls()
        rows = (await session.execute(text("SELECT b FROM blob"))).all()
        after = _read_syscalls()
    assert len(rows) == 32
    return int(size), after - before


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts read system calls in /proc")
@pytest.mark.parametrize(
    ("cache_mb", "pragma", "cached"),
    [(64, -64 * 1024, True), (0, SQLITE_DEFAULT_CACHE, False)],
    ids=["64 MiB: a second read of 8 MB comes from the cache", "SQLite's default: from the file again"],
)
async def test_a_second_read_of_8_mb(tmp_path: Path, cache_mb: int, pragma: int, cached: bool) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", sqlite_cache_mb=cache_mb)
    try:
        size, reads = await _reads_of_a_second_pass(db)
    finally:
        await db.close()
    assert size == pragma
    # 2,048 pages of 4 KiB: none read again, or (nearly) all of them
    assert reads < 100 if cached else reads > 1000


def test_the_cache_size_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(allow_anonymous=True).sqlite_cache_mb == 64
    monkeypatch.setenv("EXGRPO_SQLITE_CACHE_MB", "256")
    assert Settings(allow_anonymous=True).sqlite_cache_mb == 256
    monkeypatch.setenv("EXGRPO_SQLITE_CACHE_MB", "-1")
    with pytest.raises(ValidationError, match="sqlite_cache_mb"):
        Settings(allow_anonymous=True)


async def test_the_service_connections_take_the_setting(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", allow_anonymous=True, sqlite_cache_mb=16
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app), app.state.ctx.db.read() as session:
        assert (await session.execute(text("PRAGMA cache_size"))).scalar_one() == -16 * 1024
