"""What plan, commit, ingest and select read and write in their one transaction: the pool's
config as it stands (changed by another replica included), the writer lease a write extends,
and the 404 of a pool or run that does not exist."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import httpx
import orjson
from sqlalchemy import Engine, event

from exgrpo_client import schemas as s
from exgrpo_pool.store import pg_direct, sqlite_inline

from .factories import B, commit_batch, correct_first, make_groups, ok, plan_batch, setup_pool
from .harness import Backend, db_rows, serve


async def test_a_config_change_by_another_replica_is_seen_by_the_next_plan(backend: Backend) -> None:
    async with serve(backend.settings()) as a, serve(backend.settings()) as b:
        await setup_pool(a)
        assert len((await plan_batch(a))["fresh"]) == B
        ok(await b.patch("/v1/pools/p1", json={"config": {"batch_size": B // 2}}))
        replanned = await plan_batch(a, replan=True)
        assert len(replanned["fresh"]) == B // 2
        # and the other way round, each replica planning after the other's change
        ok(await a.patch("/v1/pools/p1", json={"config": {"batch_size": B}}))
        assert len((await plan_batch(b, replan=True))["fresh"]) == B


async def _lease_expiry(backend: Backend) -> datetime:
    ((value,),) = await db_rows(backend.database_url, "SELECT expires_at FROM run_lease")
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)


async def test_each_write_of_the_holder_extends_its_lease(backend: Backend) -> None:
    async with serve(backend.settings()) as client:
        await setup_pool(client)
        lease = ok(await client.put("/v1/pools/p1/runs/r1/lease", json={"holder": "t", "ttl_s": 600}))
        header = {"X-Run-Lease": f"t:{lease['generation']}"}
        seen = [await _lease_expiry(backend)]
        plan = ok(await client.post("/v1/pools/p1/runs/r1/batches", json={}, headers=header), 201)
        seen.append(await _lease_expiry(backend))
        body = make_groups(plan, correct_first(lambda q: 1))
        ok(await commit_batch(client, plan, body, **header))
        seen.append(await _lease_expiry(backend))
        ingest = {"groups": body["groups"][:2]}
        ok(await client.post("/v1/pools/p1/runs/r1/ingest", json=ingest, headers=header))
        seen.append(await _lease_expiry(backend))
        assert seen == sorted(seen) and len(set(seen)) == len(seen), seen
        # a write without the holder's header is refused and extends nothing
        refused = await client.post("/v1/pools/p1/runs/r1/batches", json={})
        assert refused.status_code == 409
        assert await _lease_expiry(backend) == seen[-1]


async def test_a_missing_pool_run_or_batch_is_a_404_on_the_hot_paths(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    plan = await plan_batch(client)
    groups = make_groups(plan, correct_first(lambda q: 1))
    cases = [
        ("/v1/pools/nope/runs/r1/batches", {}, "pool 'nope' does not exist"),
        ("/v1/pools/p1/runs/nope/batches", {}, "run 'nope' does not exist in pool 'p1'"),
        ("/v1/pools/nope/runs/r1/select", {"n": 1}, "pool 'nope' does not exist"),
        ("/v1/pools/p1/runs/nope/select", {"n": 1}, "run 'nope' does not exist in pool 'p1'"),
        ("/v1/pools/nope/runs/r1/ingest", groups, "pool 'nope' does not exist"),
        ("/v1/pools/p1/runs/nope/ingest", groups, "run 'nope' does not exist in pool 'p1'"),
        (f"/v1/pools/nope/batches/{plan['id']}/commit", groups, "pool 'nope' does not exist"),
        ("/v1/pools/p1/batches/nope/commit", groups, "batch 'nope' does not exist in pool 'p1'"),
    ]
    for path, body, detail in cases:
        r = await client.post(path, json=body, headers={"Idempotency-Key": path})
        assert r.status_code == 404 and detail in r.json()["detail"], (path, r.text)
    for path, detail in [
        (f"/v1/pools/nope/batches/{plan['id']}", "pool 'nope' does not exist"),
        ("/v1/pools/p1/batches/nope", "batch 'nope' does not exist in pool 'p1'"),
    ]:
        r = await client.get(path)
        assert r.status_code == 404 and detail in r.json()["detail"], (path, r.text)


class _Seen(list[str]):
    """Statements run, in order; `through_sqlalchemy`: those that went through SQLAlchemy's
    execution (the rest went to `sqlite3` or to asyncpg directly); `on_asyncpg`: those run on
    asyncpg under SQLAlchemy's adapter (`pg_direct`)."""

    def __init__(self) -> None:
        super().__init__()
        self.through_sqlalchemy: list[str] = []
        self.on_asyncpg: list[str] = []


