"""Plan and commit of one training step, replay-only selection and direct ingest."""

from __future__ import annotations

import logging
import secrets
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from pydantic_core import to_jsonable_python
from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_client import schemas as s
from exgrpo_pool.domain import (
    Draw,
    ExperienceRules,
    compose_batch,
    epoch_order,
    make_rng,
    next_phase,
    refresh_active,
    sample_replay,
    take_fresh,
)
from exgrpo_pool.errors import BadRequest, Conflict, NotFound
from exgrpo_pool.index.base import Move, RebuildLost
from exgrpo_pool.service.context import Context, KnownSizes
from exgrpo_pool.service.convert import (
    COMMIT_DIGEST,
    Answer,
    RunScopes,
    committed_result,
    rules_for,
    run_overrides,
    same_commit,
    scopes_of,
    stored_plan,
    trajectory_body,
)
from exgrpo_pool.service.experience import Applied, apply_groups, capacity_of
from exgrpo_pool.service.leases import (
    LeaseClaim,
    check_fence,
    lock_run,
    missing_pool,
    read_run,
)
from exgrpo_pool.service.stats import collect_run_stats
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import (
    AnyBatch,
    AnyPool,
    AnyRun,
    Batch,
    BatchRow,
    Pool,
    PoolRow,
    Run,
    RunRow,
    utcnow,
)

log = logging.getLogger("exgrpo.pool")


# --------------------------------------------------------------------------------- the index
#: rebuilds of one scope tried in a row while writers keep changing it (then the next use retries)
REBUILD_ATTEMPTS = 3


async def rebuild_index(ctx: Context, session: AsyncSession, scope: int) -> int:
    """Rebuild a scope from the database. The generation is read before the members: a change
    that lands in between leaves the rebuilt scope not loaded, and it is rebuilt again."""
    members: dict[int, list[int]] = {}
    for _ in range(REBUILD_ATTEMPTS):
        generation = await ctx.index.generation(scope)
        members = await repo.bucket_members(session, scope)
        try:
            loaded = await ctx.index.replace(scope, members, generation=generation)
        except RebuildLost:
            continue
        ctx.metrics.index_rebuilds.inc()
        if loaded:
            ctx.stale_scopes.discard(scope)
            break
    return sum(len(v) for v in members.values())


async def index_sizes(ctx: Context, session: AsyncSession, scope: int) -> dict[int, int]:
    """The scope's bucket sizes: one index call when the scope is loaded, a rebuild and one more
    call when it is stale or not loaded."""
    entry = ctx.known_sizes.get(scope)
    sizes = None if scope in ctx.stale_scopes else await ctx.index.loaded_sizes(scope)
    if sizes is None:
        await rebuild_index(ctx, session, scope)
        sizes = await ctx.index.sizes(scope)
    _know(ctx, scope, entry, KnownSizes(sizes, True if entry is None else entry.quiet))
    return sizes


def _know(ctx: Context, scope: int, entry: KnownSizes | None, new: KnownSizes) -> None:
    """Keep `new` for the scope unless its entry changed from `entry` while it was read (a write
    moved the sizes meanwhile: what was read may be from before)."""
    if ctx.known_sizes.get(scope) is entry:
        ctx.known_sizes[scope] = new


