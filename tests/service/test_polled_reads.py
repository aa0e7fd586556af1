"""A run's stats and the pool's stats, polled every few seconds by dashboards and trainers, are
read on the hot path's SQLite connections without an ORM session (`Database.polled`): straight on
a connection kept for the next poll. They answer what a read in a session answers, before and
after writes; a pool or run that does not exist is a 404 that leaves no transaction open on a
kept connection; on Postgres they read in a session as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_pool.service import stats
from exgrpo_pool.service.leases import read_run

from .factories import commit_batch, correct_first, make_groups, ok, plan_batch, setup_pool
from .harness import Backend, serve_app

PATHS = ["/v1/pools/p1/stats", "/v1/pools/p1/runs/r1/stats", "/v1/pools/p1/runs/r2/stats"]


async def _in_a_session(app: Any, run: str) -> dict[str, Any]:
    """A run's stats read in an ORM session (the thread driver's), as a commit's answer reads them."""
    ctx = app.state.ctx
    async with ctx.db.read() as session:
        pool, row = await read_run(session, "p1", run)
        return (await stats.runs_stats(ctx, session, pool, [row]))[0]


def _without_rate(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k != "ingest_per_minute"}


@pytest.mark.parametrize("writes", [0, 1, 2])
async def test_sqlite_stats_read_without_a_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: int
) -> None:
    backend = Backend("sqlite-memory", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
    made: list[int] = []
    real_init = AsyncSession.__init__

    def counted(self: AsyncSession, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(AsyncSession, "__init__", counted)
    async with serve_app(backend.settings()) as (app, admin):
        await setup_pool(admin, "p1", questions=12, runs=("r1", "r2"), phase="mixed")
        for _ in range(writes):
            plan = await plan_batch(admin, "p1", "r1")
            ok(await commit_batch(admin, plan, make_groups(plan, correct_first(lambda q: q % 4))))
            body = make_groups(plan, correct_first(lambda q: q % 3))
            ok(await admin.post("/v1/pools/p1/runs/r2/ingest", json=body))
        db = app.state.ctx.db
        for _ in range(3):
            made.clear()
            answers = {}
            for path in PATHS:
                r = await admin.get(path)
                assert r.status_code == 200, (path, r.text)
                answers[path] = r.json()
            assert made == [], "a polled stats read made an ORM session"
            # one connection kept, taken again by every poll, with no transaction left open on it
            assert len(db._readers) == 1
            assert not db._readers[0].conn.in_transaction()
            assert not db._readers[0].inline.in_transaction
        for run in ("r1", "r2"):
            want = await _in_a_session(app, run)
            assert answers[f"/v1/pools/p1/runs/{run}/stats"] == want
            assert [_without_rate(x) for x in answers["/v1/pools/p1/stats"]["runs"] if x["run"] == run] == [
                _without_rate(want)
            ]
        # unknown names: 404s that leave the kept connection as it was
        for path in ("/v1/pools/nope/stats", "/v1/pools/p1/runs/nope/stats", "/v1/pools/nope/runs/r1/stats"):
            r = await admin.get(path)
            assert r.status_code == 404, (path, r.text)
        assert all(not d.conn.in_transaction() and not d.inline.in_transaction for d in db._readers)
        assert (await admin.get(PATHS[1])).json() == answers[PATHS[1]]


async def test_stats_answer_as_a_session_reads_them(backend: Backend) -> None:
    """On either backend the polled answer is the session's, with writes in between."""
    async with serve_app(backend.settings()) as (app, admin):
        await setup_pool(admin, "p1", questions=8, runs=("r1",), phase="mixed")
        for step in range(2):
            plan = await plan_batch(admin, "p1", "r1")
            ok(
                await commit_batch(
                    admin, plan, make_groups(plan, correct_first(lambda q, s=step: (q + s) % 4))
                )
            )
            got = (await admin.get("/v1/pools/p1/runs/r1/stats")).json()
            assert got == await _in_a_session(app, "r1")
            assert got["step"] == step + 1
