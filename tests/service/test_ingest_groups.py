"""A run's ingests on Postgres that arrive while its row is locked are written in one transaction
(`ingest_group_max`), each answered as if it had been written alone, in arrival order."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from exgrpo_pool.config import Settings
from exgrpo_pool.store.models import Base

from .factories import create_pool, create_run, group, import_questions, ok, run_stats
from .harness import ADMIN_TOKEN, TOKENS, db_execute, db_rows, serve_app

pytestmark = pytest.mark.postgres

KEY = ("ingest", "p1", "r1")


@pytest.fixture
async def served(postgres_url: str) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    await db_execute(postgres_url, f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
    settings = Settings(database_url=postgres_url, tokens=TOKENS, log_level="WARNING", ingest_group_max=8)
    async with serve_app(settings, ADMIN_TOKEN) as (app, client):
        for pool in ("p1", "p2"):
            await create_pool(client, pool, k=4)
            await import_questions(client, pool, 12)
            await create_run(client, pool, "r1", phase="mixed")
        yield app, client


class RunLock:
    """The row of run p1/r1 locked from a connection of the test's own, as a writer would."""

    def __init__(self, url: str) -> None:
        self.url = url.replace("postgresql+asyncpg://", "postgresql://")
        self.conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> RunLock:
        self.conn = await asyncpg.connect(self.url)
        await self.conn.execute("BEGIN")
        await self.conn.execute(
            "SELECT run.id FROM run JOIN pool ON pool.id = run.pool_id "
            "WHERE pool.name = 'p1' AND run.name = 'r1' FOR UPDATE OF run"
        )
        return self

    async def pid(self) -> int:
        assert self.conn is not None
        return int(await self.conn.fetchval("SELECT pg_backend_pid()"))

    async def release(self) -> None:
        if self.conn is not None and not self.conn.is_closed():
            await self.conn.execute("COMMIT")
            await self.conn.close()

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