async def _select_draws(
    ctx: Context,
    session: AsyncSession,
    scope: int,
    n: int,
    rules: ExperienceRules,
    rng: Callable[[], np.random.Generator],
) -> tuple[dict[int, int], list[Draw], dict[int, list[int]]]:
    """A selection's sizes, draws and picked ids. While the scope looks quiet and this replica knows
    its sizes (`KnownSizes`), one trip to the index: the draws are made from them and `pick_sized`
    checks them as it picks. Else two, as a plan's: the sizes (checked against those known, to find
    the scope quiet again), then the picks. Sizes found out of date by the one-trip way come back
    instead of picks; the draws are made again from them, picked, and the scope no longer looks
    quiet. `rng` gives the generator afresh: the draws are those of sizes read first, either way.
    A scope not loaded, or stale here, is rebuilt first (`index_sizes`)."""
    entry = ctx.known_sizes.get(scope)
    if scope not in ctx.stale_scopes:
        known = entry or KnownSizes(None)
        if known.sizes is not None and known.quiet:
            draws = sample_replay(known.sizes, n, rules, rng()) if known.sizes else []
            ids, now = await ctx.index.pick_sized(scope, known.sizes, _ranks(draws))
            if ids is not None:
                return known.sizes, draws, ids
            quiet = False
        else:
            ids, now = await ctx.index.pick_sized(scope, known.sizes or {}, {})
            quiet = known.quiet if known.sizes is None else ids is not None
        if now is not None:
            _know(ctx, scope, entry, KnownSizes(now, quiet))
            return now, *await _draw_replay(ctx, scope, now, n, rules, rng())
        if ctx.known_sizes.get(scope) is entry:
            ctx.known_sizes.pop(scope, None)
    sizes = await index_sizes(ctx, session, scope)
    return sizes, *await _draw_replay(ctx, scope, sizes, n, rules, rng())


def _ranks(draws: Sequence[Draw]) -> dict[int, list[int]]:
    ranks: dict[int, list[int]] = {}
    for d in draws:
        ranks.setdefault(d.bucket, []).append(d.index)
    return ranks


async def _apply_moves(ctx: Context, scope: int, applied: Applied) -> None:
    """Make the index follow a write once its transaction has committed (at the end of the
    request's shared transaction, if there is one)."""
    await ctx.db.after_commit(lambda: _follow(ctx, scope, applied.moves))


async def _follow(ctx: Context, scope: int, moves: list[Move]) -> None:
    """After the database commit, which stands whatever happens here: if the index cannot follow
    (Redis down), the scope is marked stale, in Redis if it answers and in this process anyway,
    and rebuilt from the database on its next use."""
    try:
        await ctx.index.apply(scope, moves)
        # the sizes known here are out of date (forgotten after the moves, and the entry replaced:
        # a read meanwhile may have seen them as they were before, and keeps nothing)
        if moves:
            known = ctx.known_sizes.get(scope)
            ctx.known_sizes[scope] = KnownSizes(None, True if known is None else known.quiet)
        return
    except Exception:
        log.warning("index update failed; scope %s will be rebuilt", scope, exc_info=True)
    ctx.stale_scopes.add(scope)
    try:
        await ctx.index.drop(scope)
    except Exception:
        log.warning("index of scope %s could not be marked stale", scope, exc_info=True)


async def _apply_all_moves(ctx: Context, scope: int, applied: Applied) -> None:
    await _apply_moves(ctx, scope, applied)
    for other, moves in applied.other_moves.items():
        await _apply_moves(ctx, other, Applied(moves=moves))


# ----------------------------------------------------------------------------- fresh questions
async def _epoch(ctx: Context, session: AsyncSession, run: RunRow) -> np.ndarray | None:
    if run.epoch < 0:
        return None
    key = (run.id, run.epoch)
    order = ctx.epoch_cache.get(key)
    if order is None:
        order = await repo.get_epoch(session, run.id, run.epoch)
        if order is not None:
            ctx.epoch_cache = {k: v for k, v in ctx.epoch_cache.items() if k[0] != run.id}
            ctx.epoch_cache[key] = order
    return order


