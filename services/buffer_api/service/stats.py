"""A run's pool statistics, read inside a caller's session: the stats endpoints answer them, and a
commit that asks for them answers them as they stand after its own changes."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_client import schemas as s
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.convert import scope_of, stored_plan
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import AnyBatch, AnyPool, AnyRun, utcnow


async def collect_run_stats(
    ctx: Context, session: AsyncSession, pool: AnyPool, run: AnyRun, *, last: AnyBatch | None = None
) -> s.RunStats:
    """`last`: the run's last committed batch, when the caller holds it (a commit: its own batch)."""
    hist, retired, seen = await repo.state_counts(session, scope_of(pool, run))
    total, recent = await repo.run_trajectory_counts(session, run.id, utcnow() - timedelta(minutes=5))
    if last is None:
        last = await repo.last_committed_batch(session, run.id)
    eligible = sum(hist.values())
    ctx.metrics.run_eligible.labels(pool.name, run.name).set(eligible)
    ctx.metrics.run_retired.labels(pool.name, run.name).set(retired)
    return s.RunStats(
        run=run.name,
        pool=pool.name,
        phase=run.phase,
        step=run.step,
        policy_version=run.policy_version,
        buckets=[s.BucketCount(bucket=b, questions=n) for b, n in sorted(hist.items())],
        eligible=eligible,
        retired=retired,
        seen=seen,
        trajectories=total,
        replayed_last_step=0 if last is None else len(stored_plan(last).replay),
        ingest_per_minute=recent / 5.0,
    )
