"""SQLite's WAL is copied into the database file in the background after a write, not inside a
later write once it has grown past SQLite's own bound."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text

from exgrpo_pool.store.db import WAL_AUTOCHECKPOINT_PAGES, Database


async def _size_after_write(db: Database, path: Path, payload: bytes) -> tuple[int, int]:
    async with db.write() as session:
        await session.execute(text("CREATE TABLE IF NOT EXISTS blob (id INTEGER PRIMARY KEY, b BLOB)"))
    await db.settle()
    before = path.stat().st_size
    async with db.write() as session:
        await session.execute(text("INSERT INTO blob (b) VALUES (:b)"), {"b": payload})
    await db.settle()
    return before, path.stat().st_size


@pytest.mark.parametrize("inline", [False, True], ids=["thread driver", "inline driver"])
async def test_a_write_reaches_the_database_file_after_it_commits(tmp_path: Path, inline: bool) -> None:
    path = tmp_path / "pool.db"
    db = Database(f"sqlite+aiosqlite:///{path}", sqlite_inline=inline)
    try:
        # 1 MB: far below SQLite's default bound (1,000 pages, 4 MB) and this one
        with db.hot():  # the hot path's writes: inline with that driver
            before, after = await _size_after_write(db, path, os.urandom(1_000_000))
        assert after - before >= 900_000
        async with db.read() as session:
            pages = (await session.execute(text("PRAGMA wal_autocheckpoint"))).scalar_one()
            assert pages == WAL_AUTOCHECKPOINT_PAGES
            # nothing is left for a checkpoint to copy
            busy, log_frames, done = (await session.execute(text("PRAGMA wal_checkpoint(PASSIVE)"))).one()
            assert busy == 0 and log_frames == done
    finally:
        await db.close()


async def test_an_in_memory_database_has_no_checkpoint_task() -> None:
    db = Database("sqlite+aiosqlite://")
    try:
        async with db.write() as session:
            await session.execute(text("SELECT 1"))
        assert db._checkpoint is None
    finally:
        await db.close()


def _open_handles(path: Path) -> int:
    """This process's open file descriptors on `path`."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc (Linux)")
async def test_closing_the_database_leaves_no_handle_on_its_file(tmp_path: Path) -> None:
    path = tmp_path / "pool.db"
    db = Database(f"sqlite+aiosqlite:///{path}", sqlite_inline=True)
    with db.hot():
        await _size_after_write(db, path, os.urandom(100_000))
    assert _open_handles(path) > 0
    await db.close()
    assert _open_handles(path) == 0
