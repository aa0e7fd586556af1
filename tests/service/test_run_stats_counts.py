"""A run's trajectory counts in its stats: every trajectory it stored, and how many of them in the
last five minutes (`ingest_per_minute` is that count over five), for one run and for all of a
pool's runs at once."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from exgrpo_pool.service import stats as stats_mod
from exgrpo_pool.store import repo, sqlite_inline
from exgrpo_pool.store.models import utcnow

from .factories import (
    commit_batch,
    correct_first,
    create_run,
    make_groups,
    ok,
    plan_batch,
    pool_stats,
    run_stats,
    setup_pool,
)
from .harness import Backend, serve

HALF = correct_first(lambda q: 2)

#: a period's start (`repo.TALLY_PERIOD_S` from the epoch): the trajectories moved to 7 s past it
#: and the stats read 6 s past it five minutes later are counted row by row, from `since` (6 s
#: in) to the period's end, the rest of the five minutes from the tally's whole periods
ALIGNED = datetime(2030, 1, 1, tzinfo=UTC)
MADE_AT = ALIGNED + timedelta(seconds=7)
READ_AT = ALIGNED + timedelta(minutes=5, seconds=6)


def _stamp(backend: Backend, at: datetime) -> Any:
    """A time as the backend's `created_at` column binds it."""
    return at.strftime("%Y-%m-%d %H:%M:%S.%f") if backend.name.startswith("sqlite") else at


async def _made_at(backend: Backend, at: datetime, where: str = "") -> None:
    """The trajectories (`where`: those of a condition) made at `at` instead, with its period."""
    engine = create_async_engine(backend.database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(f"UPDATE trajectory SET created_at = :at, period = :period {where}"),
                {"at": _stamp(backend, at), "period": repo.tally_period(at)},
            )
    finally:
        await engine.dispose()


def _counted_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stats read at `READ_AT`, with every trajectory moved to `MADE_AT`: all of them are
    counted over the (run, created) index, none from the tally's periods."""
    monkeypatch.setattr(stats_mod, "utcnow", lambda: READ_AT)


async def _two_runs_trained(client: httpx.AsyncClient) -> None:
    """r1 and r2 in the mixed phase of a 64-question pool, with two and one committed steps."""
    await setup_pool(client, phase="mixed", questions=64)
    await create_run(client, "p1", "r2", phase="mixed")
    for run in ("r1", "r2", "r1"):
        plan = await plan_batch(client, run=run)
        ok(await commit_batch(client, plan, make_groups(plan, HALF)))


def _steps_counted(
    marker: str, record: Callable[[int, list[Any]], None]
) -> Callable[[sqlite3.Connection, str, Sequence[Any]], Awaitable[list[Any]]]:
    """`sqlite_inline.fetch_all` (as it is now) that gives `record` the virtual machine steps and
    the rows of each statement with `marker` in its text, counted with a progress handler."""
    fetch_all = sqlite_inline.fetch_all

    async def counted(conn: sqlite3.Connection, sql: str, parameters: Sequence[Any]) -> list[Any]:
        if marker not in sql:
            return await fetch_all(conn, sql, parameters)
        steps = [0]

        def tick() -> int:
            steps[0] += 1
            return 0

        conn.set_progress_handler(tick, 1)
        try:
            rows = await fetch_all(conn, sql, parameters)
        finally:
            conn.set_progress_handler(None, 0)
        record(steps[0], rows)
        return rows

    return counted


async def test_trajectories_and_those_of_the_last_five_minutes(backend: Backend) -> None:
    async with serve(backend.settings()) as client:
        await _two_runs_trained(client)
        engine = create_async_engine(backend.database_url)
        try:
            async with engine.begin() as conn:
                stored = dict(
                    (
                        await conn.execute(
                            text(
                                "SELECT r.name, count(*) FROM trajectory t JOIN run r "
                                "ON r.id = t.source_run_id GROUP BY r.name"
                            )
                        )
                    ).all()
                )
                assert stored["r1"] > 0 and stored["r2"] > 0
        finally:
            await engine.dispose()
        # r1's oldest ten, an hour old: still counted, no longer recent
        await _made_at(
            backend,
            utcnow() - timedelta(hours=1),
            "WHERE id IN (SELECT t.id FROM trajectory t JOIN run r ON r.id = t.source_run_id "
            "WHERE r.name = 'r1' ORDER BY t.id LIMIT 10)",
        )
        one = {run: await run_stats(client, run=run) for run in ("r1", "r2")}
        every = {r["run"]: r for r in (await pool_stats(client))["runs"]}
        for run, n in stored.items():
            recent = n - 10 if run == "r1" else n
            for stats in (one[run], every[run]):
                assert stats["trajectories"] == n
                assert stats["ingest_per_minute"] == recent / 5.0


