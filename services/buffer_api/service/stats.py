"""Runs' pool statistics, read inside a caller's session: the stats endpoints answer them, and a
commit that asks for them answers them as they stand after its own changes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_client import schemas as s
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.convert import scope_of
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import AnyPool, AnyRun, utcnow


async def collect_run_stats(
    ctx: Context, session: AsyncSession, pool: AnyPool, run: AnyRun, *, replayed: int | None = None
) -> s.RunStats:
    """`replayed`: how many questions the run's last committed batch replayed, when the caller
    knows (a commit: its own plan's). The model of a commit's answer (`with_stats`)."""
    return s.RunStats.model_validate((await runs_stats(ctx, session, pool, [run], replayed=replayed))[0])


async def runs_stats(
    ctx: Context,
    session: repo.Target,
    pool: AnyPool,
    runs: Sequence[AnyRun],
    *,
    replayed: int | None = None,
) -> list[dict[str, Any]]:
    """The stats of runs of one pool, in the runs' order, their counts in one statement whatever
    the number of runs (`repo.stats_counts`). `replayed`: the replay count of the one run given's last
    committed batch (else read from the stored plans).

    Each run's as plain values, the fields of `s.RunStats` in its order: the polled GET routes
    write them as JSON themselves (`jsonwrite`: the bytes the model writes, without validating
    a model and its buckets' on every poll, ~15 us of a ~0.25 ms read; `tests/service/
    test_stats_answers.py`), a commit's answer validates them into the model."""
    scopes = {run.id: scope_of(pool, run) for run in runs}
    counts = await repo.stats_counts(
        session, pool.id, scopes, utcnow() - timedelta(minutes=5), replays=replayed is None
    )
    replays = {runs[0].id: replayed} if replayed is not None else counts.replayed
    out: list[dict[str, Any]] = []
    for run in runs:
        hist, retired, seen = counts.states[scopes[run.id]]
        total, recent = counts.trajectories[run.id]
        eligible = sum(hist.values())
        eligible_gauge, retired_gauge = ctx.metrics.run_gauges(pool.name, run.name)
        eligible_gauge.set(eligible)
        retired_gauge.set(retired)
        out.append(
            {
                "run": run.name,
                "pool": pool.name,
                "phase": run.phase,
                "step": run.step,
                "policy_version": run.policy_version,
                "buckets": [{"bucket": b, "questions": n} for b, n in sorted(hist.items())],
                "eligible": eligible,
                "retired": retired,
                "seen": seen,
                "trajectories": total,
                "replayed_last_step": replays.get(run.id, 0),
                "ingest_per_minute": recent / 5.0,
            }
        )
    return out
