"""A SQLite file whose write lock another program holds (a backup, `sqlite3` in a shell) past the
wait: the request is answered 503 with Retry-After, like a database that cannot be reached, not
500, and it changed nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from exgrpo_pool.store import sqlite_inline

from .factories import ok, plan_batch, setup_pool
from .harness import Backend, serve


async def test_a_plan_while_another_program_holds_the_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_inline, "BUSY_WAIT_S", 0.2)
    path = tmp_path / "pool.db"
    backend = Backend("sqlite-memory", f"sqlite+aiosqlite:///{path}", None, "unused")
    async with serve(backend.settings()) as client:
        await setup_pool(client, runs=("r1", "r2"))
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            r = await client.post("/v1/pools/p1/runs/r1/batches", json={})
            assert r.status_code == 503, r.text
            assert r.headers.get("retry-after")
            assert "database" in r.json()["detail"]
        finally:
            other.execute("ROLLBACK")
            other.close()
        # nothing of the refused plan stayed: r1's first plan is as r2's, which was never refused
        plan = await plan_batch(client, run="r1")
        fresh = await plan_batch(client, run="r2")
        assert plan["step"] == fresh["step"]
        runs = {r["name"]: r for r in ok(await client.get("/v1/pools/p1/runs"))["data"]}
        assert (runs["r1"]["epoch"], runs["r1"]["cursor"]) == (runs["r2"]["epoch"], runs["r2"]["cursor"])
