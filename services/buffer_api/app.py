"""The FastAPI application: `create_app(settings)`; no module-level state."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import sqlalchemy.exc
from asyncpg import exceptions as asyncpg_errors
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exgrpo_pool import faults
from exgrpo_pool.admission import Admission
from exgrpo_pool.api.contract import allowed_methods, install_openapi
from exgrpo_pool.api.lean import DirectRoutes
from exgrpo_pool.api.routes import batches, dashboard, docs, pools, runs
from exgrpo_pool.config import Settings
from exgrpo_pool.errors import PayloadTooLarge, ServiceError
from exgrpo_pool.index.memory import MemoryIndex
from exgrpo_pool.metrics import Metrics
from exgrpo_pool.service.context import Context
from exgrpo_pool.service.pools import load_pool, rebuild_pool_index
from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo
from exgrpo_pool.store.sqlite_inline import lock_error as sqlite_lock_error

log = logging.getLogger("exgrpo.pool")
PROBLEM = "application/problem+json"


# ------------------------------------------------------------------------------------ logging
SERVICE_LOGGERS = ("exgrpo.pool", "exgrpo.access")
"""The service's loggers: at `settings.log_level`. Where their lines go, and in which format, is
the process's choice (`exgrpo serve` sets up exgrpo_client.logs; an embedding program its own)."""


