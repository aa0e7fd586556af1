"""Batches (plan lives under runs): show, status, commit, results; tasks: the pool-wide claim,
renew, complete, fail."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from exgrpo_client import schemas as s
from exgrpo_pool.api.deps import (
    BatchId,
    ContextDep,
    IdempotencyDep,
    ReadPool,
    ReadPoolName,
    RowId,
    RunLeaseDep,
    WritePool,
    WritePoolName,
)
from exgrpo_pool.api.lean import lean
from exgrpo_pool.api.wire import FrameRoute, WireDep, frame_answer, frame_body
from exgrpo_pool.offload import in_thread
from exgrpo_pool.service import batches, tasks
from exgrpo_pool.service.convert import commit_digest_parts, commit_request, commit_request_v1, digest_of

router = APIRouter(prefix="/v1/pools/{pool}", tags=["batches"], route_class=FrameRoute)


@router.get("/batches/{batch_id}", response_model=s.BatchPlan, responses=frame_answer(s.BatchPlan))
async def show_batch(batch_id: BatchId, pool: ReadPoolName, ctx: ContextDep, wire: WireDep) -> object:
    with wire.answering(), ctx.db.hot():
        return wire.respond(await batches.get_batch_plan(ctx, pool, batch_id))


@router.get("/batches/{batch_id}/status", response_model=s.BatchStatusPublic)
async def batch_status(batch_id: BatchId, pool: ReadPool, ctx: ContextDep) -> s.BatchStatusPublic:
    return await tasks.batch_status(ctx, pool, batch_id)


@router.post(
    "/batches/{batch_id}/commit",
    response_model=s.CommitResult,
    openapi_extra=frame_body(s.BatchCommit, "The batch's graded groups"),
)
@lean
async def commit_batch(
    batch_id: BatchId,
    body: s.BatchCommit,
    pool: WritePoolName,
    ctx: ContextDep,
    idem: IdempotencyDep,
    lease: RunLeaseDep,
    wire: WireDep,
) -> object:
    wire.prepare(body)
    # the payload's bytes hashed once (~3 ms for 128 x 8 rollouts of 1k tokens), in a thread
    # beside the write, whose statements give the loop and the GIL back; what is hashed is made
    # here, where the GIL is the loop's anyway. The batch keeps the commit's digest, and the
    # key's record a digest made from it (or, for a key recorded by an earlier version, from the
    # digest it made)
    parts = commit_digest_parts(body)
    digest = in_thread(lambda: digest_of(parts))
    with ctx.db.hot():
        return await idem.run(
            lambda: batches.commit_batch(ctx, pool, batch_id, body, lease, digest),
            content=lambda: commit_request(body, digest),
            earlier=(lambda: commit_request_v1(body),),
        )


@router.get("/batches/{batch_id}/results", response_model=s.BatchResults)
async def batch_results(
    batch_id: BatchId, pool: ReadPool, ctx: ContextDep, wait: Annotated[float, Query(ge=0, le=300)] = 0.0
) -> s.BatchResults:
    return await tasks.batch_results(ctx, pool, batch_id, wait)


@router.post("/tasks/claim", response_model=s.TasksPublic)
async def claim_pool_tasks(
    body: s.PoolTaskClaim, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep
) -> object:
    """Claim tasks of any run of the pool (or of `runs`) for a worker fleet shared by runs. One
    answer holds tasks of one run, all of one policy version and sampling settings; the run is
    the one with the fewest leased tasks, then the one whose oldest waiting task is oldest."""
    with ctx.db.hot():
        return await idem.run(lambda: tasks.claim_pool(ctx, pool, body))


@router.post("/tasks/{task_id}/renew", response_model=s.TaskPublic)
async def renew_task(
    task_id: RowId, body: s.TaskRenew, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep
) -> object:
    with ctx.db.hot():
        return await idem.run(lambda: tasks.renew(ctx, pool, task_id, body))


@router.post("/tasks/{task_id}/complete", response_model=s.TaskPublic)
async def complete_task(
    task_id: RowId, body: s.TaskComplete, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep
) -> object:
    with ctx.db.hot():
        return await idem.run(lambda: tasks.complete(ctx, pool, task_id, body))


@router.post("/tasks/{task_id}/fail", response_model=s.TaskPublic)
async def fail_task(
    task_id: RowId, body: s.TaskFail, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep
) -> object:
    with ctx.db.hot():
        return await idem.run(lambda: tasks.fail(ctx, pool, task_id, body))
