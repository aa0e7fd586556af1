"""The collection rules (spec 2-3) applied to graded groups: shared by batch commit and ingest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_client import schemas as s
from exgrpo_pool.domain import (
    ExperienceRules,
    GroupAction,
    GroupDecision,
    decide_group,
    solved_fraction_of,
    trajectory_key,
)
from exgrpo_pool.errors import BadRequest
from exgrpo_pool.index.base import Move
from exgrpo_pool.service.convert import RunScopes, packed_of, pool_config
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import AnyPool, is_pool_scope, utcnow


@dataclass
class Applied:
    retired: int = 0
    collected: int = 0
    ignored: int = 0
    stored: int = 0
    duplicates: int = 0
    bucket_moves: int = 0
    removed: int = 0
    #: the groups' rollouts and the correct ones among them (`solved`)
    rollouts: int = 0
    correct: int = 0
    moves: list[Move] = field(default_factory=list)
    #: moves of other state scopes (a capacity eviction of shared trajectories)
    other_moves: dict[int, list[Move]] = field(default_factory=dict)

    def solved(self) -> float:
        """The fraction of correct rollouts among the groups' (``batch/solved``), counted while
        the groups were decided: `solved_fraction` of their rewards."""
        return solved_fraction_of(self.correct, self.rollouts)


@dataclass(frozen=True, slots=True)
class Capacity:
    """A pool's limits on its stored trajectories (None: no limit)."""

    per_question: int | None = None
    payload_bytes: int | None = None


def capacity_of(pool: AnyPool) -> Capacity:
    config = pool_config(pool)
    return Capacity(config.max_trajectories_per_question, config.max_payload_bytes)


@dataclass
class _Final:
    """Where a question ends up after all its groups in one request (a question may appear in
    two groups of one batch: once fresh and once replayed)."""

    last_k: int
    kind: str = "ignore"
    bucket: int | None = None


def check_group_sizes(groups: list[s.GroupResult], rules: ExperienceRules) -> None:
    for i, g in enumerate(groups):
        if len(g.rollouts) != rules.k:
            raise BadRequest(
                f"groups[{i}] (question {g.question_id}) has {len(g.rollouts)} rollouts, but the pool's "
                f"K is {rules.k}: send exactly K rollouts per group (replayed row included)"
            )
        replayed = sum(r.replayed for r in g.rollouts)
        if replayed > 1:
            raise BadRequest(
                f"groups[{i}] (question {g.question_id}) marks {replayed} rollouts as replayed; "
                "a group has at most one replayed trajectory"
            )