# ------------------------------------------------------------------------------------ problems
def problem(
    status: int,
    title: str,
    detail: str,
    request: Request,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body = {
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.url.path,
        "request_id": getattr(request.state, "request_id", None),
        **extra,
    }
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


def _validation_detail(errors: list[dict[str, Any]]) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        if exc.status >= 500:
            log.exception("service error", exc_info=exc)
        return problem(exc.status, exc.title, exc.detail, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()
        ]
        return problem(422, "Invalid request", _validation_detail(errors), request, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, "HTTP error")
        if exc.status_code == 405:
            allow = ", ".join(allowed_methods(request.app, request.url.path))
            detail = f"{request.method} is not allowed on {request.url.path}; it takes {allow}"
            return problem(405, title, detail, request, headers={"Allow": allow})
        return problem(exc.status_code, title, str(exc.detail), request)

    @app.exception_handler(RedisError)
    async def _redis_unavailable(request: Request, exc: RedisError) -> JSONResponse:
        # Redis is only read or written before a request's transaction commits (index updates
        # after a commit never raise), so the transaction was rolled back
        return unavailable(request, "the sampling index (Redis)", exc)


def unavailable(request: Request, what: str, exc: BaseException) -> JSONResponse:
    """503 with Retry-After: `what` (a backing store) did not answer; nothing was changed."""
    return retry_later(
        request,
        f"{what} unavailable",
        exc,
        f"{what} did not answer ({type(exc).__name__}); the request changed nothing. Retry in a moment",
    )


def retry_later(request: Request, what: str, exc: BaseException, detail: str) -> JSONResponse:
    """503 with Retry-After, logged as a warning: the request changed nothing and may be retried."""
    log.warning(
        "%s: %s",
        what,
        exc,
        extra={"fields": {"path": request.url.path, "request_id": request.state.request_id}},
    )
    response = problem(503, "Service unavailable", detail, request)
    response.headers["Retry-After"] = "1"
    return response


_DATABASE_DOWN = (
    ConnectionError,  # refused, reset, broken pipe: the server is not there
    asyncpg_errors.PostgresConnectionError,  # the connection went away mid-request
    asyncpg_errors.OperatorInterventionError,  # the server is shutting down or starting
    sqlalchemy.exc.TimeoutError,  # no connection came free in time
)


def database_unavailable(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) says the database cannot be reached, as
    opposed to a failure of the request itself."""
    for cur in _causes(exc):
        if isinstance(cur, _DATABASE_DOWN):
            return True
        if isinstance(cur, sqlalchemy.exc.DBAPIError) and cur.connection_invalidated:
            return True
        if isinstance(cur, sqlite3.OperationalError) and sqlite_lock_error(cur):
            # another program held the file's lock past the wait (a backup, a shell)
            return True
    return False


def transient_conflict(exc: BaseException) -> str | None:
    """What Postgres aborted the request's transaction for, if it did so to resolve a conflict with
    another transaction (a deadlock, a serialization failure): a retry can succeed."""
    for cur in _causes(exc):
        # SQLAlchemy's error is raised from the driver's, which carries the SQLSTATE
        sqlstate = getattr(cur, "sqlstate", None)
        if sqlstate in dbmod.RETRY_SQLSTATES:
            return dbmod.RETRY_SQLSTATES[sqlstate]
    return None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or during, each once."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def unexpected_problem(request: Request, exc: Exception) -> JSONResponse:
    """The answer to an exception no handler knows. It is produced inside the observability
    middleware, so it is logged and counted like any answer, and the connection stays usable.
    Whatever the failure, the request's transaction was rolled back: a write that committed never
    raises afterwards (index updates after a commit log their failures). A database that cannot
    be reached is answered 503 with Retry-After, like an unreachable Redis, and so is a transaction
    the database aborted to break a deadlock or a serialization conflict."""
    if database_unavailable(exc):
        return unavailable(request, "the database", exc)
    conflict = transient_conflict(exc)
    if conflict is not None:
        return retry_later(
            request,
            f"transaction aborted by the database ({conflict})",
            exc,
            f"the database aborted this request's transaction to resolve a {conflict} with another "
            "one; the request changed nothing. Retry in a moment",
        )
    log.error(
        "unhandled error",
        exc_info=exc,
        extra={"fields": {"path": request.url.path, "request_id": request.state.request_id}},
    )
    return problem(
        500,
        "Internal error",
        "the service failed; the request changed nothing. Retry, and report the request_id if it persists",
        request,
    )


# -------------------------------------------------------------------------------- middleware
class BodyLimit:
    """Refuses bodies over the limit (Content-Length up front, streamed bodies as they arrive)."""

    def __init__(self, app: ASGIApp, limit: int, import_limit: int) -> None:
        self.app, self.limit, self.import_limit = app, limit, import_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_import = scope["path"].endswith("/pools/import")
        limit = self.import_limit if is_import else self.limit
        length: bytes | None = None
        streamed = False
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value  # the last one, as a mapping of the headers reads it
            elif key == b"transfer-encoding":
                streamed = True
        if length is not None and length.isdigit() and int(length) > limit:
            await self._reject(scope, send, limit)
            return
        if length is None and not is_import:
            if not streamed and scope.get("http_version", "1.1") in ("1.0", "1.1"):
                # no body at all: an HTTP/1 request without a length or a transfer coding has none
                # (an HTTP/2 request may stream one without either: buffered and limited below)
                await self.app(scope, receive, send)
                return
            # A streamed (chunked) JSON body is read whole by the app anyway, so buffer it here:
            # an error raised while the app reads it would be reported as a generic 400, not a 413.
            await self._buffered(scope, receive, send, limit)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise PayloadTooLarge(f"request body over {limit} bytes: split it into smaller requests")
            return msg

        await self.app(scope, limited, send)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        chunks: list[bytes] = []
        seen = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break  # the client went away: pass that on
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            if seen > limit:
                await self._reject(scope, send, limit)
                return
            if not msg.get("more_body", False):
                msg = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending = [msg]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _reject(scope: Scope, send: Send, limit: int) -> None:
        body = json.dumps(
            {
                "type": "about:blank",
                "title": "Payload too large",
                "status": 413,
                "detail": f"request body over {limit} bytes: split it into smaller requests "
                "(for example fewer questions or groups per call)",
                "instance": scope["path"],
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", PROBLEM.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class Observability:
    """Request id, access log line and latency histogram of every HTTP request, and the answer to
    an exception no handler knows (`unexpected_problem`), as a plain ASGI middleware: the request
    runs in the server's task, not in a second one. The line is logged and the request counted when
    the response starts (the time to the first byte of the answer), with the request id added to
    its headers; an exception after the response started is left to the server, as before."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.access = logging.getLogger("exgrpo.access")
        #: the latency histogram's child per (method, route, status), as `labels()` gives it once
        self._latency: dict[tuple[str, str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or os.urandom(8).hex()
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        started = False

        async def observed(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._answered(scope, message, request_id, time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, observed)
        except Exception as exc:  # answered here, not by the server: see unexpected_problem
            if started:
                raise
            await unexpected_problem(Request(scope, receive), exc)(scope, receive, observed)

    def _answered(self, scope: Scope, message: Message, request_id: str, elapsed: float) -> None:
        route = getattr(scope.get("route"), "path", "unmatched")
        status = message["status"]
        key = (scope["method"], route, str(status))
        latency = self._latency.get(key)
        if latency is None:
            latency = self._latency[key] = self.metrics.request_seconds.labels(*key)
        latency.observe(elapsed)
        # the header set as `MutableHeaders(scope=message)["X-Request-ID"] = ...` sets it (any of
        # that name replaced), without the mapping
        headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
        headers.append((b"x-request-id", request_id.encode("latin-1")))
        message["headers"] = headers
        access = self.access
        # no record where no handler would take it (a process that set up no logging: Python's
        # last resort drops INFO): making one and passing it up cost ~16 us of a ~270 us request
        if access.isEnabledFor(logging.INFO) and access.hasHandlers():
            fields = {
                "method": scope["method"],
                "route": route,
                "path": _logged_path(scope["path"]),
                "status": status,
                "ms": round(elapsed * 1000, 2),
                "request_id": request_id,
            }
            # the record `access.info` makes, without the walk up the stack for its caller (none
            # of the stack's log formats shows it; ~5 us of a small request)
            record = access.makeRecord(
                access.name, logging.INFO, "(unknown file)", 0, "request", (), None,
                "(unknown function)", {"fields": fields},
            )  # fmt: skip
            access.handle(record)


def _header(scope: Scope, name: bytes) -> str | None:
    """A request header's first value, as Starlette's `Headers(scope=scope).get` reads it (`name`
    in lower case, as the ASGI server gives every header name), without building the mapping."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _logged_path(path: str) -> str:
    """The request's path as Starlette's `URL(scope=...).path` gives it (`?`, `#` and backslashes
    escaped), without building the URL (its host header parsing) on every request."""
    return path.replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")


# ------------------------------------------------------------------------------------- the app
async def build_context(settings: Settings, metrics: Metrics | None = None) -> Context:
    if settings.auto_migrate:
        await asyncio.to_thread(dbmod.upgrade, settings.database_url)
    database = dbmod.Database(
        settings.database_url,
        pool_size=settings.db_pool_size,
        shared_file=settings.workers > 1,
        sqlite_cache_mb=settings.sqlite_cache_mb,
        sqlite_inline=settings.sqlite_driver == "inline",
        group_max=settings.ingest_group_max,
    )
    metrics = metrics or Metrics()
    database.on_group = metrics.grouped_writes.observe
    redis_client = None
    index: Any
    if settings.redis_url:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        from exgrpo_pool.index.redis import RedisIndex

        # short timeouts and one immediate retry (a connection left over from before a Redis
        # restart fails once): an unreachable Redis is answered 503 within about two timeouts
        redis_client = aioredis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        index = RedisIndex(redis_client, settings.redis_prefix)
    else:
        index = MemoryIndex()
    return Context(settings=settings, db=database, index=index, metrics=metrics, redis=redis_client)


async def rebuild_all(ctx: Context) -> int:
    """Rebuild the sampling index of every pool from the database (start-up and on demand)."""
    async with ctx.db.read() as session:
        names = [p.name for p in await repo.list_pools(session)]
    total = 0
    for name in names:
        total += sum((await rebuild_pool_index(ctx, await load_pool(ctx, name))).values())
    return total


def settle_heap() -> None:
    """Collect once, then leave every object alive now out of the collector's later passes.

    After start-up the process holds ~150k tracked objects (modules, routes, schemas, compiled
    validators, SQLAlchemy's metadata) that live as long as it does. A full collection walks all
    of them, and it runs at a moment no one chooses: inside a request, for 0.2-0.3 s on a 2-CPU
    machine (docs/pool-service-passes.md, "Garbage collection"). Frozen, they are never walked again;
    objects made later are collected as before."""
    gc.collect()
    gc.freeze()


#: young container objects (made and not freed yet) that set off the collector's youngest pass in
#: a serving process. At Python's 700 a commit's ~10k live objects (its rollouts as models, their
#: rows) were walked by a pass every 700 of them and moved to older generations while the request
#: built them, and those older generations were then walked too: 0.6-0.9 ms of a commit's CPU,
#: 0.4-0.6 ms of a plan's (`Server-Timing` gc in `bench/pool_bench.py`). At this many a request's
#: objects are freed before any pass sees them; a pass still comes once the objects nothing frees
#: but a collection (reference cycles) reach the number, and walks what is alive then.
YOUNG_OBJECTS_PER_PASS = 100_000


def collect_young_less_often() -> None:
    """Raise the count of young objects that sets off a collection to `YOUNG_OBJECTS_PER_PASS`
    (never lower it); the older generations' thresholds stay."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_OBJECTS_PER_PASS), middle, old)


#: glibc's `mallopt` parameters (malloc.h): the size from which an allocation gets pages of its
#: own, and how much free memory at the top of the heap is kept rather than given back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: a request's buffers (a body, its payload copies) stay below this and come from the heap
KEEP_BUFFERS_BELOW = 64 << 20
#: free memory the process keeps for later requests; what is freed above it goes back
KEEP_FREE_MEMORY = 256 << 20


def keep_freed_memory() -> bool:
    """Let the memory a request frees serve the next one (glibc; False where it is not glibc).

    By default glibc gives a large buffer pages of its own and returns them when it is freed, or
    trims the heap's free top once it passes twice that (adaptive) size; either way the next
    request that needs as much is handed fresh pages, each a page fault. A 256-group ingest on
    Postgres took ~2,700 of them, ~4 ms of system time of ~43 ms (docs/pool-service-passes.md,
    fifth pass). Kept, the process's resident size stays at what its busiest moment needed, up to
    `KEEP_FREE_MEMORY` beyond what is in use."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, KEEP_BUFFERS_BELOW) and mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_MEMORY)
    )


#: the routes of a training step and of a dashboard's polling, matched first in this order (each
#: route a request passes on its way costs a path match: ~375 us of CPU for a selection matched
#: 31st, in process); the API document keeps the order the routes are declared in
HOT_ROUTES: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/pools/{pool}/runs/{run}/batches"),
    ("POST", "/v1/pools/{pool}/batches/{batch_id}/commit"),
    ("POST", "/v1/pools/{pool}/runs/{run}/select"),
    ("POST", "/v1/pools/{pool}/runs/{run}/ingest"),
    ("GET", "/v1/pools/{pool}/runs/{run}/stats"),
    ("GET", "/v1/pools/{pool}/stats"),
    ("GET", "/v1/pools/{pool}/questions"),
    ("GET", "/v1/pools/{pool}/batches/{batch_id}"),
    ("POST", "/v1/pools/{pool}/tasks/claim"),
    ("POST", "/v1/pools/{pool}/runs/{run}/tasks/claim"),
    ("POST", "/v1/pools/{pool}/tasks/{task_id}/renew"),
    ("POST", "/v1/pools/{pool}/tasks/{task_id}/complete"),
)


def _route_key(route: Any) -> tuple[str, str]:
    """(method, path) of a route (its first method: every route here takes one, HEAD aside)."""
    methods = sorted(set(getattr(route, "methods", None) or ()) - {"HEAD"}) or [""]
    return methods[0], getattr(route, "path", "")


def declared_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of the app's routes in the order they are declared (`add_routers`)."""
    declared: list[tuple[str, str]] = app.state.declared_routes
    return declared


def add_routers(app: FastAPI, *routers: APIRouter) -> None:
    """The routers' routes, in the routers' order, as the app's own: one flat list, each route
    made anew for this app (`add_api_route`, as `include_router` made them before FastAPI 0.165),
    so the app's `dependency_overrides` reach them and two apps share none. Our routers carry
    their prefixes, tags and route classes themselves. `include_router` (FastAPI 0.165) adds one
    wrapper per router instead, and a request is then matched against the routes of every router
    before its own, and against its own router's routes twice: ~60 path matches for a run's stats
    (60-110 us of CPU a small request, in process, alternating). No two routes take the same
    request (`tests/unit/test_routes_flat.py`), so their order decides nothing."""
    for router in routers:
        for route in router.routes:
            if not isinstance(route, APIRoute):
                app.router.routes.append(route)
                continue
            app.router.add_api_route(
                route.path,
                route.endpoint,
                response_model=route.response_model,
                status_code=route.status_code,
                tags=route.tags,
                dependencies=route.dependencies,
                summary=route.summary,
                description=route.description,
                response_description=route.response_description,
                responses=route.responses,
                deprecated=route.deprecated,
                methods=route.methods,
                operation_id=route.operation_id,
                response_model_include=route.response_model_include,
                response_model_exclude=route.response_model_exclude,
                response_model_by_alias=route.response_model_by_alias,
                response_model_exclude_unset=route.response_model_exclude_unset,
                response_model_exclude_defaults=route.response_model_exclude_defaults,
                response_model_exclude_none=route.response_model_exclude_none,
                include_in_schema=route.include_in_schema,
                response_class=route.response_class,
                name=route.name,
                route_class_override=type(route),
                callbacks=route.callbacks,
                openapi_extra=route.openapi_extra,
                generate_unique_id_function=route.generate_unique_id_function,
            )
    app.state.declared_routes = [_route_key(r) for r in app.router.routes]
    rank = {key: i for i, key in enumerate(HOT_ROUTES)}
    app.router.routes.sort(key=lambda r: rank.get(_route_key(r), len(rank)))


def create_app(settings: Settings, *, freeze_heap: bool = False) -> FastAPI:
    """The service. `freeze_heap`: once started, `settle_heap()`, `collect_young_less_often()` and
    `keep_freed_memory()` (for a process that serves and does nothing else, as `exgrpo serve`; not
    for tests that build many apps in one process, whose frozen objects would never be
    collected)."""
    for name in SERVICE_LOGGERS:
        logging.getLogger(name).setLevel(settings.log_level)
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = await build_context(settings, metrics)
        app.state.ctx = ctx
        await ctx.index.prepare()
        indexed = await rebuild_all(ctx)
        if freeze_heap:
            settle_heap()
            collect_young_less_often()
            keep_freed_memory()
        log.info(
            "pool service ready",
            extra={
                "fields": {
                    "database": ctx.db.engine.dialect.name,
                    "index": ctx.index.name,
                    "indexed_questions": indexed,
                }
            },
        )
        try:
            yield
        finally:
            await ctx.index.close()
            await ctx.db.close()

    app = FastAPI(
        title="ExGRPO experience pool",
        version="0.1.0",
        description="The experience pool of ExGRPO training runs: questions, runs, batches, replay, tasks.",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc come from routes.docs, with their assets served here
        redoc_url=None,
    )
    install_handlers(app)
    app.add_middleware(DirectRoutes, owner=app)  # the innermost of the service's middleware
    if settings.max_active_requests:
        app.add_middleware(Admission, limit=settings.max_active_requests, waiting=metrics.requests_waiting)
    app.add_middleware(Observability, metrics=metrics)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes, import_limit=settings.max_import_bytes)
    if faults.enabled():
        log.warning("fault hooks are on (%s=1): for fault tests only", faults.ENV)
        app.add_middleware(faults.FaultHooks)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz(request: Request) -> JSONResponse:
        ctx: Context = request.app.state.ctx
        checks: dict[str, str] = {}
        try:
            async with ctx.db.read() as session:
                await session.execute(text("SELECT 1"))
            checks["database"] = "ok"
        except Exception as e:  # readiness reports, it does not raise
            checks["database"] = f"error: {type(e).__name__}"
        try:
            checks["index"] = "ok" if await ctx.index.ping() else "error"
        except Exception as e:
            checks["index"] = f"error: {type(e).__name__}"
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503
        )

    @app.get("/metrics", tags=["ops"])
    async def metrics_endpoint(request: Request) -> Response:
        ctx: Context = request.app.state.ctx
        async with ctx.db.read() as session:
            ctx.metrics.task_queue_depth.set(await repo.queue_depth(session))
        return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/admin/index/rebuild", tags=["ops"])
    async def rebuild(request: Request) -> dict[str, int]:
        from exgrpo_pool.api.deps import get_principal, require_admin

        ctx: Context = request.app.state.ctx
        await require_admin(await get_principal(request, ctx))
        return {"indexed_questions": await rebuild_all(ctx)}

    add_routers(app, pools.router, runs.router, batches.router, dashboard.router, docs.router)
    install_openapi(app, paths_order=[path for _, path in declared_routes(app)])
    return app