async def _draw_fresh(
    ctx: Context,
    session: AsyncSession,
    pool: PoolRow,
    run: RunRow,
    rules: ExperienceRules,
    scope: int,
    *,
    experience: bool,
) -> np.ndarray:
    """The next B questions of the run's epoch order (a new epoch starts when fewer remain). A GRPO
    run (no experience) keeps every question in its epochs, whatever other runs retired."""
    size = rules.batch_size
    order = await _epoch(ctx, session, run)
    nxt = take_fresh(order, run.cursor, size) if order is not None else None
    if nxt is None:
        all_ids = await repo.question_ids(session, pool.id)
        if all_ids.size < size:
            raise Conflict(
                f"pool {pool.name!r} has {all_ids.size} questions, fewer than the batch size {size}: "
                "import more questions or plan with a smaller batch_size"
            )
        previous = None if order is None else np.sort(order)
        retired = await repo.retired_ids(session, scope) if experience else np.empty(0, dtype=np.int64)
        active = refresh_active(all_ids, retired, previous, rules)
        run.epoch += 1
        order = epoch_order(active, seed=run.seed, epoch=run.epoch)
        await repo.put_epoch(session, run.id, run.epoch, order)
        ctx.epoch_cache = {k: v for k, v in ctx.epoch_cache.items() if k[0] != run.id}
        ctx.epoch_cache[(run.id, run.epoch)] = order
        nxt = take_fresh(order, 0, size)
        if nxt is None:
            raise Conflict(
                f"run {run.name!r}: only {order.size} active questions, fewer than batch size {size}"
            )
    ids, run.cursor = nxt
    return ids


# ----------------------------------------------------------------------------- replay choice
#: what `_pick_replay` reads of the candidates when they do not go out whole (`all` reads all),
#: their steps too under a `max_replay_age`; ids only (`none`) reads which questions have one,
#: with the picks' states (`repo.picked_states`).
_CANDIDATE_COLUMNS: dict[str, tuple[str, ...]] = {
    "lowest_stored_entropy": ("id", "question_id", "entropy"),
}


@dataclass(slots=True)
class _Pick:
    """A replayed question as `_pick_replay` draws it: the fields of `StoredPick`, without a
    model validated per question (~2-3 us each, 64 a selection) where nothing is stored; a plan
    stores them as `StoredPick`s (`stored`)."""

    question_id: int
    bucket: int
    probability: float
    candidates: list[int] = field(default_factory=list)

    def stored(self) -> s.StoredPick:
        return s.StoredPick(
            question_id=self.question_id,
            bucket=self.bucket,
            probability=self.probability,
            candidates=self.candidates,
        )


async def _draw_replay(
    ctx: Context, scope: int, sizes: dict[int, int], n: int, rules: ExperienceRules, rng: np.random.Generator
) -> tuple[list[Draw], dict[int, list[int]]]:
    """Draws from sizes just read, and the ids the index picks for them (a plan's, and a selection's
    that read its sizes first)."""
    draws = sample_replay(sizes, n, rules, rng)
    return draws, await ctx.index.pick(scope, _ranks(draws))


