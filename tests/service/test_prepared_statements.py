"""The hot path's SQLite statements stay prepared: once a training loop has run a few steps, its
plans, commits, selections and polled reads prepare no statement again. SQLite parses and plans a
statement before it runs it (0.1-0.2 ms for a read of 128 ids); `sqlite3` keeps prepared ones in a
cache per connection, which helps only while the texts are few: a list of ids is one mark per id,
so each length of a list was a statement of its own (a commit's removal of its retired questions'
trajectories had a new one most of the time), and a cache of 16 lost the fixed ones to them.

SQLite asks a connection's authorizer about a statement while it prepares it, never when a
prepared one runs again: the authorizer counts the preparations."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from exgrpo_pool.config import Settings
from exgrpo_pool.store import db as db_module
from exgrpo_pool.store import repo

from .factories import make_groups, ok, plan_batch, setup_pool
from .harness import TOKENS, serve

K = 4
BATCH = 16


def _counting_creator(prepared: list[str]) -> Callable[..., Any]:
    """`sqlite_inline.creator` whose connections report each statement they prepare."""
    original = db_module.sqlite_inline_creator

    def creator(database: str, *, cached_statements: int) -> Callable[[], Any]:
        connect = original(database, cached_statements=cached_statements)

        async def counted() -> Any:
            conn = await connect()

            def authorize(action: int, arg1: str | None, arg2: str | None, *_: Any) -> int:
                # BEGIN and COMMIT are prepared for each transaction (`sqlite3` runs its COMMIT
                # uncached): no plan to make, nothing to keep
                if action != sqlite3.SQLITE_TRANSACTION:
                    prepared.append(f"{action}:{arg1}:{arg2}")  # SQLite's action code, its table
                return sqlite3.SQLITE_OK

            conn.live().set_authorizer(authorize)
            return conn

        return counted

    return creator


async def _step(client: httpx.AsyncClient, retire: int) -> None:
    """A plan and its commit that retires `retire` of its fresh questions (all K rollouts correct)
    and keeps one correct rollout of every other, then the reads a trainer and a dashboard make."""
    plan = await plan_batch(client, candidates="all")
    fresh = [f["question_id"] for f in plan["fresh"]]
    assert len(fresh) >= retire
    retiring = set(fresh[:retire])
    body = make_groups(plan, lambda q, row: 1.0 if q in retiring or row == 0 else 0.0)
    ok(await client.post(f"/v1/pools/p1/batches/{plan['id']}/commit", json=body))
    ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 4, "candidates": "all"}))
    ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 4, "candidates": "none"}))
    ok(await client.get("/v1/pools/p1/runs/r1/stats"))
    ok(await client.get("/v1/pools/p1/stats"))
    ok(await client.get("/v1/pools/p1/questions", params={"limit": 50}))


async def test_a_training_loop_prepares_no_statement_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared: list[str] = []
    monkeypatch.setattr(db_module, "sqlite_inline_creator", _counting_creator(prepared))
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}",
        tokens=TOKENS,
        allow_anonymous=False,
        log_level="WARNING",
    )
    async with serve(settings) as client:
        await setup_pool(client, questions=600, phase="mixed", k=K, batch_size=BATCH)
        # warm-up: every statement of the loop prepared on the connections it runs on (twice: a
        # connection a write used may be kept by a read afterwards, and the next write open another)
        for retire in (6, 3, 6, 3):
            await _step(client, retire)
        assert prepared, "the authorizer saw no statement: the test measures nothing"
        prepared.clear()
        # between 5 and 8 retired questions (of the 8 fresh ones of a mixed batch) the removal's
        # list of ids is a different length each time, 3-4 another; these steps prepare nothing
        for retire in (5, 7, 8, 4, 3, 6, 8):
            await _step(client, retire)
    assert prepared == [], prepared


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 100, 128, 129, 4999, 5000])
def test_a_list_of_ids_is_marked_to_a_rounded_length_and_stands_for_the_same_set(n: int) -> None:
    q = repo._Sql.__new__(repo._Sql)
    q.pg, q.args = False, []
    values = list(range(10, 10 + n))
    sql = q.ids(values)
    marks = sql.count("?")
    assert marks == repo.id_marks(n) and n <= marks < 2 * n and marks & (marks - 1) == 0
    assert set(q.args) == set(values) and q.args[:n] == values


def test_the_lengths_of_lists_of_ids_are_few() -> None:
    assert len({repo.id_marks(n) for n in range(1, repo._IN_CHUNK + 1)}) <= 14
    assert repo.id_marks(0) == 0
