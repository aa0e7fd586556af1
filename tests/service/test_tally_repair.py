"""`exgrpo db tallies`: the tallies that stats read checked against counts of their rows, cell by
cell, and set to the counts with `--repair` (after a bulk load around the service, a hand edit, a
bug); on Postgres beside writers, waiting for none of them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from exgrpo_cli.main import app
from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo

from .factories import pool_stats, setup_pool
from .harness import Backend, db_execute, db_rows
from .test_tallies import POSTGRES, _assert_tallies_hold, _write_everything


async def _check(url: str, *, repair: bool = False) -> list[repo.TallyDrift]:
    db = dbmod.Database(url)
    try:
        return await db.check_tallies(repair=repair)
    finally:
        await db.close()


async def _pool_id(url: str, name: str) -> int:
    return int((await db_rows(url, f"SELECT id FROM pool WHERE name = '{name}'"))[0][0])


#: what a check says, per (tally, cell): (kept, counted)
Said = dict[tuple[str, tuple[int, ...]], tuple[dict[str, int], dict[str, int]]]


async def _plant_drift(url: str) -> Said:
    """Three cells off and one cell of no rows; what the check should say of each (kept,
    counted)."""
    p1, p2 = await _pool_id(url, "p1"), await _pool_id(url, "p2")
    (scope, bucket, n), *_ = await db_rows(
        url,
        f"SELECT scope, coalesce(bucket, -1), count(*) FROM run_question WHERE scope = {-p2} "
        "AND NOT retired GROUP BY 1, 2 ORDER BY 3 DESC",
    )
    (run_id,), *_ = await db_rows(
        url, f"SELECT source_run_id FROM trajectory WHERE pool_id = {p1} GROUP BY 1 ORDER BY 1"
    )
    questions = (await db_rows(url, f"SELECT count(*) FROM question WHERE pool_id = {p2}"))[0][0]
    await db_execute(
        url,
        # tally rows without their counted rows, added the way the triggers add theirs (the
        # trajectory tally's in period 0: the periods long past, of no trajectory here)
        f"INSERT INTO state_tally (scope, bucket, retired, n) VALUES ({scope}, {bucket}, false, 3)",
        "INSERT INTO trajectory_tally (pool_id, run_id, period, n, tokens) "
        f"VALUES ({p1}, {run_id}, 0, 0, 100)",
        "INSERT INTO state_tally (scope, bucket, retired, n) VALUES (-999, 2, false, 5)",
        f"DELETE FROM question_tally WHERE pool_id = {p2}",
    )
    n, questions = int(n), int(questions)
    return {
        ("state_tally", (int(scope), int(bucket), 0)): ({"n": n + 3}, {"n": n}),
        ("state_tally", (-999, 2, 0)): ({"n": 5}, {"n": 0}),
        # the cell holds none of the run's trajectories: they lie in their recent periods
        ("trajectory_tally", (p1, int(run_id), 0)): ({"n": 0, "tokens": 100}, {"n": 0, "tokens": 0}),
        ("question_tally", (p2,)): ({"n": 0}, {"n": questions}),
    }


def _said(drift: list[repo.TallyDrift]) -> Said:
    return {(d.tally, tuple(d.cell.values())): (d.kept, d.counted) for d in drift}


async def test_drift_is_found_cell_by_cell_and_repaired(backend: Backend, client: httpx.AsyncClient) -> None:
    await _write_everything(client)
    url = backend.database_url
    assert await _check(url) == []
    planted = await _plant_drift(url)
    questions = planted[("question_tally", (await _pool_id(url, "p2"),))][1]["n"]
    assert (await pool_stats(client, "p2"))["num_questions"] == 0  # what stats read is off
    drift = await _check(url)
    assert _said(drift) == planted
    assert await _check(url) == drift  # a check changes nothing
    assert _said(await _check(url, repair=True)) == planted
    assert await _check(url) == []
    await _assert_tallies_hold(url)
    assert (await pool_stats(client, "p2"))["num_questions"] == questions
    # the triggers and the service's own counting go on from the recounted cells
    await _write_everything(client, suffix="-after")
    await _assert_tallies_hold(url)


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def _words(output: str) -> str:
    """The output with the terminal's line breaks undone."""
    return " ".join(output.split())