async def _pick_replay(
    ctx: Context,
    session: AsyncSession,
    scopes: RunScopes,
    sizes: dict[int, int],
    drawn: tuple[list[Draw], dict[int, list[int]]],
    rules: ExperienceRules,
    mode: s.CandidateMode,
    step: int,
    *,
    prompts: bool = False,
) -> tuple[list[_Pick], dict[int, Row[Any]], dict[int, dict[str, Any]] | None]:
    """The replayed questions, each with its candidates' ids, the candidates' rows as read (with
    their payloads when every candidate goes out, `all`, else without: `_replay_items` reads the
    payloads of the chosen ones by id), and the picked questions as the answer shows them where
    they were read on the way (`prompts`, ids only: the picks' states, whether each has a
    trajectory and its question in one statement, `repo.picked_states`; else None). `drawn`: the
    draws from `sizes` and the ids the index picked for them (`_draw_replay`, `_select_draws`).
    `step`: the run's current step; with `rules.max_replay_age` a trajectory collected more than
    that many steps before it is no candidate, and a question left without one is dropped like a
    vanished pick."""
    scope = scopes.state
    draws, ids = drawn
    picks: list[_Pick] = []
    cursor: dict[int, int] = {}
    for d in draws:
        members = ids[d.bucket]
        at = cursor.get(d.bucket, 0)
        if at < len(members):
            # question, bucket, and the question's probability: its bucket's, shared by the
            # bucket's questions (uniform within); positional (~0.1 us a pick less)
            picks.append(_Pick(int(members[at]), int(d.bucket), float(d.probability / sizes[d.bucket])))
        cursor[d.bucket] = at + 1
    oldest = None if rules.max_replay_age is None else step - rules.max_replay_age
    ids_only = mode == "none"  # no candidate goes out: a question needs one stored, that is all
    # the database is the source of truth: drop picks a concurrent writer retired meanwhile
    qids = [p.question_id for p in picks]
    picked: dict[int, repo.PickedState] = {}
    states: Mapping[int, tuple[Any, ...]]
    if ids_only:
        picked = await repo.picked_states(
            session, scope, qids, stored_in=scopes.trajectories, min_step=oldest, prompts=prompts
        )
        states = picked
    else:
        states = await repo.get_states(session, scope, qids)
    valid = [p for p in picks if (st := states.get(p.question_id)) is not None and not st[1] and st[0]]
    if len(valid) != len(picks):
        log.warning("index out of date for scope %s: %d stale picks dropped", scope, len(picks) - len(valid))
        await ctx.index.drop(scope)
    if ids_only:
        kept = [p for p in valid if picked[p.question_id][2]]
        questions = None
        if prompts:
            questions = {p.question_id: q for p in kept if (q := picked[p.question_id][3]) is not None}
        return kept, {}, questions
    only = _CANDIDATE_COLUMNS.get(mode)
    trajs = await repo.trajectories_of(
        session,
        [p.question_id for p in valid],
        scope=scopes.trajectories,
        payload=mode == "all",
        only=None if only is None else only + (() if oldest is None else ("step",)),
    )
    out = []
    rows: dict[int, Row[Any]] = {}
    for p in valid:
        cands = trajs.get(p.question_id, [])
        if oldest is not None:
            cands = [t for t in cands if t.step >= oldest]
        if not cands:
            continue
        if mode == "lowest_stored_entropy":
            best = min(cands, key=lambda t: (t.entropy is None, t.entropy or 0.0, t.id))
            p.candidates = [best.id]
        elif mode == "all":
            p.candidates = [t.id for t in cands]
            rows.update((t.id, t) for t in cands)  # type: ignore[misc]  # rows read like Trajectory
        out.append(p)
    return out, rows, None


async def _replay_items(
    session: AsyncSession,
    picks: Sequence[s.StoredPick | _Pick],
    k: int,
    *,
    questions: dict[int, dict[str, Any]] | None = None,
    rows: dict[int, Row[Any]] | None = None,
    run: AnyRun | None = None,
) -> tuple[list[dict[str, Any]], list[tuple[bytes, bytes]]]:
    """The answer's replayed questions with their candidates, and the candidates' payloads in
    order. `questions` and `rows`: what the caller has read already (the rest is read here, by
    id); `run`: a run whose name the caller knows (the other source runs' names are read)."""
    qids = [p.question_id for p in picks]
    if questions is None or any(q not in questions for q in qids):
        questions = {**(questions or {}), **await repo.question_prompts(session, qids)}
    rows = dict(rows or {})
    # a candidate no longer stored (retired or evicted since) is left out of the answer
    missing = [t for p in picks for t in p.candidates if t not in rows]
    if missing:
        rows.update(await repo.trajectories_by_id(session, missing, payload=True))
    known = {} if run is None else {run.id: run.name}
    sources = {t.source_run_id for t in rows.values() if t.source_run_id and t.source_run_id not in known}
    names = {**known, **await repo.run_names(session, sources)}
    items = []
    payloads: list[tuple[bytes, bytes]] = []
    for p in picks:
        q = questions[p.question_id]
        cands = [rows[t] for t in p.candidates if t in rows]
        payloads += [(t.token_ids, t.logprobs) for t in cands]
        items.append(
            {
                **q,
                "num_samples": k - 1,
                "bucket": p.bucket,
                "probability": p.probability,
                "candidates": [trajectory_body(t, names) for t in cands],
            }
        )
    return items, payloads