async def _until(check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    for _ in range(1000):
        done = check()
        if await done if inspect.isawaitable(done) else done:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def _waiting(app: FastAPI) -> int:
    queue = app.state.ctx.db._groups.get(KEY)
    return 0 if queue is None else len(queue.waiting)


async def _grouped(client: httpx.AsyncClient) -> tuple[float, float]:
    """How many grouped transactions committed and how many ingests they held (/metrics)."""
    text = (await client.get("/metrics")).text
    count = re.search(r"^exgrpo_db_grouped_writes_count (\S+)$", text, re.M)
    total = re.search(r"^exgrpo_db_grouped_writes_sum (\S+)$", text, re.M)
    assert count is not None and total is not None, "the metric is missing"
    return float(count.group(1)), float(total.group(1))


def _bodies(qids: list[int]) -> list[dict[str, Any]]:
    """Six ingests whose effects depend on their order: they share questions, repeat a rollout
    (a duplicate) and solve a question completely (a retirement)."""

    def toks(salt: int) -> Any:
        return lambda q, row: [q, row, salt]

    q = qids
    return [
        {"groups": [group(q[0], [1, 0, 0, 0], toks(0)), group(q[1], [1, 1, 0, 0], toks(0))]},
        {"groups": [group(q[0], [1, 1, 0, 0], toks(0))]},  # row 0 repeats the first ingest's
        {"groups": [group(q[1], [1, 1, 1, 1], toks(1))]},  # retires q1
        {"groups": [group(q[2], [0, 0, 0, 0], toks(0)), group(q[0], [1, 0, 0, 0], toks(2))]},
        {"groups": [group(q[1], [1, 0, 0, 0], toks(3)), group(q[3], [1, 1, 1, 0], toks(0))]},
        {"groups": [group(q[3], [1, 0, 0, 0], toks(0))]},  # a duplicate of q3's first row
    ]


async def _qids(client: httpx.AsyncClient, pool: str) -> list[int]:
    page = ok(await client.get(f"/v1/pools/{pool}/questions", params={"limit": 100}))
    return sorted(q["id"] for q in page["data"])


@pytest.fixture
async def lock(served: tuple[FastAPI, httpx.AsyncClient], postgres_url: str) -> AsyncIterator[RunLock]:
    """The run's lock (once the service has made the run), released at the end of the test
    whatever happened: a lock left held would hold up the next test's TRUNCATE."""
    async with RunLock(postgres_url) as held:
        yield held


async def _held_back(
    app: FastAPI, url: str, lock: RunLock, calls: list[Any]
) -> list[asyncio.Task[httpx.Response]]:
    """With the run's lock held: the first call blocked on it, the others waiting to be written
    together."""
    assert lock.conn is not None and not lock.conn.is_closed()
    holder = await lock.pid()
    first = asyncio.create_task(calls[0]())
    await _until(lambda: _blocked_by(url, holder), "the first ingest waits for the run's lock")
    rest = [asyncio.create_task(c()) for c in calls[1:]]
    await _until(lambda: _waiting(app) == len(rest), f"{len(rest)} ingests wait")
    return [first, *rest]


async def _blocked_by(url: str, pid: int) -> set[int]:
    """The backends that wait for a lock `pid` holds."""
    rows = await db_rows(
        url, f"SELECT pid FROM pg_stat_activity WHERE {int(pid)} = ANY(pg_blocking_pids(pid))"
    )
    return {int(r[0]) for r in rows}


async def _terminate(url: str, pids: set[int]) -> None:
    assert pids, "nothing to cut"
    await db_execute(url, f"SELECT pg_terminate_backend(pid) FROM unnest(ARRAY{sorted(pids)}) AS pid")


def _poster(client: httpx.AsyncClient, pool: str, body: dict[str, Any], key: str | None) -> Any:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return lambda: client.post(f"/v1/pools/{pool}/runs/r1/ingest", json=body, headers=headers)


async def test_waiting_ingests_are_written_together_and_answered_as_one_by_one(
    served: tuple[FastAPI, httpx.AsyncClient], postgres_url: str, lock: RunLock
) -> None:
    app, client = served
    q1, q2 = await _qids(client, "p1"), await _qids(client, "p2")
    # p2: the same ingests one at a time, each in its own transaction
    alone = [ok(await _poster(client, "p2", b, None)()) for b in _bodies(q2)]
    before = await _grouped(client)
    # p1: the first waits for the run's lock, the other five wait for it; half carry keys
    calls = [_poster(client, "p1", b, f"k{i}" if i % 2 else None) for i, b in enumerate(_bodies(q1))]
    tasks = await _held_back(app, postgres_url, lock, calls)
    await lock.release()
    together = [ok(r) for r in await asyncio.gather(*tasks)]
    assert together == alone
    assert (
        sum(r["duplicate_trajectories"] for r in together) >= 2 and sum(r["retired"] for r in together) == 1
    )
    count, total = await _grouped(client)
    assert (count - before[0], total - before[1]) == (2, 6)  # the first alone, then five together

    def comparable(stats: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in stats.items() if k not in ("pool", "run", "created_at", "updated_at")}

    assert comparable(await run_stats(client, "p1")) == comparable(await run_stats(client, "p2"))
    stored = await db_rows(
        postgres_url,
        "SELECT pool.name, count(*) FROM trajectory JOIN question q ON q.id = trajectory.question_id "
        "JOIN pool ON pool.id = q.pool_id GROUP BY pool.name ORDER BY pool.name",
    )
    kept = sum(r["stored_trajectories"] - r["removed_trajectories"] for r in alone)
    assert stored == [("p1", kept), ("p2", kept)] and kept > 0


async def test_in_a_group_a_bad_ingest_fails_alone_and_a_repeated_key_replays(
    served: tuple[FastAPI, httpx.AsyncClient], postgres_url: str, lock: RunLock
) -> None:
    app, client = served
    q = await _qids(client, "p1")
    good = {"groups": [group(q[0], [1, 1, 0, 0])]}
    elsewhere = (await _qids(client, "p2"))[0]  # a question, of another pool
    unknown = {"groups": [group(q[1], [1, 0, 0, 0]), group(elsewhere, [1, 0, 0, 0])]}
    other = {"groups": [group(q[2], [1, 0, 0, 0])]}
    calls = [
        _poster(client, "p1", other, None),
        _poster(client, "p1", good, "same"),
        _poster(client, "p1", unknown, "bad"),
        _poster(client, "p1", good, "same"),  # a retry racing its first attempt
        _poster(client, "p1", other, None),
    ]
    tasks = await _held_back(app, postgres_url, lock, calls)
    await lock.release()
    first, a, bad, again, last = await asyncio.gather(*tasks)
    assert bad.status_code == 422 and "are not in pool" in bad.json()["detail"]
    assert ok(a) == ok(again) and again.headers.get("idempotent-replayed") == "true"
    assert ok(first)["stored_trajectories"] == 1 and ok(last)["duplicate_trajectories"] == 1
    assert ok(a)["stored_trajectories"] == 2
    # the bad ingest left nothing: its key is free for a corrected body, q[1] has no trajectory
    fixed = ok(await _poster(client, "p1", {"groups": unknown["groups"][:1]}, "bad")())
    assert fixed["stored_trajectories"] == 1
    rows = await db_rows(postgres_url, "SELECT question_id FROM trajectory ORDER BY question_id")
    assert [r[0] for r in rows] == [q[0], q[0], q[1], q[2]]


async def test_a_group_whose_connection_dies_answers_each_503_and_retries_land_once(
    served: tuple[FastAPI, httpx.AsyncClient], postgres_url: str, lock: RunLock
) -> None:
    app, client = served
    q = await _qids(client, "p1")
    bodies = [{"groups": [group(q[i], [1, 0, 0, 0])]} for i in range(4)]
    calls = [_poster(client, "p1", b, f"cut{i}") for i, b in enumerate(bodies)]
    tasks = await _held_back(app, postgres_url, lock, calls)
    holder = await lock.pid()
    first = await _blocked_by(postgres_url, holder)
    await _terminate(postgres_url, first)  # the first ingest, alone
    await _until(lambda: _waiting(app) == 0, "the other three are taken together")

    async def others() -> set[int]:
        return await _blocked_by(postgres_url, holder) - first  # not the first, still exiting

    await _until(others, "their transaction waits for the lock")
    await _terminate(postgres_url, await others())
    answers = await asyncio.gather(*tasks)
    assert [r.status_code for r in answers] == [503] * 4, [r.text for r in answers]
    await lock.release()
    assert await db_rows(postgres_url, "SELECT count(*) FROM trajectory") == [(0,)]
    retried = [ok(await c()) for c in calls]
    assert [r["stored_trajectories"] for r in retried] == [1] * 4
    assert await db_rows(postgres_url, "SELECT count(*) FROM trajectory") == [(4,)]


async def test_a_deadlock_inside_a_group_answers_its_ingest_503_and_the_others_commit(
    served: tuple[FastAPI, httpx.AsyncClient], postgres_url: str, lock: RunLock
) -> None:
    """Another service process (played by a connection of the test) holds a request's
    Idempotency-Key and waits for the run's row, which this process's group holds while that key's
    twin waits for the key: Postgres breaks the deadlock by failing one statement. The ingest that
    failed is answered 503 (retry), not 500, and the others of its group commit."""
    app, client = served
    q = await _qids(client, "p1")
    path = "/v1/pools/p1/runs/r1/ingest"
    hashed = hashlib.sha256(f"POST {path}\ntwin".encode()).hexdigest()
    dsn = postgres_url.replace("postgresql+asyncpg://", "postgresql://")
    other, watch = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        # the other process never looks for the deadlock first: the twin's backend does, 1 s
        # (deadlock_timeout) after it began to wait, and the cycle is closed by then
        await other.execute("SET deadlock_timeout = '60s'")
        await other.execute("BEGIN")
        await other.execute(
            "INSERT INTO idempotency_key (key, principal, route, request_hash, status_code, response, "
            "created_at) VALUES ($1, 'admin', $2, '', 200, '{}', now())",
            hashed,
            f"POST {path}",
        )
        calls = [
            _poster(client, "p1", {"groups": [group(q[0], [1, 0, 0, 0])]}, "first"),
            _poster(client, "p1", {"groups": [group(q[1], [1, 0, 0, 0])]}, "kept"),
            _poster(client, "p1", {"groups": [group(q[2], [1, 0, 0, 0])]}, "twin"),
        ]
        tasks = await _held_back(app, postgres_url, lock, calls)
        await lock.release()
        # "kept" and "twin" share the next transaction, which holds the run's row while "twin"
        # waits for its key, that is for the other process (the only backend it can block)
        blocked = "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
        other_pid = await other.fetchval("SELECT pg_backend_pid()")
        for _ in range(5000):
            if await watch.fetchval(blocked, other_pid):
                break
            await asyncio.sleep(0.002)
        else:
            raise AssertionError("the twin never waited for its key")
        await other.execute(
            "SELECT run.id FROM run JOIN pool ON pool.id = run.pool_id "
            "WHERE pool.name = 'p1' AND run.name = 'r1' FOR UPDATE OF run"
        )
        first, kept, twin = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await other.execute("ROLLBACK")
    finally:
        await other.close()
        await watch.close()
    assert ok(first)["stored_trajectories"] == 1 and ok(kept)["stored_trajectories"] == 1
    assert twin.status_code == 503 and twin.headers.get("retry-after") == "1", twin.text
    assert "deadlock" in twin.json()["detail"]
    assert ok(await calls[2]())["stored_trajectories"] == 1  # its retry, with the same key
    rows = await db_rows(postgres_url, "SELECT question_id FROM trajectory ORDER BY question_id")
    assert [r[0] for r in rows] == q[:3]
