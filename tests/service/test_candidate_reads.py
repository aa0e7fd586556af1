"""A selection or plan that sends its replay candidates as ids only (`none`) reads them from the
trajectories' unique index alone when the run has no `max_replay_age` (the only reason to read a
candidate's step): on SQLite each stored row read is a random page read on a pool larger than the
page cache (1.7 ms against 0.4 ms for 64 questions' ~340 candidates of the seeded 1M pool)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from exgrpo_pool.store import sqlite_inline

from .factories import commit_batch, correct_first, make_groups, ok, plan_batch, setup_pool
from .harness import Backend, serve

HALF = correct_first(lambda q: 2)


@pytest.mark.parametrize("max_replay_age", [None, 50])
async def test_candidate_ids_alone_are_read_from_an_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_replay_age: int | None
) -> None:
    plans: list[str] = []
    fetch_all = sqlite_inline.fetch_all

    async def explained(conn: sqlite3.Connection, sql: str, parameters: Sequence[Any]) -> list[Any]:
        if sql.startswith("SELECT") and "FROM trajectory t WHERE t.question_id" in sql:
            rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", parameters).fetchall()
            plans.append(" | ".join(str(r[-1]) for r in rows))
        return await fetch_all(conn, sql, parameters)

    backend = Backend("sqlite-memory", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed", questions=32, max_replay_age=max_replay_age)
        for _ in range(3):
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, HALF)))
        body = {"n": 8, "seed": 3, "candidates": "none"}
        monkeypatch.setattr(sqlite_inline, "fetch_all", explained)
        ids_only = ok(await client.post("/v1/pools/p1/runs/r1/select", json=body))
        monkeypatch.setattr(sqlite_inline, "fetch_all", fetch_all)
        whole = ok(await client.post("/v1/pools/p1/runs/r1/select", json={**body, "candidates": "all"}))
    # the same questions replayed as with every candidate read whole, none of them sent
    assert [q["question_id"] for q in ids_only["replay"]] == [q["question_id"] for q in whole["replay"]]
    assert ids_only["replay"] and all(q["candidates"] == [] for q in ids_only["replay"])
    assert len(plans) == 1, plans
    # the trajectories (`t`, beside the picks' states and questions in the same statement) from
    # their index alone; with a replay age limit each candidate's step is read from its row
    assert "SEARCH t USING INDEX" in plans[0] or "SEARCH t USING COVERING INDEX" in plans[0], plans
    assert ("SEARCH t USING COVERING INDEX" in plans[0]) == (max_replay_age is None), plans