async def _plan_public(
    session: AsyncSession,
    pool: AnyPool,
    run: AnyRun,
    batch: AnyBatch,
    plan: s.StoredPlan | None = None,
    rows: dict[int, Row[Any]] | None = None,
) -> Answer:
    """A batch's plan as answered (`BatchPlan`): one read of its questions, and of the candidates
    that `rows` (read by the plan) does not hold."""
    plan = stored_plan(batch) if plan is None else plan
    k = plan.k
    questions = await repo.question_prompts(session, [*plan.fresh, *(p.question_id for p in plan.replay)])
    replay, payloads = await _replay_items(session, plan.replay, k, questions=questions, rows=rows, run=run)
    body = {
        "id": batch.id,
        "run": run.name,
        "pool": pool.name,
        "step": batch.step,
        "phase": batch.phase,
        "status": batch.status,
        "policy_version": batch.policy_version,
        "k": k,
        # a planned question (`FreshItem`): its prompt as stored (validated on import)
        "fresh": [{**questions[i], "num_samples": k} for i in plan.fresh],
        "replay": replay,
        "num_eligible": plan.num_eligible,
        "skipped_fresh": plan.skipped_fresh,
        "epoch": plan.epoch,
        "created_at": to_jsonable_python(batch.created_at),
    }
    return Answer(s.BatchPlan, body, payloads)


# ------------------------------------------------------------------------------------ plan
async def _plan_version(session: AsyncSession, run: RunRow, req: s.BatchCreate) -> int:
    """The policy version a plan's tasks are generated with: the one it names, which must be
    published for the run, or the run's newest."""
    if req.policy_version is None:
        version = run.policy_version
    else:
        version = req.policy_version
        if await repo.get_policy_version(session, run.id, version) is None:
            published = [p.version for p in await repo.policy_versions(session, run.id)]
            raise Conflict(
                f"run {run.name!r} has no published policy version {version} (published: "
                f"{published[-20:] or 'none'}); publish it first (POST .../runs/{run.name}/policy-versions)"
            )
    if req.min_policy_version is not None and req.min_policy_version > version:
        raise BadRequest(
            f"min_policy_version {req.min_policy_version} is above the batch's policy version {version}: "
            "the oldest version allowed cannot be newer than the one planned with"
        )
    return version


def _task_rows(
    batch: BatchRow, fresh: list[int], picks: list[_Pick], k: int, req: s.BatchCreate
) -> list[dict[str, object]]:
    """One generation task per planned question: K samples of a fresh one, K-1 of a replayed one,
    to be generated with exactly the batch's policy version, or (asynchronous plans) with any
    published version from `min_policy_version` on, sampled as the plan says."""
    exact = req.min_policy_version is None
    common = {
        "batch_id": batch.id,
        "run_id": batch.run_id,
        "policy_version": batch.policy_version if exact else req.min_policy_version,
        "policy_exact": exact,
        "sampling": None if req.sampling is None else req.sampling.model_dump(),
        "status": "pending",
        "attempts": 0,
        "created_at": utcnow(),
        "updated_at": utcnow(),
    }
    return [{**common, "question_id": q, "num_samples": k, "replayed": False} for q in fresh] + [
        {**common, "question_id": p.question_id, "num_samples": k - 1, "replayed": True} for p in picks
    ]