async def apply_groups(
    session: AsyncSession,
    *,
    pool_id: int,
    run_id: int,
    scopes: RunScopes,
    rules: ExperienceRules,
    groups: list[s.GroupResult],
    collect: bool,
    step: int,
    policy_version: int,
    experience: bool = True,
    capacity: Capacity = Capacity(),
) -> Applied:
    """Retire, bucket and store in the caller's transaction. Validates everything before the first
    write, so a bad request changes nothing (and the transaction rolls back on any error anyway).

    States go to `scopes.state`, trajectories to `scopes.trajectories` (de-duplicated there); a
    retirement removes the question's trajectories where the retiring scope owns them.

    `experience=False` (a GRPO run): nothing is retired or collected, and a shared state scope is
    left alone (the run's own scope still records each question's latest k).

    The payloads are decoded and checked already, also the ones not stored (bad data is refused
    consistently), before any lock: the routes do it (`Wire.prepare`: a frame's handed to the
    rollouts, a JSON body's by `predecode`)."""
    scope = scopes.state
    check_group_sizes(groups, rules)
    out = Applied()
    finals: dict[int, _Final] = {}
    traj_rows: list[dict[str, Any]] = []
    now = utcnow()
    for gi, g in enumerate(groups):
        rewards = [r.reward for r in g.rollouts]
        decision = decide_group(rewards, rules, collect=collect)
        out.rollouts += len(rewards)
        out.correct += decision.num_correct
        if not experience:
            decision = GroupDecision(GroupAction.IGNORE, decision.num_correct, None, ())
        final = finals.setdefault(g.question_id, _Final(last_k=decision.num_correct))
        final.last_k = decision.num_correct
        if decision.action == GroupAction.RETIRE:
            out.retired += 1
            final.kind, final.bucket = "retire", None
        elif decision.action == GroupAction.COLLECT:
            out.collected += 1
            if final.kind != "retire":
                final.kind, final.bucket = "collect", decision.bucket
            for ri in decision.store:
                r = g.rollouts[ri]
                if r.replayed:
                    continue  # the stored trajectory itself: already in the pool
                packed = packed_of(r)
                if packed is None:
                    raise BadRequest(
                        f"groups[{gi}].rollouts[{ri}] (question {g.question_id}) is correct and its "
                        "group is collected: send its token ids and log-probs"
                    )
                ids, lps = packed
                traj_rows.append(
                    {
                        "question_id": g.question_id,
                        "pool_id": pool_id,
                        "scope": scopes.trajectories,
                        "source_run_id": run_id,
                        "policy_version": policy_version,
                        "step": step,
                        "token_ids": ids,
                        "logprobs": lps,
                        "num_tokens": len(ids) // 4,
                        "reward": float(r.reward),
                        "entropy": r.entropy,
                        "dedup_key": trajectory_key(ids),  # of the little-endian int32 bytes
                        "text": r.text,
                        "created_at": now,
                    }
                )
        else:
            out.ignored += 1

    if is_pool_scope(scope):
        # Every run of a pooled pool writes the same state rows (a per-run scope is already
        # serialised by its run's row lock): one writer at a time, or two requests touching the
        # same questions in different orders deadlock on Postgres.
        await repo.lock_pool(session, pool_id)
    sent = 8 * sum(int(r["num_tokens"]) for r in traj_rows)
    if capacity.payload_bytes is not None and sent > capacity.payload_bytes:
        raise BadRequest(
            f"this request would store {sent} bytes of token ids and log-probs, more than the pool's "
            f"max_payload_bytes ({capacity.payload_bytes}): send fewer groups per request, or raise "
            "the limit (PATCH the pool's config)"
        )
    if not experience and is_pool_scope(scope):
        finals.clear()
    old = await repo.get_states(session, scope, list(finals))
    state_rows: list[dict[str, Any]] = []
    retired_now: list[int] = []
    for qid, f in finals.items():
        prev_bucket, was_retired = old.get(qid, (None, False))
        if was_retired:
            prev_bucket = None
        if f.kind == "retire":
            retired_now.append(qid)
        state_rows.append(
            {
                "scope": scope,
                "question_id": qid,
                "pool_id": pool_id,
                "last_k": f.last_k,
                "bucket": f.bucket if f.kind == "collect" else None,
                "retired": f.kind == "retire",
                "last_step": step,
                "last_run_id": run_id,
                "updated_at": now,
            }
        )
        new_bucket = prev_bucket
        if f.kind == "retire":
            new_bucket = None
        elif f.kind == "collect" and not was_retired:
            new_bucket = f.bucket
        if new_bucket != prev_bucket or (f.kind == "retire" and not was_retired):
            out.moves.append((qid, new_bucket))
            out.bucket_moves += int(new_bucket != prev_bucket)
    await repo.upsert_decided_states(session, state_rows)
    candidates = len(traj_rows)
    out.stored = await repo.insert_trajectories(session, traj_rows)
    out.duplicates = candidates - out.stored
    if scopes.drops_retired and retired_now:
        out.removed = await repo.delete_trajectories(session, scopes.trajectories, retired_now)
    await _enforce_capacity(session, pool_id, scopes, capacity, [r["question_id"] for r in traj_rows], out)
    return out


async def _enforce_capacity(
    session: AsyncSession,
    pool_id: int,
    scopes: RunScopes,
    capacity: Capacity,
    touched: list[int],
    out: Applied,
) -> None:
    """Evict what the pool's limits do not hold: beyond `per_question`, a question's oldest
    trajectories of the scope written; beyond `payload_bytes`, the pool's oldest (never this
    request's own: it was refused above if it alone is over). A question left without any
    trajectory in a scope leaves the buckets of the states that replay from that scope."""
    if capacity.per_question is not None and touched:
        out.removed += await repo.trim_trajectories(
            session, scopes.trajectories, touched, capacity.per_question
        )
    if capacity.payload_bytes is None:
        return
    over = 8 * await repo.pool_tokens(session, pool_id) - capacity.payload_bytes
    if over <= 0:
        return
    evicted = await repo.evict_oldest(session, pool_id, over)
    out.removed += len(evicted)
    by_scope: dict[int, set[int]] = {}
    for tscope, qid in evicted:
        by_scope.setdefault(tscope, set()).add(qid)
    for tscope, qids in by_scope.items():
        empty = qids - await repo.questions_with_trajectories(session, list(qids), scope=tscope)
        if not empty:
            continue
        # a run's own trajectories feed its own states; the pool's feed every state of the pool
        reading = None if is_pool_scope(tscope) else tscope
        for sscope, qid in await repo.clear_buckets(session, pool_id, sorted(empty), reading):
            if sscope == scopes.state:
                out.moves.append((qid, None))
                out.bucket_moves += 1
            else:
                out.other_moves.setdefault(sscope, []).append((qid, None))