@contextlib.contextmanager
def _statements() -> Iterator[_Seen]:
    """The SQL statements every engine of this process runs meanwhile for requests, and those the
    hot path sends to `sqlite3` directly: not the WAL checkpoints a SQLite file gets in the
    background after each write."""
    seen = _Seen()

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if not statement.startswith("PRAGMA wal_checkpoint"):
            seen.append(statement)
            seen.through_sqlalchemy.append(statement)

    fetch_all, execute = sqlite_inline.fetch_all, sqlite_inline.execute
    pg_fetch, pg_execute = pg_direct.fetch_all, pg_direct.execute

    async def counted_pg_fetch(adapt: Any, sql: str, args: Sequence[Any], stamp: float) -> list[Any]:
        seen.append(sql)
        seen.on_asyncpg.append(sql)
        return await pg_fetch(adapt, sql, args, stamp)

    async def counted_pg_execute(
        adapt: Any, sql: str, args: Sequence[Any], stamp: float, *, many: bool = False
    ) -> int:
        seen.append(sql)
        seen.on_asyncpg.append(sql)
        return await pg_execute(adapt, sql, args, stamp, many=many)

    async def counted_fetch(conn: sqlite3.Connection, sql: str, parameters: Sequence[Any]) -> list[Any]:
        seen.append(sql)
        return await fetch_all(conn, sql, parameters)

    async def counted_execute(
        conn: sqlite3.Connection, sql: str, parameters: Sequence[Any], *, many: bool = False
    ) -> int:
        seen.append(sql)
        return await execute(conn, sql, parameters, many=many)

    event.listen(Engine, "before_cursor_execute", count)
    sqlite_inline.fetch_all, sqlite_inline.execute = counted_fetch, counted_execute
    pg_direct.fetch_all, pg_direct.execute = counted_pg_fetch, counted_pg_execute
    try:
        yield seen
    finally:
        sqlite_inline.fetch_all, sqlite_inline.execute = fetch_all, execute
        pg_direct.fetch_all, pg_direct.execute = pg_fetch, pg_execute
        event.remove(Engine, "before_cursor_execute", count)


