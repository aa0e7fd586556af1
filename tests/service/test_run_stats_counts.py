"""A run's trajectory counts in its stats: every trajectory it stored, and how many of them in the
last five minutes (`ingest_per_minute` is that count over five), for one run and for all of a
pool's runs at once."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

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


async def test_trajectories_and_those_of_the_last_five_minutes(backend: Backend) -> None:
    half = correct_first(lambda q: 2)
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed", questions=64)
        await create_run(client, "p1", "r2", phase="mixed")
        for run in ("r1", "r1", "r2"):
            plan = await plan_batch(client, run=run)
            ok(await commit_batch(client, plan, make_groups(plan, half)))
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
                # r1's oldest ten, an hour old: still counted, no longer recent
                old = utcnow() - timedelta(hours=1)
                await conn.execute(
                    text(
                        "UPDATE trajectory SET created_at = :old WHERE id IN (SELECT t.id FROM trajectory t "
                        "JOIN run r ON r.id = t.source_run_id WHERE r.name = 'r1' ORDER BY t.id LIMIT 10)"
                    ),
                    {
                        "old": old.strftime("%Y-%m-%d %H:%M:%S.%f")
                        if backend.name.startswith("sqlite")
                        else old
                    },
                )
        finally:
            await engine.dispose()
        one = {run: await run_stats(client, run=run) for run in ("r1", "r2")}
        every = {r["run"]: r for r in (await pool_stats(client))["runs"]}
        for run, n in stored.items():
            recent = n - 10 if run == "r1" else n
            for stats in (one[run], every[run]):
                assert stats["trajectories"] == n
                assert stats["ingest_per_minute"] == recent / 5.0