async def plan_batch(
    ctx: Context, pool_name: str, run_name: str, req: s.BatchCreate, lease: LeaseClaim | None = None
) -> Answer:
    async with ctx.db.write() as session:
        pool, run = await lock_run(session, pool_name, run_name, lease)
        version = await _plan_version(session, run, req)
        step = run.step + 1
        existing = await repo.open_batch(session, run.id, step)
        if existing is not None and not req.replan:
            return await _plan_public(session, pool, run, existing)
        if existing is not None:
            await repo.update_batch(session, existing.id, {"status": "abandoned"})
            await repo.cancel_batch_tasks(session, existing.id)
        rules = rules_for(pool, run)
        rules = replace(
            rules,
            batch_size=req.batch_size or rules.batch_size,
            experience_ratio=rules.experience_ratio if req.experience_ratio is None else req.experience_ratio,
        )
        scopes = scopes_of(pool, run)
        scope = scopes.state
        sizes = await index_sizes(ctx, session, scope)
        experience = run_overrides(run).experience
        phase = run.phase if experience else "on_policy"
        comp = compose_batch(sum(sizes.values()), rules, phase=phase)
        drawn = await _draw_fresh(ctx, session, pool, run, rules, scope, experience=experience)
        fresh = [int(q) for q in drawn[: rules.batch_size - comp.num_replay]]
        replay = await _draw_replay(
            ctx, scope, sizes, comp.num_replay, rules, make_rng(run.seed, step, "replay")
        )
        picks, rows, _ = await _pick_replay(
            ctx, session, scopes, sizes, replay, rules, req.candidates, run.step
        )
        # a pick can vanish (stale index); its slot goes to the next loader-drawn question
        fill = rules.batch_size - len(fresh) - len(picks)
        if fill > 0:
            fresh += [int(q) for q in drawn[len(fresh) : len(fresh) + fill]]
        plan = s.StoredPlan(
            k=rules.k,
            fresh=fresh,
            replay=[p.stored() for p in picks],
            num_eligible=sum(sizes.values()),
            skipped_fresh=rules.batch_size - len(fresh),
            epoch=run.epoch,
            batch_size=rules.batch_size,
        )
        now = utcnow()
        batch = BatchRow(
            id=str(uuid.uuid4()),
            run_id=run.id,
            step=step,
            status="planned",
            phase=phase,
            policy_version=version,
            plan=plan.model_dump(),
            result=None,
            created_at=now,
        )
        await repo.insert_batch(session, batch)
        if req.create_tasks:
            await repo.insert_tasks(session, _task_rows(batch, fresh, picks, rules.k, req))
        # what `_draw_fresh` moved on (the epoch and the cursor)
        await repo.update_run(session, run.id, {"epoch": run.epoch, "cursor": run.cursor, "updated_at": now})
        ctx.metrics.batches_planned.labels(pool.name).inc()
        ctx.metrics.replay_picks.labels(pool.name).inc(len(picks))
        return await _plan_public(session, pool, run, batch, plan, rows)


async def get_batch_plan(ctx: Context, pool_name: str, batch_id: str) -> Answer:
    async with ctx.db.read() as session:
        found = await repo.batch_rows(session, pool_name, batch_id)
        if found is None:
            raise await _missing_batch(session, pool_name, batch_id)
        pool, run, batch, _ = found
        return await _plan_public(session, pool, run, batch)


async def _missing_batch(session: AsyncSession, pool_name: str, batch_id: str) -> NotFound:
    """The 404 of a batch that `repo.batch_rows` did not find."""
    if not await repo.pool_exists(session, pool_name):
        return missing_pool(pool_name)
    return _no_batch(pool_name, batch_id)


def _no_batch(pool_name: str, batch_id: str) -> NotFound:
    return NotFound(f"batch {batch_id!r} does not exist in pool {pool_name!r}")


async def _batch_and_run(session: AsyncSession, pool: Pool, batch_id: str) -> tuple[Batch, Run]:
    batch = await repo.get_batch(session, batch_id)
    run = None if batch is None else await repo.get_run_by_id(session, batch.run_id)
    if batch is None or run is None or run.pool_id != pool.id:
        raise _no_batch(pool.name, batch_id)
    return batch, run


