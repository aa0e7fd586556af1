"""Generation tasks with leases: claim, renew, complete, fail; completed groups of a batch."""

from __future__ import annotations

import secrets
import time
from datetime import timedelta

from exgrpo_client import schemas as s
from exgrpo_pool import admission
from exgrpo_pool.errors import BadRequest, Conflict, NotFound
from exgrpo_pool.service.batches import _batch_and_run
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.convert import committed_result, decode_payload, messages
from exgrpo_pool.service.leases import require_run as _get_run
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import Pool, Task, utcnow


def _public(t: Task, run_name: str, q: repo.Question, uri: str | None) -> s.TaskPublic:
    return s.TaskPublic(
        id=t.id,
        batch_id=t.batch_id,
        run=run_name,
        question_id=t.question_id,
        prompt=messages(q.prompt),
        ground_truth=q.ground_truth,
        data_source=q.data_source,
        num_samples=t.num_samples,
        replayed=t.replayed,
        policy_version=t.policy_version,
        policy_exact=t.policy_exact,
        policy_uri=uri,
        sampling=None if t.sampling is None else s.SamplingParams.model_validate(t.sampling, strict=False),
        status=t.status,
        attempts=t.attempts,
        lease_token=t.lease_token,
        lease_expires_at=t.lease_expires_at,
    )


async def _publics(
    session: repo.AsyncSession, tasks: list[Task], names: dict[int, str]
) -> list[s.TaskPublic]:
    """The answers for tasks, with their prompts and the uri of their policy versions."""
    questions = await repo.get_questions(session, [t.question_id for t in tasks])
    uris = await repo.policy_uris(session, [(t.run_id, t.policy_version) for t in tasks])
    return [
        _public(t, names[t.run_id], questions[t.question_id], uris.get((t.run_id, t.policy_version)))
        for t in tasks
    ]


def _claimed(ctx: Context, pool: Pool, run_name: str, how: str, n: int, expired: int) -> None:
    if n:
        ctx.metrics.tasks_claimed.labels(pool.name, run_name, how).inc(n)
    if expired:
        ctx.metrics.lease_expiries.inc(expired)


async def claim(ctx: Context, pool: Pool, run_name: str, req: s.TaskClaim) -> s.TasksPublic:
    async with ctx.db.write() as session:
        run = await _get_run(session, pool, run_name)
        expires = utcnow() + timedelta(seconds=req.lease_seconds)
        tasks, expired = await repo.claim_tasks(
            session, run.id, req.worker, req.max_tasks, expires, lambda: secrets.token_hex(16)
        )
        out = await _publics(session, tasks, {run.id: run.name})
    _claimed(ctx, pool, run.name, "run", len(out), expired)
    return s.TasksPublic(data=out, count=len(out))


async def claim_pool(ctx: Context, pool: Pool, req: s.PoolTaskClaim) -> s.TasksPublic:
    """Tasks of one run of the pool, chosen fairly among the runs with claimable tasks (the
    fewest live leases first, then the oldest waiting task), all of one policy version, exactness
    and sampling settings, so a worker generates the whole answer with one loaded policy."""
    async with ctx.db.write() as session:
        run_ids: list[int] | None = None
        if req.runs is not None:
            found = await repo.run_ids_by_name(session, pool.id, req.runs)
            missing = sorted(set(req.runs) - set(found))
            if missing:
                raise NotFound(f"runs {missing[:20]} do not exist in pool {pool.name!r}")
            run_ids = list(found.values())
        expires = utcnow() + timedelta(seconds=req.lease_seconds)
        tasks, expired = await repo.claim_pool_tasks(
            session, pool.id, run_ids, req.worker, req.max_tasks, expires, lambda: secrets.token_hex(16)
        )
        names = await repo.run_names(session, [t.run_id for t in tasks])
        out = await _publics(session, tasks, names)
    _claimed(ctx, pool, out[0].run if out else "", "pool", len(out), expired)
    return s.TasksPublic(data=out, count=len(out))


async def _task(session: repo.AsyncSession, pool: Pool, task_id: int) -> tuple[Task, str]:
    task = await repo.get_task(session, task_id, lock=True)
    run = None if task is None else await repo.get_run_by_id(session, task.run_id)
    if task is None or run is None or run.pool_id != pool.id:
        raise NotFound(f"task {task_id} does not exist in pool {pool.name!r}")
    return task, run.name


async def _one(session: repo.AsyncSession, task: Task, run_name: str) -> s.TaskPublic:
    return (await _publics(session, [task], {task.run_id: run_name}))[0]


def _check_lease(task: Task, token: str) -> None:
    if task.lease_token != token:
        raise Conflict(
            f"task {task.id}: lease lost (it expired and the task was given to another worker, "
            "or the token is wrong); drop this task"
        )
    if task.status != "leased":
        raise Conflict(f"task {task.id} is {task.status}, not leased")


