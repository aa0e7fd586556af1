"""Runs: create, show, stats, policy versions, batches, ingest, replay selection, task claims."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from exgrpo_client import schemas as s
from exgrpo_pool.api.deps import (
    Admin,
    ContextDep,
    IdempotencyDep,
    ReadPool,
    ReadPoolName,
    RunLeaseDep,
    RunName,
    WritePool,
    WritePoolName,
    json_response,
)
from exgrpo_pool.api.lean import lean
from exgrpo_pool.api.wire import FrameRoute, WireDep, frame_answer, frame_body
from exgrpo_pool.service import batches, leases, tasks
from exgrpo_pool.service import pools as svc

router = APIRouter(prefix="/v1/pools/{pool}/runs", tags=["runs"], route_class=FrameRoute)


@router.post("", response_model=s.RunPublic, status_code=201)
async def create_run(body: s.RunCreate, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep) -> object:
    return await idem.run(lambda: svc.create_run(ctx, pool, body), status_code=201)


@router.get("", response_model=s.RunsPublic)
async def list_runs(pool: ReadPool, ctx: ContextDep) -> s.RunsPublic:
    return await svc.list_runs(ctx, pool)


@router.get("/{run}", response_model=s.RunPublic)
async def show_run(run: RunName, pool: ReadPool, ctx: ContextDep) -> s.RunPublic:
    return await svc.show_run(ctx, pool, run)


@router.patch("/{run}", response_model=s.RunPublic)
async def update_run(
    run: RunName,
    body: s.RunUpdate,
    pool: WritePool,
    ctx: ContextDep,
    idem: IdempotencyDep,
    lease: RunLeaseDep,
) -> object:
    return await idem.run(lambda: svc.update_run(ctx, pool, run, body, lease))


@router.delete("/{run}", status_code=204, response_class=Response)
async def delete_run(
    run: RunName,
    pool: WritePool,
    ctx: ContextDep,
    _: Admin,
    force: Annotated[bool, Query(description="Delete even while a writer holds the run's lease.")] = False,
) -> Response:
    """Delete a run with its states, own trajectories, batches, tasks and metrics (admin)."""
    await svc.delete_run(ctx, pool, run, force=force)
    return Response(status_code=204)


@router.put("/{run}/lease", response_model=s.RunLease)
async def acquire_lease(
    run: RunName, body: s.RunLeaseRequest, pool: WritePool, ctx: ContextDep
) -> s.RunLease:
    """Take, renew or take over the run's writer lease (409 while another holder's lease lives)."""
    return await leases.acquire(ctx, pool, run, body)


@router.delete("/{run}/lease", status_code=204, response_class=Response)
async def release_lease(
    run: RunName,
    holder: Annotated[s.Text, Query(min_length=1, max_length=200)],
    pool: WritePool,
    ctx: ContextDep,
) -> Response:
    """Give the lease up (409 if `holder` does not hold it); the next holder gets the next generation."""
    await leases.release(ctx, pool, run, holder)
    return Response(status_code=204)


@router.get("/{run}/stats", response_model=s.RunStats)
@lean
async def run_stats(run: RunName, pool: ReadPoolName, ctx: ContextDep) -> object:
    with ctx.db.hot():
        return json_response(await svc.run_stats(ctx, pool, run), 200)


@router.post("/{run}/metrics", response_model=s.RunMetricsStep)
async def post_run_metrics(
    run: RunName,
    body: s.RunMetricsCreate,
    pool: WritePool,
    ctx: ContextDep,
    idem: IdempotencyDep,
    lease: RunLeaseDep,
) -> object:
    return await idem.run(lambda: svc.post_run_metrics(ctx, pool, run, body, lease))


@router.get("/{run}/metrics", response_model=s.RunMetricsPublic)
async def list_run_metrics(
    run: RunName,
    pool: ReadPool,
    ctx: ContextDep,
    after_step: Annotated[int, Query(ge=-1, le=2**31 - 1)] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> s.RunMetricsPublic:
    return await svc.list_run_metrics(ctx, pool, run, after_step, limit)


@router.post("/{run}/policy-versions", response_model=s.PolicyVersionPublic, status_code=201)
async def add_policy_version(
    run: RunName,
    body: s.PolicyVersionCreate,
    pool: WritePool,
    ctx: ContextDep,
    idem: IdempotencyDep,
    lease: RunLeaseDep,
) -> object:
    return await idem.run(lambda: svc.add_policy_version(ctx, pool, run, body, lease), status_code=201)


@router.get("/{run}/policy-versions", response_model=s.PolicyVersionsPublic)
async def list_policy_versions(run: RunName, pool: ReadPool, ctx: ContextDep) -> s.PolicyVersionsPublic:
    return await svc.list_policy_versions(ctx, pool, run)


@router.post(
    "/{run}/batches", response_model=s.BatchPlan, status_code=201, responses=frame_answer(s.BatchPlan, 201)
)
async def plan_batch(
    run: RunName,
    body: s.BatchCreate,
    pool: WritePoolName,
    ctx: ContextDep,
    idem: IdempotencyDep,
    lease: RunLeaseDep,
    wire: WireDep,
) -> object:
    with wire.answering(), ctx.db.hot():
        return await idem.run(
            lambda: batches.plan_batch(ctx, pool, run, body, lease),
            status_code=201,
            reference=lambda plan: {"batch_id": plan.body["id"]},
            resolve=lambda ref: batches.get_batch_plan(ctx, pool, ref["batch_id"]),
            respond=wire.respond,
        )


@router.post(
    "/{run}/ingest",
    response_model=s.CommitResult,
    openapi_extra=frame_body(s.IngestRequest, "The graded groups"),
)
@lean
async def ingest(
    run: RunName,
    body: s.IngestRequest,
    pool: WritePoolName,
    ctx: ContextDep,
    idem: IdempotencyDep,
    lease: RunLeaseDep,
    wire: WireDep,
) -> object:
    wire.prepare(body)
    with ctx.db.hot():
        # one run's ingests take its row lock in turn: those that wait share one transaction
        return await idem.run(
            lambda: batches.ingest(ctx, pool, run, body, lease), group=("ingest", pool, run)
        )


@router.post("/{run}/select", response_model=s.SelectResult, responses=frame_answer(s.SelectResult))
@lean
async def select_replay(
    run: RunName, body: s.SelectRequest, pool: ReadPoolName, ctx: ContextDep, wire: WireDep
) -> object:
    with wire.answering(), ctx.db.hot():
        return wire.respond(await batches.select_replay(ctx, pool, run, body))


@router.post("/{run}/tasks/claim", response_model=s.TasksPublic)
async def claim_tasks(
    run: RunName, body: s.TaskClaim, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep
) -> object:
    with ctx.db.hot():
        return await idem.run(lambda: tasks.claim(ctx, pool, run, body))
