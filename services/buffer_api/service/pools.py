"""Pools, questions, runs, policy versions, stats and question detail."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError

from exgrpo_client import schemas as s
from exgrpo_pool import jsonwrite
from exgrpo_pool.errors import BadRequest, Conflict, NotFound
from exgrpo_pool.service.batches import rebuild_index
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.convert import (
    checked_config,
    pool_config,
    pool_public,
    question_bodies,
    question_public,
    question_row,
    run_overrides,
    run_public,
    scope_of,
    trajectory_public,
)
from exgrpo_pool.service.leases import (
    LeaseClaim,
    missing_pool,
    read_run,
    refuse_if_held,
    require_run,
    run_for_write,
)
from exgrpo_pool.service.stats import runs_stats
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import PolicyVersion, Pool, Run, is_pool_scope, pool_scope, utcnow


async def load_pool(ctx: Context, name: str) -> Pool:
    async with ctx.db.read() as session:
        pool = await repo.get_pool(session, name)
    if pool is None:
        raise missing_pool(name)
    return pool


# ------------------------------------------------------------------------------------- pools
async def create_pool(ctx: Context, req: s.PoolCreate) -> s.PoolPublic:
    try:
        async with ctx.db.write() as session:
            if await repo.get_pool(session, req.name) is not None:
                raise Conflict(f"pool {req.name!r} already exists")
            now = utcnow()
            pool = Pool(
                name=req.name,
                description=req.description,
                config=checked_config(req.config).model_dump(),
                created_at=now,
                updated_at=now,
            )
            session.add(pool)
    except IntegrityError as e:
        raise Conflict(f"pool {req.name!r} already exists") from e
    return pool_public(pool, (0, 0, 0))


async def update_pool(ctx: Context, name: str, req: s.PoolUpdate) -> s.PoolPublic:
    async with ctx.db.write() as session:
        pool = await repo.get_pool(session, name)
        if pool is None:
            raise NotFound(f"pool {name!r} does not exist")
        if req.config is not None:
            old = pool_config(pool)
            patch = req.config
            if (patch.k is not None and patch.k != old.k) or (
                patch.sharing is not None and patch.sharing != old.sharing
            ):
                raise Conflict(
                    "k and sharing cannot change after creation (stored groups and buckets "
                    "depend on them); create a new pool and import into it"
                )
            try:
                merged = patch.merged(old)
            except ValidationError as e:
                raise BadRequest(f"config: {s.validation_summary(e)}") from e
            pool.config = checked_config(merged).model_dump()
        if req.description is not None:
            pool.description = req.description
        pool.updated_at = utcnow()
        counts = await repo.pool_counts(session, pool.id)
    return pool_public(pool, counts)


async def delete_pool(ctx: Context, name: str, *, force: bool) -> None:
    """Delete a pool and everything in it (questions, runs, states, trajectories, batches)."""
    async with ctx.db.write() as session:
        pool = await repo.get_pool(session, name)
        if pool is None:
            raise NotFound(f"pool {name!r} does not exist")
        await repo.lock_pool(session, pool.id)
        runs = await repo.list_runs(session, pool.id)
        if not force:
            for run in runs:
                await refuse_if_held(session, run, f"delete pool {name!r}")
        await repo.delete_pool(session, pool.id)
    await _forget_scopes(ctx, [pool_scope(pool.id), *(r.id for r in runs)])


async def _forget_scopes(ctx: Context, scopes: list[int]) -> None:
    """Drop deleted scopes from the sampling index and the epoch cache (ids can be reused)."""
    for scope in scopes:
        await ctx.index.drop(scope)
    ctx.epoch_cache = {k: v for k, v in ctx.epoch_cache.items() if k[0] not in scopes}


async def list_pools(ctx: Context, visible: Callable[[str], bool] = lambda _: True) -> s.PoolsPublic:
    """The pools `visible(name)` lets the caller see."""
    async with ctx.db.read() as session:
        pools = [p for p in await repo.list_pools(session) if visible(p.name)]
        data = [pool_public(p, await repo.pool_counts(session, p.id)) for p in pools]
    return s.PoolsPublic(data=data, count=len(data))


async def show_pool(ctx: Context, name: str) -> s.PoolPublic:
    async with ctx.db.read() as session:
        pool = await repo.get_pool(session, name)
        if pool is None:
            raise NotFound(f"pool {name!r} does not exist")
        return pool_public(pool, await repo.pool_counts(session, pool.id))


# --------------------------------------------------------------------------------- questions
async def import_questions(ctx: Context, pool: Pool, req: s.QuestionsImport) -> s.QuestionsImported:
    now = utcnow()
    rows = [question_row(pool.id, q, now) for q in req.questions]
    async with ctx.db.write() as session:
        inserted = await repo.insert_questions(session, rows)
        total = await repo.count_questions(session, pool.id)
    ctx.metrics.questions_imported.labels(pool.name).inc(inserted)
    ctx.metrics.pool_questions.labels(pool.name).set(total)
    return s.QuestionsImported(
        received=len(rows), inserted=inserted, duplicates=len(rows) - inserted, num_questions=total
    )


async def list_questions(ctx: Context, pool_name: str, after: int, limit: int) -> bytes:
    """A page of the pool's questions (polled: plain rows, on the hot path's connections), as
    `QuestionsPublic` JSON written from the rows: the prompts as stored (validated on import, as
    a plan sends them), no model built per question (about a fifth of a page's CPU)."""
    async with ctx.db.read() as session:
        qs = await repo.question_page(session, pool_name, after, limit)
        if not qs and await repo.pool_row(session, pool_name) is None:
            raise missing_pool(pool_name)
    data = question_bodies(qs, pool_name)
    next_after = qs[-1][0] if len(qs) == limit else None
    return jsonwrite.dumps({"data": data, "count": len(data), "next_after": next_after})


async def question_detail(ctx: Context, pool: Pool, qid: int, *, payload: bool) -> s.QuestionDetail:
    async with ctx.db.read() as session:
        q = (await repo.get_questions(session, [qid])).get(qid)
        if q is None or q.pool_id != pool.id:
            raise NotFound(f"question {qid} does not exist in pool {pool.name!r}")
        trajs = (await repo.trajectories_of(session, [qid], scope=None, payload=payload, text=True))[qid]
        states = await repo.question_states(session, qid)
        names = await repo.run_names(
            session, [t.source_run_id for t in trajs if t.source_run_id] + [st.scope for st in states]
        )
    base = question_public(q, pool.name)
    return s.QuestionDetail(
        **base.model_dump(),
        trajectories=[trajectory_public(t, names, payload=payload, text=True) for t in trajs],
        runs=[
            s.QuestionRunState(
                run="*" if is_pool_scope(st.scope) else names.get(st.scope, str(st.scope)),
                num_correct=st.last_k,
                bucket=st.bucket,
                retired=st.retired,
                last_step=st.last_step,
            )
            for st in states
        ],
    )


# -------------------------------------------------------------------------------------- runs
def _check_phase(name: str, phase: s.Phase, overrides: s.RunOverrides) -> None:
    if phase == "mixed" and not overrides.experience:
        raise BadRequest(
            f"run {name!r}: a run with experience=false is plain on-policy GRPO and stays on_policy; "
            "give it phase on_policy, or experience=true for a mixed run"
        )


async def create_run(ctx: Context, pool: Pool, req: s.RunCreate) -> s.RunPublic:
    _check_phase(req.name, req.phase, req.overrides)
    try:
        async with ctx.db.write() as session:
            if await repo.get_run(session, pool.id, req.name) is not None:
                raise Conflict(f"run {req.name!r} already exists in pool {pool.name!r}")
            now = utcnow()
            run = Run(
                pool_id=pool.id,
                name=req.name,
                seed=req.seed,
                phase=req.phase,
                overrides=req.overrides.model_dump(),
                created_at=now,
                updated_at=now,
                step=0,
                policy_version=0,
                epoch=-1,
                cursor=0,
            )
            session.add(run)
            await session.flush()
            if req.phase == "mixed":
                run.switched_at_step = 0
    except IntegrityError as e:
        raise Conflict(f"run {req.name!r} already exists in pool {pool.name!r}") from e
    return run_public(run, pool.name)


async def list_runs(ctx: Context, pool: Pool) -> s.RunsPublic:
    async with ctx.db.read() as session:
        runs = await repo.list_runs(session, pool.id)
    return s.RunsPublic(data=[run_public(r, pool.name) for r in runs], count=len(runs))


async def show_run(ctx: Context, pool: Pool, name: str) -> s.RunPublic:
    async with ctx.db.read() as session:
        return run_public(await require_run(session, pool, name), pool.name)


async def delete_run(ctx: Context, pool: Pool, name: str, *, force: bool) -> None:
    """Delete a run: its states, its own trajectories (sharing per_run), batches, tasks, policy
    versions, metrics and lease. Trajectories it stored in the pool's shared scope stay (the pool's
    experience), without a source run."""
    async with ctx.db.write() as session:
        run = await require_run(session, pool, name, lock=True)
        if not force:
            await refuse_if_held(session, run, f"delete run {name!r}")
        await repo.delete_run(session, run.id)
    await _forget_scopes(ctx, [run.id])


async def update_run(
    ctx: Context, pool: Pool, name: str, req: s.RunUpdate, lease: LeaseClaim | None = None
) -> s.RunPublic:
    async with ctx.db.write() as session:
        run = await run_for_write(session, pool, name, lease)
        _check_phase(run.name, req.phase or run.phase, req.overrides or run_overrides(run))
        if req.phase is not None and req.phase != run.phase:
            run.phase = req.phase
            run.switched_at_step = run.step if req.phase == "mixed" else None
        if req.overrides is not None:
            run.overrides = req.overrides.model_dump()
        run.updated_at = utcnow()
        return run_public(run, pool.name)


async def add_policy_version(
    ctx: Context, pool: Pool, name: str, req: s.PolicyVersionCreate, lease: LeaseClaim | None = None
) -> s.PolicyVersionPublic:
    async with ctx.db.write() as session:
        run = await run_for_write(session, pool, name, lease)
        existing = await repo.get_policy_version(session, run.id, req.version)
        if existing is not None:
            if existing.uri != req.uri:
                raise Conflict(f"run {name!r} already has policy version {req.version} at {existing.uri}")
            pv = existing
        else:
            pv = PolicyVersion(
                run_id=run.id, version=req.version, uri=req.uri, step=req.step, created_at=utcnow()
            )
            session.add(pv)
        run.policy_version = max(run.policy_version, req.version)
        run.updated_at = utcnow()
    return s.PolicyVersionPublic(version=pv.version, uri=pv.uri, step=pv.step, created_at=pv.created_at)


async def list_policy_versions(ctx: Context, pool: Pool, name: str) -> s.PolicyVersionsPublic:
    async with ctx.db.read() as session:
        run = await require_run(session, pool, name)
        pvs = await repo.policy_versions(session, run.id)
    data = [
        s.PolicyVersionPublic(version=p.version, uri=p.uri, step=p.step, created_at=p.created_at) for p in pvs
    ]
    return s.PolicyVersionsPublic(data=data, count=len(data))


# ------------------------------------------------------------------------------- run metrics
async def post_run_metrics(
    ctx: Context, pool: Pool, name: str, req: s.RunMetricsCreate, lease: LeaseClaim | None = None
) -> s.RunMetricsStep:
    async with ctx.db.write() as session:
        run = await run_for_write(session, pool, name, lease)
        await repo.merge_run_metrics(session, run.id, req.step, req.metrics)
        rows = await repo.run_metrics(session, run.id, req.step - 1, 1)
    return s.RunMetricsStep(step=rows[0].step, metrics=rows[0].metrics, updated_at=rows[0].updated_at)


async def list_run_metrics(
    ctx: Context, pool: Pool, name: str, after_step: int, limit: int
) -> s.RunMetricsPublic:
    async with ctx.db.read() as session:
        run = await require_run(session, pool, name)
        rows = await repo.run_metrics(session, run.id, after_step, limit)
    data = [s.RunMetricsStep(step=r.step, metrics=r.metrics, updated_at=r.updated_at) for r in rows]
    return s.RunMetricsPublic(run=run.name, data=data, count=len(data))


# ------------------------------------------------------------------------------------- stats
# (polled by dashboards and trainers: plain rows, on the hot path's connections, bounded work)
async def run_stats(ctx: Context, pool_name: str, name: str) -> bytes:
    """The run's stats as `s.RunStats` JSON, written from plain values (`runs_stats`)."""
    async with ctx.db.polled() as session:
        pool, run = await read_run(session, pool_name, name)
        return jsonwrite.dumps((await runs_stats(ctx, session, pool, [run]))[0])


async def pool_stats(ctx: Context, pool_name: str) -> bytes:
    """The pool's stats as `s.PoolStats` JSON, written from plain values (`runs_stats`)."""
    async with ctx.db.polled() as session:
        found = await repo.pool_with_totals(session, pool_name)
        if found is None:
            raise missing_pool(pool_name)
        pool, (nq, nt, nr, tokens) = found
        runs = await runs_stats(ctx, session, pool, await repo.run_rows_of_pool(session, pool.id))
    ctx.metrics.pool_questions.labels(pool.name).set(nq)
    ctx.metrics.pool_trajectories.labels(pool.name).set(nt)
    # the fields of `s.PoolStats` in its order
    answer = {
        "pool": pool.name,
        "num_questions": nq,
        "num_trajectories": nt,
        "num_tokens": tokens,
        "num_runs": nr,
        "runs": runs,
    }
    return jsonwrite.dumps(answer)


async def rebuild_pool_index(ctx: Context, pool: Pool) -> dict[str, int]:
    """Rebuild the sampling index of every scope of a pool from the database."""
    async with ctx.db.read() as session:
        runs = await repo.list_runs(session, pool.id)
        scopes = {scope_of(pool, r) for r in runs}
        members = {scope: await rebuild_index(ctx, session, scope) for scope in scopes}
    return {str(k): v for k, v in members.items()}