def _version_allowed(task: Task, version: int) -> bool:
    """An exact task takes rollouts of its version only; another one of any version from its on."""
    return version == task.policy_version if task.policy_exact else version >= task.policy_version


def _version_refusal(task: Task, version: int) -> str:
    allowed = (
        f"exactly policy version {task.policy_version}"
        if task.policy_exact
        else f"policy version {task.policy_version} or newer"
    )
    return (
        f"task {task.id} must be generated with {allowed}, the rollouts were generated with version "
        f"{version}; load that version and generate again (the task keeps its lease)"
    )


async def renew(ctx: Context, pool: Pool, task_id: int, req: s.TaskRenew) -> s.TaskPublic:
    async with ctx.db.write() as session:
        task, run_name = await _task(session, pool, task_id)
        _check_lease(task, req.lease_token)
        task.lease_expires_at = utcnow() + timedelta(seconds=req.lease_seconds)
        task.updated_at = utcnow()
        return await _one(session, task, run_name)


async def complete(ctx: Context, pool: Pool, task_id: int, req: s.TaskComplete) -> s.TaskPublic:
    async with ctx.db.write() as session:
        task, run_name = await _task(session, pool, task_id)
        if task.status == "completed" and task.lease_token == req.lease_token:
            return await _one(session, task, run_name)  # a retried completion
        _check_lease(task, req.lease_token)
        if req.policy_version is not None and not _version_allowed(task, req.policy_version):
            ctx.metrics.task_version_refusals.inc()
            raise Conflict(_version_refusal(task, req.policy_version))
        if len(req.rollouts) != task.num_samples:
            raise BadRequest(f"task {task.id} asks for {task.num_samples} samples, got {len(req.rollouts)}")
        for i, r in enumerate(req.rollouts):
            if r.replayed:
                raise BadRequest(f"rollouts[{i}]: generated samples cannot be marked replayed")
            if decode_payload(r, f"rollouts[{i}]") is None:
                raise BadRequest(f"rollouts[{i}]: send token ids and log-probs of every generated sample")
        task.status = "completed"
        task.result = [r.model_dump(exclude_none=True) for r in req.rollouts]
        # an older worker does not say: it generated with the version the task named
        task.generated_version = task.policy_version if req.policy_version is None else req.policy_version
        task.lease_expires_at = None
        task.updated_at = utcnow()
        out = await _one(session, task, run_name)
    ctx.metrics.tasks_completed.inc()
    return out


async def fail(ctx: Context, pool: Pool, task_id: int, req: s.TaskFail) -> s.TaskPublic:
    async with ctx.db.write() as session:
        task, run_name = await _task(session, pool, task_id)
        _check_lease(task, req.lease_token)
        again = req.retry and task.attempts < ctx.settings.task_max_attempts
        task.status = "pending" if again else "failed"
        task.error = req.error
        task.lease_token = None
        task.lease_expires_at = None
        task.updated_at = utcnow()
        out = await _one(session, task, run_name)
    ctx.metrics.tasks_failed.inc()
    return out


async def batch_status(ctx: Context, pool: Pool, batch_id: str) -> s.BatchStatusPublic:
    async with ctx.db.read() as session:
        batch, run = await _batch_and_run(session, pool, batch_id)
        counts = await repo.task_status_counts(session, batch_id)
    return s.BatchStatusPublic(
        id=batch.id,
        run=run.name,
        step=batch.step,
        status=batch.status,
        num_tasks=sum(counts.values()),
        tasks_completed=counts.get("completed", 0),
        tasks_pending=counts.get("pending", 0),
        tasks_leased=counts.get("leased", 0),
        tasks_failed=counts.get("failed", 0),
        result=None if batch.result is None else committed_result(batch),
    )


async def batch_results(ctx: Context, pool: Pool, batch_id: str, wait: float) -> s.BatchResults:
    """Completed groups of a batch's tasks; waits up to `wait` seconds for all of them, or until
    none is pending or leased (a failed task never completes: there is nothing to wait for)."""
    deadline = time.monotonic() + wait
    while True:
        async with ctx.db.read() as session:
            await _batch_and_run(session, pool, batch_id)
            tasks = await repo.batch_tasks(session, batch_id)
        done = [t for t in tasks if t.status == "completed"]
        if not tasks:
            raise Conflict(f"batch {batch_id} has no generation tasks (plan it with create_tasks=true)")
        settled = all(t.status in ("completed", "failed") for t in tasks)
        if settled or time.monotonic() >= deadline:
            break
        # others' requests (the workers completing these tasks) take this one's place meanwhile
        await admission.idle(min(0.2, max(0.0, deadline - time.monotonic())))
    groups = [
        s.TaskGroupResult(
            question_id=t.question_id,
            replayed=t.replayed,
            rollouts=[s.RolloutResult.model_validate(r, strict=False) for r in (t.result or [])],
            policy_version=t.generated_version,
        )
        for t in done
    ]
    return s.BatchResults(batch_id=batch_id, complete=len(done) == len(tasks), groups=groups)
