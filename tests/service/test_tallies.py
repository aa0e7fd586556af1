"""The tallies that stats read instead of counting the pool (migration 0010): after every kind of
write the service makes (plans and commits that move questions between buckets and retire them,
ingests, evictions by both capacity limits, every sharing mode, a deleted run, a deleted pool, an
imported pool), each tally cell holds exactly what counting the rows gives; on Postgres also after
folding, and two writers of one scope never wait for each other's counts."""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx
import pytest

from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo

from .conftest import _truncate
from .factories import (
    all_questions,
    commit_batch,
    correct_first,
    group,
    make_groups,
    ok,
    plan_batch,
    pool_stats,
    run_stats,
    setup_pool,
)
from .harness import Backend, db_execute, db_rows, serve

#: per tally: (the key columns of its cells, its cells summed, the same cells counted from the
#: rows)
TALLIES = {
    "state_tally": (
        ("scope", "bucket", "retired"),
        "SELECT scope, bucket, retired, sum(n) FROM state_tally GROUP BY 1, 2, 3",
        "SELECT scope, coalesce(bucket, -1), retired, count(*) FROM run_question GROUP BY 1, 2, 3",
    ),
    "trajectory_tally": (
        ("pool_id", "run_id"),
        "SELECT pool_id, run_id, sum(n), sum(tokens) FROM trajectory_tally GROUP BY 1, 2",
        "SELECT pool_id, coalesce(source_run_id, 0), count(*), sum(num_tokens) FROM trajectory GROUP BY 1, 2",
    ),
    "question_tally": (
        ("pool_id",),
        "SELECT pool_id, sum(n) FROM question_tally GROUP BY 1",
        "SELECT pool_id, count(*) FROM question GROUP BY 1",
    ),
}

#: per tally: the key columns of its cells as a fold leaves them, a row each (the trajectory
#: tally's cells are per period on Postgres, migration 0014: a run's trajectories written across
#: the end of a period are two cells)
CELLS = {
    name: keys + (("period",) if name == "trajectory_tally" else ()) for name, (keys, _, _) in TALLIES.items()
}


async def _cells(url: str, sql: str, keys: int) -> set[tuple[Any, ...]]:
    """A query's rows as ints, without the cells whose counts are all zero."""
    rows = {tuple(int(v) for v in row) for row in await db_rows(url, sql)}
    return {row for row in rows if any(row[keys:])}


async def _assert_tallies_hold(url: str) -> None:
    for name, (keys, summed, counted) in TALLIES.items():
        tally, rows = await _cells(url, summed, len(keys)), await _cells(url, counted, len(keys))
        assert tally == rows, f"{name}: tally {sorted(tally - rows)} against rows {sorted(rows - tally)}"


def _tokens(qid: int, row: int) -> list[int]:
    return [qid, row] + [7] * (qid % 5 + row)


async def _write_everything(client: httpx.AsyncClient, suffix: str = "") -> None:
    """Every kind of write that changes question states, trajectories or questions (pools p1, p2,
    p3 and copy, each name followed by `suffix`)."""
    reward = correct_first(lambda qid: qid % 5)  # 0..4 of 4 correct: every bucket, and retired
    p1, p2, p3 = (f"p{i}{suffix}" for i in (1, 2, 3))
    for pool, sharing in ((p1, "per_run"), (p2, "pooled"), (p3, "shared_trajectories")):
        await setup_pool(
            client,
            pool,
            runs=("r1", "r2"),
            phase="mixed",
            sharing=sharing,
            questions=24,
            max_trajectories_per_question=2,
            **({"max_payload_bytes": 6000} if pool == p2 else {}),
        )
        for step in range(4):
            for run in ("r1", "r2"):
                plan = await plan_batch(client, pool, run)
                # later steps answer otherwise: buckets move, retired questions stay retired
                shift = correct_first(lambda qid, s=step: (qid + s) % 5) if step % 2 else reward
                ok(await commit_batch(client, plan, make_groups(plan, shift, _tokens)))
        qids = [q["id"] for q in await all_questions(client, pool)]
        groups = [group(q, [1, 0, 1, 0], _tokens) for q in qids[:6]]
        ok(await client.post(f"/v1/pools/{pool}/runs/r2/ingest", json={"groups": groups}))
    assert (await client.delete(f"/v1/pools/{p1}/runs/r2", params={"force": True})).status_code == 204
    exported = await client.get(f"/v1/pools/{p2}/export")
    assert exported.status_code == 200
    copy = {"name": f"copy{suffix}"}
    ok(await client.post("/v1/pools/import", params=copy, content=exported.content), 201)
    assert (await client.delete(f"/v1/pools/{p3}", params={"force": True})).status_code == 204


async def test_the_tallies_hold_what_the_rows_count(backend: Backend, client: httpx.AsyncClient) -> None:
    await _write_everything(client)
    counted = await db_rows(backend.database_url, "SELECT count(*) FROM run_question WHERE retired")
    assert counted[0][0] > 0, "the workload retires questions"
    await _assert_tallies_hold(backend.database_url)
    # the answers read from the tallies: a run's histogram and a pool's totals
    stats = await run_stats(client, "p2", "r1")
    hist = {b["bucket"]: b["questions"] for b in stats["buckets"]}
    scope = await db_rows(backend.database_url, "SELECT -id FROM pool WHERE name = 'p2'")
    rows = await db_rows(
        backend.database_url,
        f"SELECT bucket, count(*) FROM run_question WHERE scope = {scope[0][0]} AND NOT retired "
        "AND bucket IS NOT NULL GROUP BY bucket",
    )
    assert hist == {int(b): int(n) for b, n in rows} and stats["eligible"] == sum(hist.values())
    totals = await pool_stats(client, "copy")
    counts = await db_rows(
        backend.database_url,
        "SELECT (SELECT count(*) FROM question q JOIN pool p ON p.id = q.pool_id WHERE p.name = 'copy'), "
        "(SELECT count(*) FROM trajectory t JOIN pool p ON p.id = t.pool_id WHERE p.name = 'copy'), "
        "(SELECT sum(num_tokens) FROM trajectory t JOIN pool p ON p.id = t.pool_id WHERE p.name = 'copy')",
    )
    assert (totals["num_questions"], totals["num_trajectories"], totals["num_tokens"]) == tuple(
        int(v) for v in counts[0]
    )
    assert totals["num_trajectories"] > 0


