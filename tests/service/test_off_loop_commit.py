"""The service on SQLite with its hot writes committed in a worker thread answers and stores what
it does with them committed on the loop (`sqlite_inline.OFF_LOOP_COMMIT_ROWS`: 1, every hot
write's commit off the loop, against one no transaction reaches)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from exgrpo_pool.store import sqlite_inline

from .factories import commit_batch, correct_first, make_groups, ok, plan_batch, question_detail, setup_pool
from .harness import Backend, serve

_connect = sqlite3.connect


class _Recording(sqlite3.Connection):
    """Records the thread of every COMMIT of the service's connections."""

    threads: list[int] = []

    def commit(self) -> None:
        _Recording.threads.append(threading.get_ident())
        super().commit()


def _recording_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
    return _connect(*args, factory=_Recording, **kwargs)


async def _work(tmp_path: Path, name: str) -> dict[str, Any]:
    """Plans, commits and ingests of two runs, then what the service answers about them."""
    backend = Backend("sqlite-memory", f"sqlite+aiosqlite:///{tmp_path / f'{name}.db'}", None, "unused")
    seen: dict[str, Any] = {"commits": [], "ingests": []}
    async with serve(backend.settings()) as client:
        await setup_pool(client, "p1", questions=12, runs=("r1", "r2"), phase="mixed")
        for _ in range(3):
            plan = await plan_batch(client, "p1", "r1")
            result = ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: q % 5))))
            seen["commits"].append({k: v for k, v in result.items() if k != "batch_id"})
            body = make_groups(plan, correct_first(lambda q: q % 3))
            seen["ingests"].append(ok(await client.post("/v1/pools/p1/runs/r2/ingest", json=body)))
        for run in ("r1", "r2"):
            stats = ok(await client.get(f"/v1/pools/p1/runs/{run}/stats"))
            seen[f"stats {run}"] = {k: v for k, v in stats.items() if "minute" not in k}
        seen["questions"] = [await question_detail(client, qid, payload=True) for qid in range(1, 13)]
    return _timeless(seen)


def _timeless(value: Any) -> Any:
    """`value` without its timestamps (`*_at`), which two runs of the same work do not share."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if not k.endswith("_at")}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


async def test_hot_writes_committed_in_a_thread_answer_and_store_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite3, "connect", _recording_connect)
    loop_thread = threading.get_ident()
    monkeypatch.setattr(sqlite_inline, "OFF_LOOP_COMMIT_ROWS", 10**9)
    _Recording.threads = []
    on_loop = await _work(tmp_path, "on_loop")
    assert loop_thread in _Recording.threads
    monkeypatch.setattr(sqlite_inline, "OFF_LOOP_COMMIT_ROWS", 1)
    _Recording.threads = []
    off_loop = await _work(tmp_path, "off_loop")
    # every hot write changed a row and committed in a thread (the others are aiosqlite's)
    assert loop_thread not in _Recording.threads
    assert off_loop == on_loop
    assert sum(r["stored_trajectories"] for r in on_loop["ingests"]) > 0
    assert any(q["trajectories"] for q in on_loop["questions"])  # payloads read back and compared
