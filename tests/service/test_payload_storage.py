"""Trajectory payloads are stored out of line without compression on Postgres (migration 0008),
and the migration goes back and forth."""

from __future__ import annotations

import asyncio
import secrets

import asyncpg
import pytest
from alembic import command

from exgrpo_pool.store import db as dbmod

from .harness import PG_HOST, PG_PORT, PG_USER, pg_admin

pytestmark = [pytest.mark.postgres]


async def _storage(url: str) -> dict[str, str]:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        rows = await conn.fetch(
            "SELECT attname, attstorage::text AS attstorage FROM pg_attribute "
            "WHERE attrelid = 'trajectory'::regclass AND attname IN ('token_ids', 'logprobs')"
        )
    finally:
        await conn.close()
    return {r["attname"]: r["attstorage"] for r in rows}


def test_payload_columns_are_external_after_the_migration_and_extended_before() -> None:
    name = f"exgrpo_test_storage_{secrets.token_hex(4)}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    url = f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    try:
        dbmod.upgrade(url, "0007")
        assert asyncio.run(_storage(url)) == {"token_ids": "x", "logprobs": "x"}  # EXTENDED
        dbmod.upgrade(url)
        assert asyncio.run(_storage(url)) == {"token_ids": "e", "logprobs": "e"}  # EXTERNAL
        command.downgrade(dbmod.alembic_config(url), "0007")
        assert asyncio.run(_storage(url)) == {"token_ids": "x", "logprobs": "x"}
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
