"""Grouped transactions on Postgres (`Database.transaction(group=...)`): blocks of one key that
wait while the key's transaction is open share the next one, each in its own savepoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_pool.store.db import Database

from .harness import db_execute, db_rows, fresh_pg_database

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def probe_url() -> Iterator[str]:
    """An empty database of its own with one table the blocks write to."""
    with fresh_pg_database("exgrpo_group") as url:
        asyncio.run(db_execute(url, "CREATE TABLE probe (block int PRIMARY KEY, txid bigint NOT NULL)"))
        yield url


@pytest.fixture
def sizes() -> list[int]:
    """The number of blocks of each grouped transaction that committed."""
    return []


@pytest.fixture
async def db(probe_url: str, sizes: list[int]) -> AsyncIterator[Database]:
    await db_execute(probe_url, "TRUNCATE probe")
    database = Database(probe_url, group_max=8)
    database.on_group = sizes.append
    try:
        yield database
    finally:
        await database.close()


class Blocks:
    """Blocks of one group key: the first holds its transaction open until `release()`."""

    def __init__(self, db: Database, key: str = "k") -> None:
        self.db = db
        self.key = key
        self.gate = asyncio.Event()
        #: a holding block has written and waits at the gate (its connection is idle)
        self.holding = asyncio.Event()
        self.entered: list[int] = []

    async def block(
        self, i: int, *, hold: bool = False, fail: bool = False, until: asyncio.Event | None = None
    ) -> int:
        async with self.db.transaction(self.key) as session:
            self.entered.append(i)
            txid = await _write(session, i)
            if hold:
                self.holding.set()
                await self.gate.wait()
            if until is not None:
                await until.wait()
            if fail:
                raise ValueError(f"block {i} fails")
            return txid

    async def waiting(self, n: int) -> None:
        """Until `n` blocks of the key wait for the next transaction."""
        for _ in range(500):
            queue = self.db._groups.get(self.key)
            if queue is not None and len(queue.waiting) == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{n} blocks never waited")

    async def held_back(self, n: int) -> list[int]:
        """The first block holding its transaction open while `n` more wait; the txids of all."""
        first = await self.first_holding()
        rest = [asyncio.create_task(self.block(i)) for i in range(1, n + 1)]
        await self.waiting(n)
        self.gate.set()
        return list(await asyncio.gather(first, *rest))

    async def first_holding(self) -> asyncio.Task[int]:
        """A block that holds its transaction open, once its statements are done: a test that
        cancels the transaction's task must not do it while a statement of the block is still
        running on the connection (under load that left the connection checked out and its
        transaction open, and the next test's TRUNCATE waited for it)."""
        task = asyncio.create_task(self.block(0, hold=True))
        await asyncio.wait_for(self.holding.wait(), 30)
        return task


async def _write(session: AsyncSession, i: int) -> int:
    txid = (await session.execute(text("SELECT txid_current()"))).scalar_one()
    await session.execute(text("INSERT INTO probe VALUES (:b, :t)"), {"b": i, "t": txid})
    return int(txid)


async def _stored(url: str) -> dict[int, int]:
    return {int(b): int(t) for b, t in await db_rows(url, "SELECT block, txid FROM probe")}


async def test_blocks_that_wait_share_the_next_transaction_in_arrival_order(
    db: Database, probe_url: str, sizes: list[int]
) -> None:
    blocks = Blocks(db)
    txids = await blocks.held_back(5)
    assert len(set(txids[1:])) == 1 and txids[0] != txids[1]  # the first alone, then one for all
    assert blocks.entered == [0, 1, 2, 3, 4, 5]
    assert await _stored(probe_url) == dict(enumerate(txids))
    assert sizes == [1, 5]
    assert not db._groups  # nothing left behind


async def test_a_block_that_raises_is_undone_alone(db: Database, probe_url: str) -> None:
    blocks = Blocks(db)
    first = await blocks.first_holding()
    rest = [asyncio.create_task(blocks.block(i, fail=i == 2)) for i in range(1, 4)]
    await blocks.waiting(3)
    blocks.gate.set()
    results = await asyncio.gather(first, *rest, return_exceptions=True)
    assert isinstance(results[2], ValueError)
    assert set(await _stored(probe_url)) == {0, 1, 3}
    assert results[1] == results[3]  # 1 and 3 still committed together


async def test_a_group_of_one_that_raises_rolls_back(db: Database, probe_url: str) -> None:
    with pytest.raises(ValueError):
        await Blocks(db).block(7, fail=True)
    assert await _stored(probe_url) == {}


async def test_a_block_sees_what_the_blocks_before_it_wrote(db: Database) -> None:
    blocks = Blocks(db)
    first = await blocks.first_holding()
    seen: list[int] = []

    async def count() -> None:
        async with db.transaction("k") as session:
            seen.append((await session.execute(text("SELECT count(*) FROM probe"))).scalar_one())

    rest = [asyncio.create_task(blocks.block(1)), asyncio.create_task(count())]
    await blocks.waiting(2)
    blocks.gate.set()
    await asyncio.gather(first, *rest)
    assert seen == [2]  # 0 committed before, 1 written in this transaction


async def test_at_most_group_max_blocks_share_a_transaction(db: Database, sizes: list[int]) -> None:
    db.group_max = 2
    txids = await Blocks(db).held_back(5)
    assert sizes == [1, 2, 2, 1]
    assert txids[1] == txids[2] != txids[3] == txids[4] != txids[5]


async def test_other_keys_do_not_share(db: Database) -> None:
    blocks, other = Blocks(db, "a"), Blocks(db, "b")
    first = await blocks.first_holding()
    # a block of another key commits while the first key's transaction is held open
    txid = await other.block(9)
    blocks.gate.set()
    assert await first != txid


async def test_a_failed_commit_fails_every_block_and_keeps_nothing(db: Database, probe_url: str) -> None:
    blocks = Blocks(db)
    first = await blocks.first_holding()
    cut = asyncio.Event()
    rest = [asyncio.create_task(blocks.block(i, until=cut if i == 3 else None)) for i in range(1, 4)]
    await blocks.waiting(3)
    blocks.gate.set()
    assert await first
    # block 3 holds the group's transaction open: its connection is cut under it
    while len(blocks.entered) < 4:
        await asyncio.sleep(0.01)
    await db_execute(
        probe_url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'",
    )
    cut.set()
    results = await asyncio.gather(*rest, return_exceptions=True)
    assert all(isinstance(r, DBAPIError) for r in results), results
    assert set(await _stored(probe_url)) == {0}
    # the key takes new blocks afterwards
    assert await blocks.block(5)
    assert set(await _stored(probe_url)) == {0, 5}


async def test_a_block_cancelled_while_it_waits_is_left_out(db: Database, probe_url: str) -> None:
    blocks = Blocks(db)
    first = await blocks.first_holding()
    rest = [asyncio.create_task(blocks.block(i)) for i in range(1, 4)]
    await blocks.waiting(3)
    rest[1].cancel()
    blocks.gate.set()
    results = await asyncio.gather(first, *rest, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    assert set(await _stored(probe_url)) == {0, 1, 3}


async def test_sqlite_writes_each_in_its_own_transaction(tmp_path: object) -> None:
    db = Database(f"sqlite+aiosqlite:///{tmp_path}/g.db", group_max=8)
    try:
        assert db.group_max == 1
        async with db.transaction("k") as session:
            assert (await session.execute(text("SELECT 1"))).scalar_one() == 1
        assert not db._groups
    finally:
        await db.close()


async def test_blocks_waiting_when_the_writer_task_is_cancelled_are_cancelled_too(
    db: Database, probe_url: str
) -> None:
    blocks = Blocks(db)
    first = await blocks.first_holding()
    rest = [asyncio.create_task(blocks.block(i)) for i in range(1, 3)]
    await blocks.waiting(2)
    leader = db._groups["k"].leader
    assert leader is not None
    leader.cancel()  # as when the event loop closes
    blocks.gate.set()
    results = await asyncio.gather(first, *rest, return_exceptions=True)
    assert all(isinstance(r, BaseException) for r in results), results
    assert await _stored(probe_url) == {} and not db._groups


async def test_closing_waits_for_a_group_still_ending(probe_url: str) -> None:
    """A block that raised returns before its transaction has rolled back; closing the database
    right then waits for that, so no connection is left checked out when the engine goes."""
    await db_execute(probe_url, "TRUNCATE probe")
    db = Database(probe_url, group_max=8)
    try:
        with pytest.raises(ValueError):
            await Blocks(db).block(7, fail=True)
    finally:
        await db.close()
    assert not db._groups  # the group's task ended before the engine was disposed
