"""Generation tasks with leases: claim, renew, complete, fail; completed groups of a batch."""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import timedelta

from exgrpo_client import schemas as s
from exgrpo_pool.errors import BadRequest, Conflict, NotFound
from exgrpo_pool.service.batches import _batch_and_run, _get_run
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.convert import committed_result, decode_payload, messages
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import Pool, Task, utcnow


def _public(t: Task, run_name: str, q: repo.Question) -> s.TaskPublic:
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
        status=t.status,
        attempts=t.attempts,
        lease_token=t.lease_token,
        lease_expires_at=t.lease_expires_at,
    )


async def claim(ctx: Context, pool: Pool, run_name: str, req: s.TaskClaim) -> s.TasksPublic:
    async with ctx.db.write() as session:
        run = await _get_run(session, pool, run_name)
        expires = utcnow() + timedelta(seconds=req.lease_seconds)
        tasks, expired = await repo.claim_tasks(
            session, run.id, req.worker, req.max_tasks, expires, lambda: secrets.token_hex(16)
        )
        questions = await repo.get_questions(session, [t.question_id for t in tasks])
        out = [_public(t, run.name, questions[t.question_id]) for t in tasks]
    if expired:
        ctx.metrics.lease_expiries.inc(expired)
    return s.TasksPublic(data=out, count=len(out))


async def _task(session: repo.AsyncSession, pool: Pool, task_id: int) -> tuple[Task, str]:
    task = await repo.get_task(session, task_id, lock=True)
    run = None if task is None else await repo.get_run_by_id(session, task.run_id)
    if task is None or run is None or run.pool_id != pool.id:
        raise NotFound(f"task {task_id} does not exist in pool {pool.name!r}")
    return task, run.name


def _check_lease(task: Task, token: str) -> None:
    if task.lease_token != token:
        raise Conflict(
            f"task {task.id}: lease lost (it expired and the task was given to another worker, "
            "or the token is wrong); drop this task"
        )
    if task.status != "leased":
        raise Conflict(f"task {task.id} is {task.status}, not leased")


async def renew(ctx: Context, pool: Pool, task_id: int, req: s.TaskRenew) -> s.TaskPublic:
    async with ctx.db.write() as session:
        task, run_name = await _task(session, pool, task_id)
        _check_lease(task, req.lease_token)
        task.lease_expires_at = utcnow() + timedelta(seconds=req.lease_seconds)
        task.updated_at = utcnow()
        q = (await repo.get_questions(session, [task.question_id]))[task.question_id]
        return _public(task, run_name, q)


async def complete(ctx: Context, pool: Pool, task_id: int, req: s.TaskComplete) -> s.TaskPublic:
    async with ctx.db.write() as session:
        task, run_name = await _task(session, pool, task_id)
        q = (await repo.get_questions(session, [task.question_id]))[task.question_id]
        if task.status == "completed" and task.lease_token == req.lease_token:
            return _public(task, run_name, q)  # a retried completion
        _check_lease(task, req.lease_token)
        if len(req.rollouts) != task.num_samples:
            raise BadRequest(f"task {task.id} asks for {task.num_samples} samples, got {len(req.rollouts)}")
        for i, r in enumerate(req.rollouts):
            if r.replayed:
                raise BadRequest(f"rollouts[{i}]: generated samples cannot be marked replayed")
            if decode_payload(r, f"rollouts[{i}]") is None:
                raise BadRequest(f"rollouts[{i}]: send token ids and log-probs of every generated sample")
        task.status = "completed"
        task.result = [r.model_dump(exclude_none=True) for r in req.rollouts]
        task.lease_expires_at = None
        task.updated_at = utcnow()
        out = _public(task, run_name, q)
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
        q = (await repo.get_questions(session, [task.question_id]))[task.question_id]
        out = _public(task, run_name, q)
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
        await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    groups = [
        s.TaskGroupResult(
            question_id=t.question_id,
            replayed=t.replayed,
            rollouts=[s.RolloutResult.model_validate(r, strict=False) for r in (t.result or [])],
        )
        for t in done
    ]
    return s.BatchResults(batch_id=batch_id, complete=len(done) == len(tasks), groups=groups)