async def test_statements_per_request(backend: Backend) -> None:
    """The statements a steady-state plan, commit, ingest and select run, each in one transaction
    (the idempotency key's record and answer included), pinned: a change that adds one to every
    request is seen. Postgres reads the run's lease after its row lock, one more."""
    pg = backend.name.startswith("postgres")
    half = correct_first(lambda q: 2)  # every group collected: plans and selections replay
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed", questions=64)
        for _ in range(2):  # the first plan also starts the epoch and loads the index
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, half)))
        counts: dict[str, int] = {}
        through_sqlalchemy: dict[str, list[str]] = {}
        on_asyncpg: dict[str, int] = {}
        key = {"Idempotency-Key": "k1"}
        with _statements() as seen:
            r = await client.post("/v1/pools/p1/runs/r1/batches", json={}, headers=key)
        plan, counts["plan"], through_sqlalchemy["plan"] = ok(r, 201), len(seen), seen.through_sqlalchemy
        on_asyncpg["plan"] = len(seen.on_asyncpg)
        assert plan["replay"]
        body = make_groups(plan, half)
        with _statements() as seen:
            ok(await commit_batch(client, plan, body, **key))
        counts["commit"], through_sqlalchemy["commit"] = len(seen), seen.through_sqlalchemy
        on_asyncpg["commit"] = len(seen.on_asyncpg)
        with _statements() as seen:
            ok(await client.post("/v1/pools/p1/runs/r1/ingest", json=body, headers=key))
        counts["ingest"], through_sqlalchemy["ingest"] = len(seen), seen.through_sqlalchemy
        on_asyncpg["ingest"] = len(seen.on_asyncpg)
        with _statements() as seen:
            assert ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 4}))["replay"]
        counts["select"], through_sqlalchemy["select"] = len(seen), seen.through_sqlalchemy
        on_asyncpg["select"] = len(seen.on_asyncpg)
    # plan: key, run (+ lease), open batch, states, candidates, batch, run update, prompts, answer
    # commit: key, run (+ batch and lease), states, state upsert, trajectories, run update,
    # metrics, batch, answer; ingest: key, run (+ lease), questions, states, state upsert,
    # trajectories, answer; select: run, states, candidates, prompts. SQLite counts what it stored
    # in the trajectory tally itself (migration 0013): the largest id before the insert, then the
    # cells of what lies above it (some of the commit's rows are stored already; the ingest sends
    # the same rows and stores none) and the cell's update
    tally = {"commit": 0, "ingest": 0} if pg else {"commit": 3, "ingest": 1}
    assert counts == {
        "plan": 9 + pg,
        "commit": 9 + pg + tally["commit"],
        "ingest": 7 + pg + tally["ingest"],
        "select": 4,
    }, counts
    # SQLite's inline driver runs every one of them on `sqlite3` itself; on Postgres they run on
    # asyncpg itself (the installed SQLAlchemy's adapter has what `pg_direct` uses)
    assert through_sqlalchemy == {name: [] for name in counts}, through_sqlalchemy
    assert on_asyncpg == (counts if pg else dict.fromkeys(counts, 0)), on_asyncpg


async def test_pool_stats_read_every_run_in_the_same_statements(backend: Backend) -> None:
    """A pool's stats read the states, trajectory counts and last batches of all its runs together:
    the statements do not grow with the number of runs, and each run's part is its own stats."""
    half = correct_first(lambda q: 2)
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed", questions=64)
        plan = await plan_batch(client)
        ok(await commit_batch(client, plan, make_groups(plan, half)))
        with _statements() as seen:
            one = ok(await client.get("/v1/pools/p1/stats"))
        alone = len(seen)
        for name in ("r2", "r3", "r4"):
            ok(await client.post("/v1/pools/p1/runs", json={"name": name, "phase": "mixed", "seed": 1}), 201)
            plan = await plan_batch(client, run=name)
            ok(await commit_batch(client, plan, make_groups(plan, half)))
        with _statements() as seen:
            four = ok(await client.get("/v1/pools/p1/stats"))
        # the pool with its totals, its runs, and their states, trajectory counts and last batches'
        # replay counts in one statement
        assert len(seen) == alone == 3, (alone, seen)
        assert [r["run"] for r in four["runs"]] == ["r1", "r2", "r3", "r4"]
        assert four["runs"][0]["replayed_last_step"] == one["runs"][0]["replayed_last_step"]
        for part in four["runs"]:
            assert part == ok(await client.get(f"/v1/pools/p1/runs/{part['run']}/stats"))
        assert four["num_runs"] == 4 and four["num_trajectories"] > one["num_trajectories"] > 0
        assert four["num_tokens"] > one["num_tokens"] > 0


