"""A hot read's session is kept with its connection for the next hot read (`Database._warm_read`),
on the inline SQLite driver and on Postgres: the next polled read reuses it and reads what was
written in between; a Postgres connection the server closed while it was kept is dropped, and the
read that would have used it is answered on a fresh one."""

from __future__ import annotations

import asyncio

import pytest

from exgrpo_pool.store import repo

from .factories import import_questions, ok, setup_pool
from .harness import Backend, pg_admin, serve_app


async def test_a_hot_read_reuses_the_kept_session_and_reads_every_write(backend: Backend) -> None:
    async with serve_app(backend.settings()) as (app, client):
        db = app.state.ctx.db
        await setup_pool(client, "p1", questions=6, runs=("r1",))
        ok(await client.get("/v1/pools/p1/questions"))
        kept = list(db._warm)
        assert len(kept) == 1 and repo.held_idle(kept[0]) is True
        first = ok(await client.get("/v1/pools/p1/stats"))
        ok(await client.get("/v1/pools/p1/runs/r1/stats"))
        ok(await client.get("/v1/pools/p1/questions"))
        assert db._warm == kept  # the same session answered them all, and was kept again
        # on SQLite's inline driver the polled stats read on a connection of their own, kept too
        readers = list(db._readers)
        assert len(readers) == (1 if db.hot_engine is not None else 0)
        await import_questions(client, "p1", 3, start=100)
        again = ok(await client.get("/v1/pools/p1/stats"))
        assert again["num_questions"] == first["num_questions"] + 3
        page = ok(await client.get("/v1/pools/p1/questions", params={"limit": 1000}))
        assert page["count"] == 9
        assert db._warm == kept and db._readers == readers


@pytest.mark.parametrize(
    "backend",
    [pytest.param("postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis])],
    indirect=True,
)
async def test_a_kept_postgres_connection_closed_by_the_server_is_dropped(backend: Backend) -> None:
    async with serve_app(backend.settings()) as (app, client):
        db = app.state.ctx.db
        await setup_pool(client, "p1", questions=6)
        want = ok(await client.get("/v1/pools/p1/stats"))
        (kept,) = db._warm
        adapt = repo._asyncpg(kept.info["exgrpo_connection"][1])
        assert adapt is not None
        pid = adapt._connection.get_server_pid()
        await pg_admin(f"SELECT pg_terminate_backend({int(pid)})")
        for _ in range(100):  # until the loop has read the server's goodbye
            if adapt._connection.is_closed():
                break
            await asyncio.sleep(0.02)
        assert repo.held_idle(kept) is False
        assert ok(await client.get("/v1/pools/p1/stats")) == want
        assert len(db._warm) == 1 and db._warm[0] is not kept
        assert ok(await client.get("/v1/pools/p1/runs/r1/stats"))["run"] == "r1"
