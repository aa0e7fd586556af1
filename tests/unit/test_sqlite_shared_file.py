"""Several processes writing one SQLite file (`exgrpo serve --workers N` on SQLite + Redis).

A write block reads, then writes what it read decides. In one process `Database.write()`
serialises the blocks; across processes only SQLite's own lock can. Python's sqlite3 begins the
transaction at the first INSERT/UPDATE/DELETE, so the reads before it see the file as it is, and
another process may commit in between. With `shared_file=True` a write block takes SQLite's write
lock when it begins (BEGIN IMMEDIATE): its reads see the rows it will change.

Two `Database` objects on one file stand for two processes: each has its own engine and its own
in-process lock, and SQLite locks between connections as it does between processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import text

from exgrpo_pool.store.db import Database

ROUNDS = 5


async def _increment(db: Database) -> None:
    async with db.write() as session:
        value = (await session.execute(text("SELECT n FROM counter"))).scalar_one()
        await asyncio.sleep(0.02)  # the other "process" reads meanwhile, unless the lock is held
        await session.execute(text("UPDATE counter SET n = :n"), {"n": value + 1})


async def _count_after_concurrent_increments(path: Path, shared_file: bool) -> int:
    url = f"sqlite+aiosqlite:///{path}"
    first, second = Database(url, shared_file=shared_file), Database(url, shared_file=shared_file)
    try:
        async with first.write() as session:
            await session.execute(text("CREATE TABLE counter (n INTEGER NOT NULL)"))
            await session.execute(text("INSERT INTO counter VALUES (0)"))

        async def rounds(db: Database) -> None:
            for _ in range(ROUNDS):
                await _increment(db)

        await asyncio.gather(rounds(first), rounds(second))
        async with first.read() as session:
            return int((await session.execute(text("SELECT n FROM counter"))).scalar_one())
    finally:
        await first.close()
        await second.close()


async def test_shared_file_writes_do_not_lose_updates(tmp_path: Path) -> None:
    assert await _count_after_concurrent_increments(tmp_path / "pool.db", shared_file=True) == 2 * ROUNDS


async def test_without_it_two_writers_lose_updates(tmp_path: Path) -> None:
    """Why the flag exists: the same blocks, each process reading before the other commits."""
    assert await _count_after_concurrent_increments(tmp_path / "pool.db", shared_file=False) < 2 * ROUNDS


async def test_a_shared_file_write_commits_and_rolls_back(tmp_path: Path) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", shared_file=True)
    try:
        async with db.write() as session:
            await session.execute(text("CREATE TABLE t (n INTEGER)"))
        async with db.write() as session:
            await session.execute(text("INSERT INTO t VALUES (1)"))
        try:
            async with db.write() as session:
                await session.execute(text("INSERT INTO t VALUES (2)"))
                raise RuntimeError("rolled back")
        except RuntimeError:
            pass
        async with db.read() as session:
            assert (await session.execute(text("SELECT n FROM t"))).scalars().all() == [1]
        # a transaction() joins write() and read() into one, as before
        async with db.transaction() as session:
            await session.execute(text("INSERT INTO t VALUES (3)"))
            async with db.read() as inner:
                assert (await inner.execute(text("SELECT count(*) FROM t"))).scalar_one() == 2
    finally:
        await db.close()