async def test_the_polled_reads_run_on_the_drivers_directly(backend: Backend) -> None:
    """A run's stats, the pool's stats and a page of questions (what dashboards and the trainers
    poll) read like the hot path: each statement pinned, none through SQLAlchemy's execution (on
    SQLite on the event loop's `sqlite3` connection, on Postgres on asyncpg itself), and each
    answers what it did before."""
    pg = backend.name.startswith("postgres")
    half = correct_first(lambda q: 2)
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed", questions=64)
        for _ in range(2):
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, half)))
        counts: dict[str, int] = {}
        through_sqlalchemy: dict[str, list[str]] = {}
        on_asyncpg: dict[str, int] = {}
        answers: dict[str, Any] = {}
        paths = {
            "run stats": "/v1/pools/p1/runs/r1/stats",
            "pool stats": "/v1/pools/p1/stats",
            "questions": "/v1/pools/p1/questions?after=3&limit=5",
            "questions past the end": "/v1/pools/p1/questions?after=64",
        }
        for name, path in paths.items():
            with _statements() as seen:
                answers[name] = ok(await client.get(path))
            counts[name], through_sqlalchemy[name] = len(seen), seen.through_sqlalchemy
            on_asyncpg[name] = len(seen.on_asyncpg)
    # run stats: pool and run, then its states, trajectory counts and last batch's replays in one
    # statement; pool stats: pool with its totals, runs, then their counts in one statement;
    # questions: the page with its pool, and where it is empty, whether the pool exists
    assert counts == {"run stats": 2, "pool stats": 3, "questions": 1, "questions past the end": 2}, counts
    assert through_sqlalchemy == {name: [] for name in counts}, through_sqlalchemy
    assert on_asyncpg == (counts if pg else dict.fromkeys(counts, 0)), on_asyncpg
    stats = answers["run stats"]
    assert stats["run"] == "r1" and stats["step"] == 2 and stats["replayed_last_step"] > 0
    assert stats["eligible"] == sum(b["questions"] for b in stats["buckets"]) > 0
    assert stats["seen"] >= stats["eligible"] + stats["retired"] and stats["trajectories"] > 0
    assert stats["ingest_per_minute"] == stats["trajectories"] / 5.0
    assert answers["pool stats"]["runs"] == [stats]
    assert answers["pool stats"]["num_questions"] == 64 and answers["pool stats"]["num_runs"] == 1
    page = answers["questions"]
    assert [q["id"] for q in page["data"]] == [4, 5, 6, 7, 8] and page["next_after"] == 8
    assert page["count"] == 5 and all(q["pool"] == "p1" and q["prompt"] for q in page["data"])
    assert answers["questions past the end"] == {"data": [], "count": 0, "next_after": None}


async def test_a_page_of_questions_is_written_as_its_model_writes_it(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """The question page is written from the stored rows (the prompts as stored, validated on
    import): on SQLite byte for byte as `QuestionsPublic` writes the same page; on Postgres the
    prompts and the metadata are JSONB's own text (its spaces, its numbers' digits), every value
    the model's."""
    pg = backend.database_url.startswith("postgresql")
    await setup_pool(client, questions=3)
    odd = {
        "prompt": [
            {"role": "system", "content": 'Réponds en français. \u2603 "quoted" \\ back\nslash'},
            {"role": "user", "content": "2 + 2 = ? \U0001f600"},
            {"role": "assistant", "content": ""},
        ],
        "ground_truth": "4",
        "data_source": "odd/source",
        "external_id": None,
        "metadata": {
            "level": 3,
            "tags": ["a", "b"],
            "w": 0.1,
            "big": 2**53 + 1,
            "nested": {"x": None, "y": -1.5e-7},
        },
    }
    ok(await client.post("/v1/pools/p1/questions", json={"questions": [odd]}))
    pages = []
    for params in ({"limit": 1000}, {"limit": 2}, {"after": 2, "limit": 1}):
        r = await client.get("/v1/pools/p1/questions", params=params)
        page = s.QuestionsPublic.model_validate_json(r.content)
        written = page.model_dump_json().encode()
        if pg:
            assert orjson.loads(r.content) == orjson.loads(written), params
            # the prompts and the metadata as JSONB writes them, the rest as the model does
            assert b'"role": "user"' in r.content
            assert (b'"y": -0.00000015' in r.content) == (params == {"limit": 1000})
            assert r.content.startswith(written[: written.index(b'"prompt":')]), params
        else:
            assert r.content == written, params
        assert r.headers["content-type"] == "application/json"
        pages.append(page)
    whole, first, third = pages
    assert whole.data[-1].metadata == odd["metadata"] and whole.data[-1].external_id is None
    assert [q.id for q in whole.data[:3]] == [q.id for q in first.data + third.data]
    assert first.next_after == whole.data[1].id and third.next_after == whole.data[2].id
    assert whole.next_after is None and whole.count == 4