# ---------------------------------------------------------------------------------- commit
def _check_against_plan(batch_id: str, plan: s.StoredPlan, groups: list[s.GroupResult]) -> None:
    expected = Counter([(q, False) for q in plan.fresh] + [(p.question_id, True) for p in plan.replay])
    got = Counter((g.question_id, any(r.replayed for r in g.rollouts)) for g in groups)
    if expected == got:
        return
    missing, extra = expected - got, got - expected
    parts = []
    # a planned question sent as the other kind (fresh as replayed, or replayed without its row)
    for (q, rep), n in sorted((missing & Counter({(q, not r): n for (q, r), n in extra.items()})).items()):
        missing[(q, rep)] -= n
        extra[(q, not rep)] -= n
        if rep:
            parts.append(
                f"question {q} is replayed in this batch: its group holds the stored trajectory as a "
                "row with replayed=true (reward included) and K-1 generated rows"
            )
        else:
            parts.append(
                f"question {q} is fresh in this batch: its group holds K generated rows, none marked "
                "replayed=true"
            )
    absent = sorted(missing.elements())
    unplanned = sorted(extra.elements())
    if absent:
        parts.append(f"missing groups of question ids {[q for q, _ in absent][:20]}")
    if unplanned:
        parts.append(f"question ids {[q for q, _ in unplanned][:20]} are not planned in it (or sent twice)")
    raise BadRequest(
        f"groups do not match batch {batch_id}: {'; '.join(parts[:20])} (send one group per planned question)"
    )


async def commit_batch(
    ctx: Context,
    pool_name: str,
    batch_id: str,
    req: s.BatchCommit,
    lease: LeaseClaim | None,
    digest: Awaitable[str],
) -> s.CommitResult:
    """`digest`: `commit_digest(req)`, hashed by the route in a thread (the payload hashed once:
    its idempotency record's digest is made from it too), awaited beside the writes below."""
    async with ctx.db.write() as session:
        found = await repo.batch_rows(session, pool_name, batch_id, lock=True)
        if found is None:
            raise await _missing_batch(session, pool_name, batch_id)
        pool, run, batch, lease_row = found
        await check_fence(session, run.id, run.name, lease_row, lease)
        if batch.status == "committed":
            if not same_commit(batch, req, await digest):
                raise Conflict(
                    f"batch {batch_id} is already committed (step {batch.step}) with other groups; "
                    "a commit is applied once: plan the next batch for new results"
                )
            return committed_result(batch)
        if batch.status == "abandoned":
            raise Conflict(f"batch {batch_id} was abandoned (re-planned); plan a new batch")
        if batch.step != run.step + 1:
            raise Conflict(
                f"batch {batch_id} is for step {batch.step} but run {run.name!r} is at step "
                f"{run.step}; plan a new batch"
            )
        plan = stored_plan(batch)
        _check_against_plan(batch.id, plan, req.groups)
        rules = rules_for(pool, run)
        scopes = scopes_of(pool, run)
        version = batch.policy_version if req.policy_version is None else req.policy_version
        experience = run_overrides(run).experience
        applied = await apply_groups(
            session,
            pool_id=pool.id,
            run_id=run.id,
            scopes=scopes,
            rules=rules,
            groups=req.groups,
            collect=batch.phase == "mixed",
            experience=experience,
            capacity=capacity_of(pool),
            step=batch.step,
            policy_version=version,
        )
        solved = applied.solved()
        switched = False
        if experience and run.phase == "on_policy" and next_phase("on_policy", solved, rules) == "mixed":
            run.phase, run.switched_at_step, switched = "mixed", batch.step, True
        run.step = batch.step
        run.policy_version = max(run.policy_version, version)
        run.updated_at = utcnow()
        await repo.update_run(
            session,
            run.id,
            {
                "phase": run.phase,
                "switched_at_step": run.switched_at_step,
                "step": run.step,
                "policy_version": run.policy_version,
                "updated_at": run.updated_at,
            },
        )
        batch.status = "committed"
        await repo.merge_run_metrics(
            session,
            run.id,
            batch.step,
            {
                **req.metrics,
                "batch/solved": solved,
                "batch/replayed_questions": float(len(plan.replay)),
                "pool/stored_trajectories": float(applied.stored),
                "pool/retired": float(applied.retired),
            },
        )
        result = _result(batch.id, run, solved, switched, applied)
        if req.with_stats:
            # read in this transaction, after its writes: the state the commit leaves behind
            result.stats = await collect_run_stats(ctx, session, pool, run, replayed=len(plan.replay))
        await repo.update_batch(
            session,
            batch.id,
            {
                "status": "committed",
                "metrics": {**req.metrics, "batch/solved": solved},
                "committed_at": utcnow(),
                # a replayed commit answers exactly this, stats included
                "result": {**result.model_dump(), COMMIT_DIGEST: await digest},
            },
        )
    await _apply_all_moves(ctx, scopes.state, applied)
    ctx.metrics.batches_committed.labels(pool.name).inc()
    ctx.metrics.run_solved.labels(pool.name, run.name).set(solved)
    _count(ctx, pool, applied)
    return result