async def test_a_run_past_the_loops_share_is_counted_off_the_loop_exactly(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's inline driver counts a run's recent trajectories row by row (those of the period
    the five minutes begin in) on the event loop only within the steps of about
    `repo.RECENT_ON_LOOP` entries; a statement past them is stopped there and run again, whole,
    in a worker thread, to the same numbers (Postgres counts on its server, off the loop anyway)."""
    off_loop: list[str] = []
    counted = sqlite_inline.fetch_all_off_loop

    async def spied(conn: Any, sql: str, parameters: Sequence[Any]) -> list[Any]:
        off_loop.append(sql)
        return await counted(conn, sql, parameters)

    stopped: list[str] = []
    within = sqlite_inline.fetch_all_within

    async def spied_within(conn: Any, sql: str, parameters: Sequence[Any], steps: int) -> list[Any] | None:
        rows = await within(conn, sql, parameters, steps)
        if rows is None:
            stopped.append(sql)
        return rows

    monkeypatch.setattr(sqlite_inline, "fetch_all_off_loop", spied)
    monkeypatch.setattr(sqlite_inline, "fetch_all_within", spied_within)
    async with serve(backend.settings()) as client:
        await _two_runs_trained(client)
        await _made_at(backend, MADE_AT)
        _counted_row_by_row(monkeypatch)
        before = {run: await run_stats(client, run=run) for run in ("r1", "r2")}
        assert not off_loop and not stopped and all(s["trajectories"] > 3 for s in before.values())
        monkeypatch.setattr(repo, "RECENT_ON_LOOP", 3)
        after = {run: await run_stats(client, run=run) for run in ("r1", "r2")}
        every = {r["run"]: r for r in (await pool_stats(client))["runs"]}
        # a commit that asks for its run's stats counts the same way, inside its transaction: its
        # count, not known to be long, is stopped on the loop there, and the commit stands
        monkeypatch.setattr(repo, "_COUNTED_OFF_LOOP", set())
        plan = await plan_batch(client, run="r2")
        committed = ok(await commit_batch(client, plan, {**make_groups(plan, HALF), "with_stats": True}))
        later = await run_stats(client, run="r2")
    for run in ("r1", "r2"):
        assert after[run] == before[run] and every[run] == before[run]
        assert before[run]["ingest_per_minute"] == before[run]["trajectories"] / 5.0
    # the commit's own trajectories are made now, long before `READ_AT`'s five minutes
    assert committed["stats"]["ingest_per_minute"] == before["r2"]["ingest_per_minute"]
    assert committed["stats"]["trajectories"] > before["r2"]["trajectories"]
    assert later == committed["stats"] and later["step"] == before["r2"]["step"] + 1
    # two run stats, the pool's (both runs in one statement) and the commit's: each stopped on the
    # loop past its steps, then counted whole in a worker thread; the last read of r2 there at
    # once (its statement's last count went past the share)
    sqlite = not backend.name.startswith("postgres")
    assert len(stopped) == (4 if sqlite else 0), stopped
    assert len(off_loop) == (5 if sqlite else 0), off_loop


async def test_sqlite_counts_in_the_steps_the_loops_budget_assumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget of a stats statement on the loop is counted in SQLite's virtual machine steps
    (`repo.STEPS_PER_ENTRY` a recent trajectory, `repo.STEPS_PER_RUN` and `STEPS_PER_REPLAY` a run
    beside): measured here with a progress handler on the statements of a run's stats and of the
    pool's (two runs)."""
    measured: list[tuple[int, int]] = []  # (steps, recent trajectories counted row by row)
    counted = _steps_counted(
        "created_at >=", lambda steps, rows: measured.append((steps, sum(r[-1] for r in rows if r[0] == 2)))
    )

    backend = Backend("sqlite-memory", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
    async with serve(backend.settings()) as client:
        await _two_runs_trained(client)
        await _made_at(backend, MADE_AT)
        _counted_row_by_row(monkeypatch)
        # the budget's own handler set aside: this one counts every step
        monkeypatch.setattr(sqlite_inline, "fetch_all_within", lambda c, sql, p, _steps: counted(c, sql, p))
        for run in ("r1", "r2"):
            await run_stats(client, run=run)
        await pool_stats(client)
    (one, n_one), (two, n_two), (pool, n_pool) = measured  # 256 / 24, 228 / 16, 504 / 40
    assert n_one != n_two and n_pool == n_one + n_two
    per_entry = (one - two) / (n_one - n_two)
    assert repo.STEPS_PER_ENTRY - 0.5 <= per_entry <= repo.STEPS_PER_ENTRY + 0.5, measured
    for steps, entries, runs in ((one, n_one, 1), (two, n_two, 1), (pool, n_pool, 2)):
        # each read's last replays too
        assert steps - entries * per_entry <= (repo.STEPS_PER_RUN + repo.STEPS_PER_REPLAY) * runs, measured


async def test_a_runs_last_replays_are_found_from_its_newest_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's stats find its last committed batch from its newest batches down: their work does
    not grow with the run's steps (SQLite's virtual machine instructions for the statement that
    reads the batches, counted with a progress handler, after 2 and after 24 committed steps)."""
    work: list[int] = []
    fetch_all = sqlite_inline.fetch_all
    counted = _steps_counted("FROM batch", lambda steps, _rows: work.append(steps))

    backend = Backend("sqlite-memory", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed", questions=64)
        replayed: list[int] = []
        for steps in (2, 24):
            while (await run_stats(client))["step"] < steps:
                plan = await plan_batch(client)
                ok(await commit_batch(client, plan, make_groups(plan, HALF)))
            monkeypatch.setattr(sqlite_inline, "fetch_all", counted)
            replayed.append((await run_stats(client))["replayed_last_step"])
            monkeypatch.setattr(sqlite_inline, "fetch_all", fetch_all)
            assert len(plan["replay"]) == replayed[-1] > 0
    early, late = work  # 32 and 32; 89 and 397 when every batch of the run was read
    assert late < early * 1.5, work


async def test_a_run_known_to_be_past_the_loops_share_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose last count went past `repo.RECENT_ON_LOOP` is counted in a worker thread at once,
    not up to the cap on the event loop first and then again; one that falls back under the cap
    (its trajectories older than five minutes) is counted on the loop again. The numbers are the
    same every way."""
    on_loop: list[str] = []
    off_loop: list[str] = []
    fetch_all, fetch_all_off_loop = sqlite_inline.fetch_all, sqlite_inline.fetch_all_off_loop

    def recent_count(sql: str) -> bool:
        return "created_at >=" in sql

    async def spied(conn: Any, sql: str, parameters: Sequence[Any]) -> list[Any]:
        if recent_count(sql):
            on_loop.append(sql)
        return await fetch_all(conn, sql, parameters)

    async def spied_off(conn: Any, sql: str, parameters: Sequence[Any]) -> list[Any]:
        if recent_count(sql):
            off_loop.append(sql)
        return await fetch_all_off_loop(conn, sql, parameters)

    backend = Backend("sqlite-memory", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
    async with serve(backend.settings()) as client:
        await _two_runs_trained(client)
        await _made_at(backend, MADE_AT)
        _counted_row_by_row(monkeypatch)
        before = await run_stats(client, run="r1")
        assert before["trajectories"] > 3
        monkeypatch.setattr(sqlite_inline, "fetch_all", spied)
        monkeypatch.setattr(sqlite_inline, "fetch_all_off_loop", spied_off)
        monkeypatch.setattr(repo, "RECENT_ON_LOOP", 3)
        first = await run_stats(client, run="r1")
        assert (len(on_loop), len(off_loop)) == (1, 1)  # up to the cap on the loop, then all of it
        again = [await run_stats(client, run="r1") for _ in range(3)]
        assert (len(on_loop), len(off_loop)) == (1, 4)  # known past the cap: off the loop at once
        assert first == before and all(a == before for a in again)
        # every trajectory of r1 older than five minutes: counted off the loop once more (zero),
        # then on the loop again
        r1 = "WHERE source_run_id = (SELECT id FROM run WHERE name = 'r1')"
        await _made_at(backend, MADE_AT - timedelta(hours=1), r1)
        quiet = [await run_stats(client, run="r1") for _ in range(2)]
        assert (len(on_loop), len(off_loop)) == (2, 5)
        assert [q["ingest_per_minute"] for q in quiet] == [0.0, 0.0]
        assert all(q["trajectories"] == before["trajectories"] for q in quiet)
