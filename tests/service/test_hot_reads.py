"""Reads on the hot path on Postgres: autocommit, no BEGIN and ROLLBACK around their statements;
every other read, and a read inside a write's transaction, as before."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_pool.store.db import Database

pytestmark = pytest.mark.postgres


async def _one_transaction(session: AsyncSession) -> bool:
    """Whether two statements of the session run in one transaction (the same transaction id)."""
    first = (await session.execute(text("SELECT txid_current()"))).scalar()
    second = (await session.execute(text("SELECT txid_current()"))).scalar()
    return bool(first == second)


async def test_hot_reads_send_no_begin_and_others_keep_their_transaction(postgres_url: str) -> None:
    db = Database(postgres_url)
    try:
        with db.hot():
            async with db.read() as session:
                assert not await _one_transaction(session)  # each statement stands alone
            # a read joined to a write's transaction stays in it
            async with db.transaction(), db.read() as session:
                assert await _one_transaction(session)
        async with db.read() as session:  # off the hot path: one transaction as before
            assert await _one_transaction(session)
        # the connection the autocommit read used went back to the pool in its usual mode
        async with db.write() as session:
            assert await _one_transaction(session)
    finally:
        await db.close()