def _result(batch_id: str | None, run: RunRow, solved: float, switched: bool, a: Applied) -> s.CommitResult:
    return s.CommitResult(
        batch_id=batch_id,
        run=run.name,
        step=run.step,
        phase=run.phase,
        switched=switched,
        solved_fraction=solved,
        retired=a.retired,
        collected_groups=a.collected,
        ignored_groups=a.ignored,
        stored_trajectories=a.stored,
        duplicate_trajectories=a.duplicates,
        bucket_moves=a.bucket_moves,
        removed_trajectories=a.removed,
    )


def _count(ctx: Context, pool: PoolRow, a: Applied) -> None:
    ctx.metrics.trajectories_ingested.labels(pool.name).inc(a.stored)
    ctx.metrics.trajectories_duplicate.labels(pool.name).inc(a.duplicates)
    ctx.metrics.retired.labels(pool.name).inc(a.retired)


# ---------------------------------------------------------------------------------- ingest
async def ingest(
    ctx: Context, pool_name: str, run_name: str, req: s.IngestRequest, lease: LeaseClaim | None = None
) -> s.CommitResult:
    """Graded groups from a producer outside the trainer, under the rules of a commit: retirement
    in both phases, collection in the mixed phase only, or also before it with `prefill`."""
    qids = sorted({g.question_id for g in req.groups})
    async with ctx.db.write() as session:
        pool, run = await lock_run(session, pool_name, run_name, lease)
        found = await repo.questions_in_pool(session, pool.id, qids)
        missing = [q for q in qids if q not in found]
        if missing:
            raise BadRequest(f"question ids {missing[:20]} are not in pool {pool.name!r}")
        experience = run_overrides(run).experience
        if req.prefill and not experience:
            raise BadRequest(
                f"run {run.name!r} is plain GRPO (experience=false) and keeps no experience: "
                "pre-fill through a run with experience"
            )
        scopes = scopes_of(pool, run)
        applied = await apply_groups(
            session,
            pool_id=pool.id,
            run_id=run.id,
            scopes=scopes,
            rules=rules_for(pool, run),
            groups=req.groups,
            collect=run.phase == "mixed" or req.prefill,
            experience=experience,
            capacity=capacity_of(pool),
            step=run.step if req.step is None else req.step,
            policy_version=req.policy_version,
        )
        solved = applied.solved()
        result = _result(None, run, solved, False, applied)
    await _apply_all_moves(ctx, scopes.state, applied)
    _count(ctx, pool, applied)
    return result


# ---------------------------------------------------------------------------------- select
async def select_replay(ctx: Context, pool_name: str, run_name: str, req: s.SelectRequest) -> Answer:
    async with ctx.db.read() as session:
        pool, run = await read_run(session, pool_name, run_name)
        scopes = scopes_of(pool, run)
        seed = secrets.randbits(63) if req.seed is None else req.seed
        rules = rules_for(pool, run)
        sizes, draws, ids = await _select_draws(
            ctx, session, scopes.state, req.n, rules, lambda: make_rng(run.seed, seed, "select")
        )
        picks, rows, questions = await _pick_replay(
            ctx, session, scopes, sizes, (draws, ids), rules, req.candidates, run.step, prompts=True
        )
        items, payloads = await _replay_items(
            session, picks, rules.k, questions=questions, rows=rows, run=run
        )
    ctx.metrics.replay_picks.labels(pool.name).inc(len(items))
    body = {"run": run.name, "num_eligible": sum(sizes.values()), "replay": items}
    return Answer(s.SelectResult, body, payloads)
