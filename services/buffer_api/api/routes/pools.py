"""Pools, questions, stats, export and import."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from exgrpo_client import frames
from exgrpo_client import schemas as s
from exgrpo_pool.api.deps import (
    Admin,
    ContextDep,
    IdempotencyDep,
    PrincipalDep,
    Reader,
    ReadPool,
    ReadPoolName,
    RowId,
    WritePool,
    json_response,
)
from exgrpo_pool.api.lean import LeanRoute, lean
from exgrpo_pool.api.wire import frame_answer, frame_body
from exgrpo_pool.errors import Forbidden
from exgrpo_pool.service import pools as svc
from exgrpo_pool.service import transfer

router = APIRouter(prefix="/v1/pools", tags=["pools"], route_class=LeanRoute)

_NDJSON = "application/x-ndjson"
_RECORDS = (
    "a header line, then runs, policy versions, questions, states and trajectories (`schemas.ExportRecord`)"
)
_BINARY = (
    "the magic `\\x89EXGRPO\\n`, then records, each a uint32 little-endian length and one msgpack "
    "map: the NDJSON records, trajectories in binary frames with their stored payloads as raw "
    "buffers, and an end record that counts the others (docs/api.md, 'Binary export')"
)


@router.get("", response_model=s.PoolsPublic)
async def list_pools(ctx: ContextDep, who: Reader) -> s.PoolsPublic:
    """The pools the caller may read."""
    return await svc.list_pools(ctx, visible=who.can_read)


@router.post("", response_model=s.PoolPublic, status_code=201)
async def create_pool(body: s.PoolCreate, ctx: ContextDep, who: PrincipalDep, idem: IdempotencyDep) -> object:
    if not who.can_write(body.name):
        raise Forbidden(
            f"{who.name} may not create pool {body.name!r} (needs write:{body.name}, write:* or admin)"
        )
    return await idem.run(lambda: svc.create_pool(ctx, body), status_code=201)


@router.post(
    "/import",
    response_model=s.PoolImported,
    status_code=201,
    # the route reads the raw body itself (either form, told apart by its first byte)
    openapi_extra=frame_body(
        None,
        "An export (GET /v1/pools/{pool}/export) in either form; imported in one transaction.",
        {
            _NDJSON: f"The export as NDJSON: {_RECORDS}, one per line.",
            frames.MEDIA_TYPE: f"The export in its binary form: {_BINARY}.",
        },
    ),
)
async def import_pool(
    request: Request,
    ctx: ContextDep,
    _: Admin,
    name: Annotated[
        str | None, Query(pattern=s.NAME_PATTERN, description="Import under this name instead.")
    ] = None,
) -> s.PoolImported:
    return await transfer.import_pool(ctx, request.stream(), name, request.headers.get("content-type"))


@router.get("/{pool}", response_model=s.PoolPublic)
async def show_pool(pool: ReadPool, ctx: ContextDep) -> s.PoolPublic:
    return await svc.show_pool(ctx, pool.name)


@router.patch("/{pool}", response_model=s.PoolPublic)
async def update_pool(body: s.PoolUpdate, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep) -> object:
    return await idem.run(lambda: svc.update_pool(ctx, pool.name, body))


@router.delete("/{pool}", status_code=204, response_class=Response)
async def delete_pool(
    pool: WritePool,
    ctx: ContextDep,
    _: Admin,
    force: Annotated[bool, Query(description="Delete even while writers hold leases of its runs.")] = False,
) -> Response:
    """Delete a pool and everything in it: questions, runs, states, trajectories (admin)."""
    await svc.delete_pool(ctx, pool.name, force=force)
    return Response(status_code=204)


@router.get("/{pool}/stats", response_model=s.PoolStats)
@lean
async def pool_stats(pool: ReadPoolName, ctx: ContextDep) -> object:
    with ctx.db.hot():
        return json_response(await svc.pool_stats(ctx, pool), 200)


@router.post("/{pool}/questions", response_model=s.QuestionsImported)
async def import_questions(
    body: s.QuestionsImport, pool: WritePool, ctx: ContextDep, idem: IdempotencyDep
) -> object:
    return await idem.run(lambda: svc.import_questions(ctx, pool, body))


@router.get("/{pool}/questions", response_model=s.QuestionsPublic)
@lean
async def list_questions(
    pool: ReadPoolName,
    ctx: ContextDep,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> object:
    with ctx.db.hot():
        return json_response(await svc.list_questions(ctx, pool, after, limit), 200)


@router.get("/{pool}/questions/{question_id}", response_model=s.QuestionDetail)
async def question_detail(
    question_id: RowId, pool: ReadPool, ctx: ContextDep, payload: bool = False
) -> s.QuestionDetail:
    return await svc.question_detail(ctx, pool, question_id, payload=payload)


@router.get(
    "/{pool}/export",
    response_class=StreamingResponse,
    responses=frame_answer(
        None,
        description="The pool, as NDJSON unless `Accept` names application/x-msgpack.",
        forms={
            _NDJSON: f"By default, as `{{pool}}.ndjson`: {_RECORDS}, one per line.",
            frames.MEDIA_TYPE: f"With `Accept: {frames.MEDIA_TYPE}`, as `{{pool}}.exgrpo`: {_BINARY}.",
        },
    ),
)
async def export_pool(request: Request, pool: ReadPool, ctx: ContextDep) -> StreamingResponse:
    """NDJSON, or the binary form when `Accept` names application/x-msgpack (docs/api.md)."""
    binary = frames.wants_frame(request.headers.get("accept"))
    return StreamingResponse(
        transfer.export_pool(ctx, pool, binary=binary),
        media_type=frames.MEDIA_TYPE if binary else "application/x-ndjson",
        headers={
            "Content-Disposition": f'attachment; filename="{pool.name}.{"exgrpo" if binary else "ndjson"}"'
        },
    )


@router.post("/{pool}/index/rebuild")
async def rebuild_index(pool: ReadPool, ctx: ContextDep, _: Admin) -> dict[str, int]:
    return await svc.rebuild_pool_index(ctx, pool)
