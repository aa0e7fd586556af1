"""Request dependencies: the service context, the caller, scope checks, idempotent writes.

Every dependency is an `async def` (a class through an async factory): FastAPI runs a plain
function or a class in its thread pool, a hand-over to a thread and back on every request
(tests/unit/test_route_dependencies.py)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError

from exgrpo_client.schemas import NAME_PATTERN
from exgrpo_pool.errors import BadRequest, Conflict, Forbidden, Unauthorized
from exgrpo_pool.offload import in_thread, settled
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.leases import LeaseClaim, parse_lease_header
from exgrpo_pool.service.pools import load_pool
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import IdempotencyKey, Pool, utcnow

#: A row id in a path: database ids are BIGINT, so larger numbers are a 422, not a database error.
RowId = Annotated[int, Path(ge=0, le=2**63 - 1)]
#: Names in a path follow the rule of names in a body, so a path no pool or run can have (a NUL
#: character, a space) is a 422 before any lookup, on every backend.
PoolName = Annotated[str, Path(pattern=NAME_PATTERN, description="A pool name.")]
RunName = Annotated[str, Path(pattern=NAME_PATTERN, description="A run name of the pool.")]
BatchId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="A batch id.")]


@dataclass(frozen=True)
class Principal:
    name: str
    scopes: frozenset[str]

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def can_read(self, pool: str | None = None) -> bool:
        """Whether this principal reads `pool` (None: whether it reads any pool at all)."""
        if self.scopes & {"admin", "read", "read:*", "write:*"}:
            return True
        if pool is None:
            return any(sc.startswith(("read:", "write:")) for sc in self.scopes)
        return bool(self.scopes & {f"read:{pool}", f"write:{pool}"})

    def can_write(self, pool: str) -> bool:
        return self.is_admin or "write:*" in self.scopes or f"write:{pool}" in self.scopes


async def get_context(request: Request) -> Context:
    return request.app.state.ctx


ContextDep = Annotated[Context, Depends(get_context)]


async def get_principal(request: Request, ctx: ContextDep) -> Principal:
    header = request.headers.get("authorization", "")
    if header:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("use the header 'Authorization: Bearer <token>'")
        for grant in ctx.settings.tokens:
            if hmac.compare_digest(grant.token.encode(), token.strip().encode()):
                return Principal(grant.name, frozenset(grant.scopes))
        raise Unauthorized("unknown bearer token")
    if ctx.settings.allow_anonymous:
        scopes = {"admin"} if ctx.settings.loopback else {"read"}
        return Principal("anonymous", frozenset(scopes))
    raise Unauthorized("this service needs a bearer token (header 'Authorization: Bearer <token>')")


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_read(principal: PrincipalDep) -> Principal:
    if not principal.can_read():
        raise Forbidden(f"{principal.name} may not read")
    return principal


async def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise Forbidden(f"{principal.name} lacks the admin scope")
    return principal


Reader = Annotated[Principal, Depends(require_read)]
Admin = Annotated[Principal, Depends(require_admin)]


async def readable_pool_name(pool: PoolName, principal: Reader) -> str:
    """A pool the caller may read, by name: the request loads it in its own transaction."""
    if not principal.can_read(pool):
        raise Forbidden(
            f"{principal.name} may not read pool {pool!r} (needs scope read:{pool}, write:{pool}, "
            "read, read:*, write:* or admin)"
        )
    return pool


async def writable_pool_name(pool: PoolName, principal: PrincipalDep) -> str:
    """A pool the caller may write to, by name: the request loads it in its own transaction."""
    if not principal.can_write(pool):
        raise Forbidden(
            f"{principal.name} may not write to pool {pool!r} (needs scope write:{pool}, write:* or admin)"
        )
    return pool


#: The name of a pool the caller may read or write. The hot paths (plan, commit, ingest, select,
#: a batch's plan) take these and read the pool with their run in their one transaction.
ReadPoolName = Annotated[str, Depends(readable_pool_name)]
WritePoolName = Annotated[str, Depends(writable_pool_name)]


async def readable_pool(pool: ReadPoolName, ctx: ContextDep) -> Pool:
    return await load_pool(ctx, pool)


async def writable_pool(pool: WritePoolName, ctx: ContextDep) -> Pool:
    return await load_pool(ctx, pool)


ReadPool = Annotated[Pool, Depends(readable_pool)]
WritePool = Annotated[Pool, Depends(writable_pool)]


async def run_lease_claim(
    x_run_lease: Annotated[
        str | None,
        Header(description="`<holder>:<generation>` of the run's writer lease (PUT .../lease)."),
    ] = None,
) -> LeaseClaim | None:
    return parse_lease_header(x_run_lease)


#: The writer lease a run write claims (None: no `X-Run-Lease` header).
RunLeaseDep = Annotated[LeaseClaim | None, Depends(run_lease_claim)]


# --------------------------------------------------------------------------- idempotent writes
#: the key of a recorded response that holds its body as JSON text
RAW = "json_text"


#: writes an answer: (result, status code, extra headers) -> response
Responder = Callable[[Any, int, dict[str, str] | None], Any]


class _KeyTaken(Exception):
    """Another request recorded this key first (it committed while this one waited for it)."""


class Idempotency:
    """Replays the first response of a write sent again with the same `Idempotency-Key`.

    The key's record is written in the write's own transaction: first (so a concurrent request
    with the same key waits for the first one on the key's primary key, then replays its answer),
    and completed with the response before the commit. A crash leaves both or neither, so a retry
    after one gets the first answer or does the write for the first time."""

    #: rounds of lookup-then-write a request tries while concurrent holders of its key roll back
    ATTEMPTS = 3

    def __init__(self, request: Request, ctx: ContextDep, principal: PrincipalDep) -> None:
        self.request = request
        self.ctx = ctx
        self.principal = principal
        self.key = request.headers.get("idempotency-key")
        if self.key is not None and not (1 <= len(self.key) <= 255):
            raise BadRequest("Idempotency-Key must be 1 to 255 characters")
        if self.key is not None:
            # a key is scoped to its endpoint (method and path, the pool's name included): the same
            # key sent to another pool or endpoint is another request, neither a replay nor a clash
            scope = f"{request.method} {request.url.path}\n{self.key}"
            self.key = hashlib.sha256(scope.encode()).hexdigest()

    async def run(
        self,
        fn: Callable[[], Awaitable[object]],
        status_code: int = 200,
        *,
        reference: Callable[[Any], dict[str, Any]] | None = None,
        resolve: Callable[[dict[str, Any]], Awaitable[object]] | None = None,
        respond: Responder | None = None,
        group: Hashable | None = None,
        content: Callable[[], Awaitable[str]] | None = None,
        earlier: Sequence[Callable[[], Awaitable[str]]] = (),
    ) -> Any:
        """`reference`/`resolve`: remember a small reference instead of a large response body (a
        batch plan), and rebuild the response from it on a replay. `respond`: how an answer is
        written (JSON by default; a binary frame where the client asked for one). `group`: the
        write may share its transaction with others of the same key (`Database.transaction`).
        `content`: gives a digest of everything the request asks for, which the key's record keeps
        (with the route) instead of a hash of the body's bytes: a commit's, made from its batch
        digest, so its payload is hashed once, and the same commit in another encoding is the
        same request. `earlier`: the content digests earlier versions of the service recorded for
        such a request, tried in turn where the record's hash is not `content`'s; a record of the
        body's bytes (written before requests had a content digest) still replays them."""
        write: Responder = respond or json_response
        if self.key is None:
            if group is None:
                return write(await fn(), status_code, None)
            async with self.ctx.db.transaction(group):
                result = await fn()
            return write(result, status_code, None)
        body = await self.request.body()
        route = f"{self.request.method} {self.request.url.path}"
        # hashed in a thread beside the write (megabytes for a commit): the hash is needed when the
        # key's record is completed, or to compare with a record found
        if content is None:
            digest: Awaitable[str] = in_thread(lambda: request_hash(route, body))
        else:
            digest = settled(asyncio.ensure_future(_content_hash(route, content())))
        for attempt in range(self.ATTEMPTS):
            # a new key (the usual case) goes straight to the write, whose first statement records
            # it (one transaction, one connection); a key already recorded fails there, and its
            # record is then read and replayed
            if attempt > 0:
                cached = await self._lookup()
                if cached is not None:
                    if content is not None and cached.request_hash != await digest:
                        # a record an earlier version wrote
                        digest = settled(asyncio.ensure_future(_recorded(cached, route, body, earlier)))
                    return await self._replay(cached, digest, resolve, write)
            try:
                return await self._first(fn, status_code, route, digest, reference, write, group)
            except _KeyTaken:
                continue
        raise Conflict("this Idempotency-Key is in use by another request; retry in a moment")

    async def _first(
        self,
        fn: Callable[[], Awaitable[object]],
        status_code: int,
        route: str,
        digest: Awaitable[str],
        reference: Callable[[Any], dict[str, Any]] | None,
        respond: Responder,
        group: Hashable | None,
    ) -> Any:
        key = self.key or ""
        async with self.ctx.db.transaction(group) as session:
            try:
                await repo.record_idempotent(
                    session,
                    {
                        "key": key,
                        "principal": self.principal.name,
                        "route": route,
                        # completed below with the answer, in this transaction: never committed so
                        "request_hash": "",
                        "status_code": status_code,
                        "response": {},
                        "created_at": utcnow(),
                    },
                )
            except IntegrityError as e:
                raise _KeyTaken() from e
            result = await fn()
            response = respond(result, status_code, None)
            # the body as text: a JSONB column would reorder its keys, and a replay is byte-identical
            stored = (
                {"ref": reference(result)} if reference is not None else {RAW: bytes(response.body).decode()}
            )
            await repo.complete_idempotent(session, key, self.principal.name, stored, await digest)
        return response

    async def _replay(
        self,
        cached: IdempotencyKey,
        digest: Awaitable[str],
        resolve: Callable[[dict[str, Any]], Awaitable[object]] | None,
        respond: Responder,
    ) -> Any:
        if cached.request_hash != await digest:
            raise BadRequest("this Idempotency-Key was used for a different request; use a new key")
        headers = {"Idempotent-Replayed": "true"}
        stored = cached.response
        if resolve is not None and "ref" in stored:
            return respond(await resolve(stored["ref"]), cached.status_code, headers)
        if isinstance(stored.get(RAW), str) and len(stored) == 1:
            return Response(stored[RAW], cached.status_code, headers, media_type="application/json")
        return JSONResponse(stored, status_code=cached.status_code, headers=headers)  # an older record

    async def _lookup(self) -> IdempotencyKey | None:
        async with self.ctx.db.read() as session:
            return await repo.get_idempotent(session, self.key or "", self.principal.name)


async def _content_hash(route: str, content: Awaitable[str]) -> str:
    """What a key's record keeps of a request with a content digest: the route's and the digest's
    hash, told apart from a body's hash by its prefix."""
    return request_hash(route, b"content:" + (await content).encode())


async def _recorded(
    cached: IdempotencyKey, route: str, body: bytes, earlier: Sequence[Callable[[], Awaitable[str]]]
) -> str:
    """The hash an earlier version recorded for this request, if it is one of them (`earlier`'s
    content digests, then the body's bytes as requests without a content digest were recorded),
    else the body's hash (which then tells the requests apart)."""
    for content in earlier:
        hashed = await _content_hash(route, content())
        if hashed == cached.request_hash:
            return hashed
    return await in_thread(lambda: request_hash(route, body))


def request_hash(route: str, body: bytes) -> str:
    """What a key's record keeps of its request: SHA-256 of the route, a newline and the body as
    it came (updated in two parts: no copy of a body of megabytes)."""
    hashed = hashlib.sha256(route.encode() + b"\n")
    hashed.update(body)
    return hashed.hexdigest()


async def idempotency(request: Request, ctx: ContextDep, principal: PrincipalDep) -> Idempotency:
    return Idempotency(request, ctx, principal)


IdempotencyDep = Annotated[Idempotency, Depends(idempotency)]


def json_response(
    obj: BaseModel | dict[str, Any] | bytes, status_code: int, headers: dict[str, str] | None = None
) -> Any:
    """`obj` as a JSON response: a model, plain values, or JSON text already written."""
    if isinstance(obj, BaseModel):
        # pydantic-core writes the JSON directly: ~4x faster than json.dumps(model_dump()) on a
        # multi-megabyte batch plan
        obj = obj.model_dump_json().encode()
    if isinstance(obj, bytes):
        return Response(obj, status_code=status_code, media_type="application/json", headers=headers)
    return JSONResponse(obj, status_code=status_code, headers=headers)