async def test_the_cli_reports_drift_and_repairs_it(backend: Backend, client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed", questions=6)
    url = backend.database_url
    p1 = await _pool_id(url, "p1")
    clean = await asyncio.to_thread(_cli, "db", "tallies", "--database-url", url)
    assert clean.exit_code == 0, clean.output
    assert "every tally agrees with its rows" in _words(clean.output)
    await db_execute(url, f"INSERT INTO question_tally (pool_id, n) VALUES ({p1}, 4)")
    found = await asyncio.to_thread(_cli, "db", "tallies", "--database-url", url)
    assert found.exit_code == 1, found.output
    assert "1 tally cell differed" in _words(found.output) and "question_tally" in found.output
    repaired = await asyncio.to_thread(_cli, "--json", "db", "tallies", "--repair", "--database-url", url)
    assert repaired.exit_code == 0, repaired.output
    body = json.loads(repaired.output)
    assert body["repaired"] is True
    assert body["cells_off"] == [
        {"tally": "question_tally", "cell": {"pool_id": p1}, "kept": {"n": 10}, "counted": {"n": 6}}
    ]
    again = await asyncio.to_thread(_cli, "--json", "db", "tallies", "--database-url", url)
    assert again.exit_code == 0 and json.loads(again.output)["cells_off"] == []


def test_the_cli_says_what_is_missing(tmp_path: Path) -> None:
    missing = _cli("db", "tallies", "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'none.db'}")
    assert missing.exit_code == 1 and "no database file" in _words(missing.output)
    assert not (tmp_path / "none.db").exists()
    empty = tmp_path / "empty.db"
    empty.touch()
    unmigrated = _cli("db", "tallies", "--database-url", f"sqlite+aiosqlite:///{empty}")
    assert unmigrated.exit_code == 1 and "exgrpo db upgrade" in _words(unmigrated.output)


@POSTGRES
async def test_a_repair_waits_for_no_writer_and_keeps_their_counts(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """A writer holds new states uncommitted while a repair recounts; both finish (the writer under
    a 2 s lock timeout, the repair within 20 s), and once the writer commits every cell holds its
    states and the repair's counts."""
    await setup_pool(client, phase="mixed", sharing="pooled", questions=6)
    url = backend.database_url
    p1 = await _pool_id(url, "p1")
    qids = [q for (q,) in await db_rows(url, f"SELECT id FROM question WHERE pool_id = {p1} ORDER BY id")]
    await db_execute(url, f"INSERT INTO state_tally (scope, bucket, retired, n) VALUES ({-p1}, 1, false, 7)")
    writer = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    insert = (
        "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, last_step, "
        "updated_at) VALUES ($1, $2, $3, 2, 1, false, 0, now())"
    )
    try:
        await writer.execute("SET lock_timeout = '2s'")
        await writer.execute("BEGIN")
        for qid in qids[:2]:
            await writer.execute(insert, -p1, qid, p1)
        repaired = await asyncio.wait_for(_check(url, repair=True), 20)
        assert _said(repaired) == {("state_tally", (-p1, 1, 0)): ({"n": 7}, {"n": 0})}
        for qid in qids[2:4]:
            await writer.execute(insert, -p1, qid, p1)
        await writer.execute("COMMIT")
    finally:
        await writer.close()
    await _assert_tallies_hold(url)
    cell = await db_rows(url, f"SELECT sum(n) FROM state_tally WHERE scope = {-p1} AND bucket = 1")
    assert int(cell[0][0]) == 4


@POSTGRES
async def test_a_repair_that_meets_a_fold_counts_again(
    backend: Backend, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fold commits, after the repair took its snapshot, the deletion of tally rows the repair
    then deletes: Postgres answers a serialization failure and the repair runs once more."""
    monkeypatch.setattr(dbmod, "FOLD_TALLIES_EVERY", 10**9)
    await _write_everything(client)
    url = backend.database_url
    await _plant_drift(url)
    attempts = 0
    recount = repo.recount_tallies

    async def fold_meanwhile(session: Any) -> list[repo.TallyDrift]:
        nonlocal attempts
        attempts += 1
        await session.execute(text("SELECT count(*) FROM state_tally"))  # the snapshot is taken
        if attempts == 1:
            db = dbmod.Database(url)
            try:
                async with db.sessions() as other, other.begin():
                    assert await repo.fold_tallies(other) > 0
            finally:
                await db.close()
        return await recount(session)

    monkeypatch.setattr(repo, "recount_tallies", fold_meanwhile)
    assert len(await _check(url, repair=True)) == 4
    assert attempts == 2
    monkeypatch.setattr(repo, "recount_tallies", recount)
    assert await _check(url) == []
    await _assert_tallies_hold(url)


async def test_a_check_counts_in_one_snapshot(
    backend: Backend, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer commits a state between the check's sum of the state tally and its count of the
    states: both are read in one snapshot, so the check finds nothing off (it would report the
    state's cell if each read saw the database as it was then), and the next check neither."""
    await setup_pool(client, phase="mixed", sharing="pooled", questions=4)
    url = backend.database_url
    p1 = await _pool_id(url, "p1")
    (qid,) = (await db_rows(url, f"SELECT max(id) FROM question WHERE pool_id = {p1}"))[0]
    await db_execute(url, f"DELETE FROM run_question WHERE question_id = {qid}")
    cells = repo._cells
    reads = 0

    async def write_between(session: Any, sql: str, keys: int) -> dict[tuple[int, ...], tuple[int, ...]]:
        nonlocal reads
        reads += 1
        out = await cells(session, sql, keys)
        if reads == 1:  # the state tally summed; its states not counted yet
            await db_execute(
                url,
                "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, "
                f"last_step, updated_at) VALUES ({-p1}, {qid}, {p1}, 2, 1, false, 0, '2026-01-01')",
            )
        return out

    monkeypatch.setattr(repo, "_cells", write_between)
    assert await _check(url) == []
    assert reads == 6
    monkeypatch.setattr(repo, "_cells", cells)
    assert await _check(url) == []
    assert (await db_rows(url, f"SELECT count(*) FROM run_question WHERE question_id = {qid}"))[0][0] == 1