#: Postgres only: SQLite keeps one row per cell, and has one writer at a time
POSTGRES = pytest.mark.parametrize(
    "backend",
    [pytest.param("postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis])],
    indirect=True,
)


@POSTGRES
async def test_folding_keeps_every_count_and_leaves_a_row_per_cell(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    await _write_everything(client)
    url = backend.database_url
    await _straddle_a_period(url)
    assert await _fold(url) > 0
    await _assert_tallies_hold(url)
    for name, keys in CELLS.items():
        most = await db_rows(
            url, f"SELECT max(c) FROM (SELECT count(*) AS c FROM {name} GROUP BY {', '.join(keys)}) x"
        )
        assert most[0][0] == 1, name
        zero = await db_rows(url, f"SELECT count(*) FROM {name} WHERE n = 0")
        assert zero[0][0] == 0, name
    assert await _fold(url) == 0  # nothing left to fold


async def _straddle_a_period(url: str) -> None:
    """Make a run's trajectories of one pool fall in two recent periods, as writes that go on
    past the end of a ten-second period do: one trajectory of the run's latest period moved into
    the period before it (its tally rows as the writes of both periods leave them)."""
    (pool, run, period, tokens) = (
        await db_rows(
            url,
            "SELECT pool_id, run_id, period, sum(tokens) / sum(n) FROM trajectory_tally "
            "GROUP BY 1, 2, 3 HAVING sum(n) > 1 ORDER BY 1, 2 LIMIT 1",
        )
    )[0]
    moved = [(period - 1, 1, tokens), (period, -1, -tokens)]
    values = ", ".join(f"({pool}, {run}, {p}, {n}, {t})" for p, n, t in moved)
    await db_execute(
        url, f"INSERT INTO trajectory_tally (pool_id, run_id, period, n, tokens) VALUES {values}"
    )


async def _fold(url: str) -> int:
    db = dbmod.Database(url)
    try:
        async with db.sessions() as session, session.begin():
            return await repo.fold_tallies(session)
    finally:
        await db.close()


@POSTGRES
async def test_writers_of_one_scope_do_not_wait_for_each_others_counts(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """Two open transactions add states to the same scope and cell; a fold runs between them.
    None of them waits (a lock timeout would fail it), and once both commit the cell holds both."""
    await setup_pool(client, phase="mixed", sharing="pooled", questions=4)
    url = backend.database_url
    (pool_id,) = (await db_rows(url, "SELECT id FROM pool WHERE name = 'p1'"))[0]
    qids = [
        q for (q,) in await db_rows(url, f"SELECT id FROM question WHERE pool_id = {pool_id} ORDER BY id")
    ]
    writers = [await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://")) for _ in range(2)]
    try:
        for i, conn in enumerate(writers):
            await conn.execute("SET lock_timeout = '2s'")
            await conn.execute("BEGIN")
            for qid in qids[2 * i : 2 * i + 2]:
                await conn.execute(
                    "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, "
                    "last_step, updated_at) VALUES ($1, $2, $3, 2, 1, false, 0, now())",
                    -pool_id,
                    qid,
                    pool_id,
                )
            await _fold(url)  # beside the open writers: folds nothing of theirs, waits for none
        for conn in writers:
            await conn.execute("COMMIT")
    finally:
        for conn in writers:
            await conn.close()
    await _assert_tallies_hold(url)
    cell = await db_rows(url, f"SELECT sum(n) FROM state_tally WHERE scope = {-pool_id} AND bucket = 1")
    assert int(cell[0][0]) == 4


async def _rows_over_cells(url: str) -> int:
    """How many more tally rows there are than cells (0 once every cell is folded)."""
    extra = 0
    for name, keys in CELLS.items():
        cells = f"SELECT count(*) FROM (SELECT 1 FROM {name} GROUP BY {', '.join(keys)}) c"
        rows = await db_rows(url, f"SELECT count(*), ({cells}) FROM {name}")
        extra += int(rows[0][0]) - int(rows[0][1])
    return extra


@POSTGRES
async def test_the_service_folds_the_tallies_after_its_writes(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a fold after every write the tallies stay near a row per cell; without one they grow
    by a row per statement and cell. The counts hold either way."""
    url = backend.database_url
    monkeypatch.setattr(dbmod, "FOLD_TALLIES_EVERY", 10**9)
    async with serve(backend.settings()) as client:
        await _write_everything(client)
    unfolded = await _rows_over_cells(url)
    await _assert_tallies_hold(url)
    await _truncate(url)
    monkeypatch.setattr(dbmod, "FOLD_TALLIES_EVERY", 1)
    async with serve(backend.settings()) as client:
        await _write_everything(client)
    folded = await _rows_over_cells(url)
    await _assert_tallies_hold(url)
    assert unfolded > 100 and folded < unfolded / 10, (unfolded, folded)
