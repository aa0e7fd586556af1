"""A pool's trajectory count and token total are read from an index alone (migration 0009): they
never read the trajectory rows, whose pages hold the payloads, so pool stats and the payload
capacity check cost the same whatever the payloads weigh."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from sqlalchemy import create_engine, event
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo


def _plans(url: str, sqls: list[str]) -> list[str]:
    engine = create_engine(url.replace("+aiosqlite", ""))
    try:
        with engine.connect() as conn:
            rows = [conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {q}").all() for q in sqls]
        return [" ".join(str(r[-1]) for r in plan) for plan in rows]
    finally:
        engine.dispose()


def _statements(url: str) -> list[str]:
    """The SQL of the repository's pool totals, as run (literal pool id)."""
    seen: list[str] = []

    async def main() -> None:
        engine = create_async_engine(url)

        def grab(_c: object, _cur: object, statement: str, params: object, *_: object) -> None:
            seen.append(statement.replace("?", "1"))

        event.listen(engine.sync_engine, "before_cursor_execute", grab)
        async with AsyncSession(engine) as session:
            await repo.pool_tokens(session, 1)
            await repo.pool_counts(session, 1)
        await engine.dispose()

    asyncio.run(main())
    return seen


def test_pool_totals_are_covered_by_an_index(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    dbmod.upgrade(url)
    sqls = [q for q in _statements(url) if "trajectory" in q]
    assert len(sqls) >= 2, sqls  # the token total and the trajectory count
    for sql, plan in zip(sqls, _plans(url, sqls), strict=True):
        assert "COVERING INDEX" in plan, (sql, plan)
    command.downgrade(dbmod.alembic_config(url), "0008")
    assert any("COVERING INDEX" not in plan for plan in _plans(url, sqls))  # what it was before
