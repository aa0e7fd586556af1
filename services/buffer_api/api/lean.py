"""The polled GET routes, the selection, and a training step's commit and a producer's ingest
answered without FastAPI's generic dependency solver.

A run's stats, the pool's stats and a page of questions are read every few seconds by dashboards
and trainers. Their own work is a fraction of a millisecond; FastAPI 0.165's solver, which asks of
every dependency on every request what kind of callable it is, which cache key and scopes it has
and which exit stack it needs, cost ~0.25-0.3 ms of CPU more per request (in process, a run's
stats through `route.handle`: 797-932 us, of which the endpoint 450-560). An ingest of 32 groups
(~10 ms of CPU) spent ~0.6 ms in the solver beyond validating its body.

`LeanRoute` compiles such a route's dependencies once, when the route is made, into the order in
which FastAPI solves them (each dependency's own dependencies first, then its path, query and
header parameters, then the endpoint's JSON body), and runs them so on every request: the very
same dependency functions, the same validation (FastAPI's own: `request_body_to_args` for the
body; for the parameters what `request_params_to_args` does, with what it works out from each
field on every request worked out once, `_read_params`), each dependency once per request
(FastAPI's cache), the
same errors in the same order (`RequestValidationError`; a body that is not JSON is refused before
anything else, as FastAPI refuses it). A route takes this path only when its endpoint is marked
`@lean` and returns a `Response` itself, and only while the app overrides no dependency; a marked
route whose dependencies need more than this (a form, several body parameters, a generator, a
sync function, security scopes, a `Response` or `BackgroundTasks` parameter) is refused when the
app is made, not served differently. Nothing is skipped: a dependency added to a lean route later
runs on this path too. `tests/service/test_lean_routes.py` compares its answers with FastAPI's,
request by request.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request, params
from fastapi.dependencies import utils as fastapi_utils
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import request_body_to_args, request_params_to_args
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic_core import PydanticUndefined
from starlette.convertors import FloatConvertor, IntegerConvertor, StringConvertor, UUIDConvertor
from starlette.datastructures import Headers, ImmutableMultiDict
from starlette.exceptions import HTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from exgrpo_pool import jsonread

F = TypeVar("F", bound=Callable[..., Any])

_LEAN = "__exgrpo_lean__"
#: where a parameter is read from (`_Step.readers`): the path, the query string, the headers
_PATH, _QUERY, _HEADER = 0, 1, 2
_UNREAD = object()
#: the path convertors whose values never hold a "/" (`_shape`)
_ONE_SEGMENT = (StringConvertor, IntegerConvertor, FloatConvertor, UUIDConvertor)


def lean(endpoint: F) -> F:
    """Mark an endpoint that returns a `Response` (a GET, or a route with one JSON body) for
    `LeanRoute`'s path."""
    setattr(endpoint, _LEAN, True)
    return endpoint


@dataclass(frozen=True, slots=True)
class _Step:
    """A dependency (or the endpoint, `name` None) as FastAPI solves it."""

    name: str | None
    call: Callable[..., Any]
    subs: tuple[_Step, ...]
    dependant: Dependant
    #: whether solving it (its own dependencies included) validates any parameter: FastAPI solves
    #: a cached dependency's own dependencies again, and their errors count again
    checks: bool
    #: its path, query and header parameters, each kind read by `_read_params` (or, None where
    #: it cannot, by FastAPI's `request_params_to_args`)
    readers: tuple[tuple[int, Sequence[Any], tuple[_Param, ...] | None], ...]

    async def solve(
        self,
        request: Request,
        cache: dict[Callable[..., Any], Any],
        errors: list[Any],
        body: Any = PydanticUndefined,
    ) -> dict[str, Any] | None:
        """The values to call this step with, or None where a parameter, the body (the
        endpoint's, `body`) or a dependency of it failed validation (the errors added to
        `errors`, as FastAPI adds them)."""
        values: dict[str, Any] = {}
        failed = False
        for sub in self.subs:
            if sub.call in cache and not sub.checks:
                if sub.name is not None:
                    values[sub.name] = cache[sub.call]
                continue
            sub_values = await sub.solve(request, cache, errors)
            if sub_values is None:
                failed = True
                continue
            if sub.call in cache:
                solved = cache[sub.call]
            else:
                solved = cache[sub.call] = await sub.call(**sub_values)
            if sub.name is not None:
                values[sub.name] = solved
        d = self.dependant
        for source, fields, read in self.readers:
            received: Any = request.path_params
            if source == _QUERY:
                received = request.query_params
            elif source == _HEADER:
                received = request.headers
            if read is None:
                got, errs = request_params_to_args(fields, received)
            else:
                got, errs = _read_params(read, received)
            values.update(got)
            if errs:
                errors += errs
                failed = True
        if d.body_params:
            got, errs = await request_body_to_args(d.body_params, body, embed_body_fields=False)
            values.update(got)
            if errs:
                errors += errs
                failed = True
        if d.request_param_name:
            values[d.request_param_name] = request
        return None if failed else values


def _unsupported(d: Dependant, *, endpoint: bool) -> str | None:
    """Why `LeanRoute` cannot solve `d` as FastAPI does (None: it can)."""
    if d.cookie_params:
        return "a cookie parameter"
    if d.body_params and not endpoint:
        return "a body parameter of a dependency"
    if len(d.body_params) > 1 or any(
        isinstance(f.field_info, params.Form) or getattr(f.field_info, "embed", False) for f in d.body_params
    ):
        return "a body of several parameters, an embedded one or a form"
    for what in (
        "websocket_param_name",
        "http_connection_param_name",
        "response_param_name",
        "background_tasks_param_name",
        "security_scopes_param_name",
    ):
        if getattr(d, what, None):
            return f"a parameter FastAPI fills itself ({what})"
    if any(getattr(d, what, None) for what in ("own_oauth_scopes", "parent_oauth_scopes", "security_scopes")):
        return "security scopes"
    if getattr(d, "concurrency", None) is not None:
        return "a concurrency limit"
    if not endpoint and not d.use_cache:
        return "a dependency without FastAPI's cache (use_cache=False)"
    call = d.call
    if call is None or not inspect.iscoroutinefunction(call):
        return f"{getattr(call, '__qualname__', call)} is not an async function"
    for sub in d.dependencies:
        why = _unsupported(sub, endpoint=False)
        if why is not None:
            return why
    return None


@dataclass(frozen=True, slots=True)
class _Param:
    """A path, query or header parameter as `request_params_to_args` reads it, with what that
    function works out from the field on every request worked out once: the request keys it
    looks for, in its order of preference, and whether the value is a list."""

    field: Any
    #: the request keys to look for, the first one found taken (none: the first)
    keys: tuple[str, ...]
    #: the location of its errors: "path", "query" or "header"
    where: str
    #: read as a list from a query string or headers (a sequence annotation, not JSON)
    many: bool
    #: a sequence annotation: an empty value counts as missing
    sequence: bool


def _param_reader(fields: Sequence[Any]) -> tuple[_Param, ...] | None:
    """`fields` as `_read_params` reads them, or None (FastAPI's `request_params_to_args` reads
    them): a parameter that is a model, or a FastAPI without the functions it reads with."""
    utils = fastapi_utils
    needed = (
        "_get_param_model",
        "_get_param_aliases",
        "_is_json_field",
        "_validate_value_with_model_field",
        "field_annotation_is_sequence",
    )
    if not all(hasattr(utils, name) for name in needed):
        return None
    out = []
    for f in fields:
        if utils._get_param_model(f) is not None or not isinstance(f.field_info, params.Param):
            return None
        keys = tuple(key for _alias, key in utils._get_param_aliases(f))
        sequence = bool(utils.field_annotation_is_sequence(f.field_info.annotation))
        many = sequence and not utils._is_json_field(f)
        out.append(_Param(f, keys, f.field_info.in_.value, many, sequence))
    return tuple(out)


def _read_params(read: tuple[_Param, ...], received: Any) -> tuple[dict[str, Any], list[Any]]:
    """`request_params_to_args(fields, received)`, with what it works out from the fields taken
    from `read`: the same values, the same errors in the same order (FastAPI's own validation;
    `tests/unit/test_lean_params.py`), ~1 us a parameter instead of ~5."""
    values: dict[str, Any] = {}
    errors: list[Any] = []
    multi = isinstance(received, ImmutableMultiDict | Headers)
    validate = fastapi_utils._validate_value_with_model_field
    for p in read:
        key = p.keys[0]
        if len(p.keys) > 1:
            key = next((k for k in p.keys if k in received), key)
        value = received.getlist(key) if p.many and multi else received.get(key, None)
        if value is None or (p.sequence and len(value) == 0):
            value = PydanticUndefined
        got, errs = validate(field=p.field, value=value, values=values, loc=(p.where, key))
        if errs:
            errors.extend(errs)
        else:
            values[p.field.name] = got
    return values, errors


def _compile(d: Dependant) -> _Step:
    subs = tuple(_compile(sub) for sub in d.dependencies)
    checks = bool(d.path_params or d.query_params or d.header_params) or any(s.checks for s in subs)
    assert d.call is not None  # `_unsupported` has checked it
    kinds = (d.path_params, d.query_params, d.header_params)
    readers = tuple((i, fields, _param_reader(fields)) for i, fields in enumerate(kinds) if fields)
    return _Step(d.name, d.call, subs, d, checks, readers)


def compile_route(route: APIRoute) -> _Step:
    """The route's endpoint as a `_Step`; ValueError where it cannot take the lean path."""
    if len((route.methods or set()) - {"HEAD"}) != 1:
        raise ValueError(f"{route.path}: a route of one method takes the lean path")
    why = _unsupported(route.dependant, endpoint=True)
    if why is not None:
        raise ValueError(f"{route.path} cannot take the lean path: {why}")
    return _compile(route.dependant)


class LeanRoute(APIRoute):
    """An `APIRoute` whose `@lean` endpoint is answered by its compiled dependencies."""

    #: the handler that answers a request of this route, for `DirectRoutes` (None: FastAPI's
    #: path answers it; a subclass that wraps the handler sets its wrapper)
    direct: Callable[[Request], Coroutine[Any, Any, Response]] | None = None

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if not getattr(self.endpoint, _LEAN, False):
            return handle
        step = compile_route(self)
        endpoint = step.call
        has_body = bool(step.dependant.body_params)

        async def lean_handler(request: Request) -> Response:
            if request.app.dependency_overrides:  # FastAPI's solver applies them
                return await handle(request)
            body = await _json_body(request) if has_body else PydanticUndefined
            errors: list[Any] = []
            values = await step.solve(request, {}, errors, body)
            if values is None:
                raise RequestValidationError(errors)
            response = await endpoint(**values)
            if not isinstance(response, Response):
                raise TypeError(f"{self.path}: a @lean endpoint returns a Response, not {type(response)}")
            return response

        self.direct = lean_handler
        return lean_handler


def _is_json(content_type: str) -> bool:
    """`application/json` or `application/<anything>+json`, parameters aside."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _json_body(request: Request) -> Any:
    """A request's body as FastAPI hands it to validation: nothing for an empty body, the JSON
    value under a JSON media type (`jsonread.loads`: `json.loads`'s values, faster; a body read
    before, such as a binary frame's by `wire.FrameRoute`, as it was read), the bytes
    under any other or none (which the body's model then refuses); a text that is not JSON is a
    `json_invalid` error, a body that cannot be read a 400."""
    try:
        raw = await request.body()
    except HTTPException:
        raise
    except Exception as e:
        raise HTTPException(400, "There was an error parsing the body") from e
    if not raw:
        return PydanticUndefined
    content_type = request.headers.get("content-type")
    if content_type is None or not _is_json(content_type):
        return raw
    parsed = request.__dict__.get("_json", _UNREAD)
    if parsed is not _UNREAD:  # read already, as FastAPI's `request.json()` takes it (a frame's body)
        return parsed
    try:
        return jsonread.loads(raw)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": e.msg}}], body=e.doc) from e
    except ValueError as e:  # not text at all (bytes that no Unicode encoding reads)
        raise HTTPException(400, "There was an error parsing the body") from e


def lean_routes(routes: Sequence[Any]) -> list[str]:
    """The paths of the routes that take the lean path."""
    return [r.path for r in routes if isinstance(r, LeanRoute) and getattr(r.endpoint, _LEAN, False)]


class DirectRoutes:
    """The lean routes answered from inside the service's own middleware (request id, access log,
    latency, admission), without FastAPI's router and the layers around it.

    A run's stats are ~0.2 ms of the event loop's CPU, of which FastAPI's exception middleware, its
    exit-stack middleware, the router (its scope bookkeeping for telemetry and mounted frontends,
    then each route's match) and the route's request-response wrapper (a `Request`, two exit
    stacks, the exception wrapper) took ~25 us. Here the routes are matched in the router's own
    order, with the router's own `matches`: where the first route that matches the request at all
    matches it fully and is a lean one, its handler (`LeanRoute.direct`: the same checks, the same
    dependencies, the same endpoint) answers it, and an exception it raises is answered by the
    app's handler for it, found as Starlette's exception middleware finds it (by status code for an
    HTTP exception, then by the exception's classes); an exception no handler takes goes up to the
    service's middleware as before. Anything else (no route, a partial match, another route, an app
    whose dependencies are overridden, a request traced by FastAPI's telemetry, a mounted
    frontend's scope) goes to the app as it came. `tests/service/test_lean_routes.py` compares the
    answers with FastAPI's, request by request."""

    def __init__(self, app: ASGIApp, owner: FastAPI) -> None:
        self.app, self.owner = app, owner
        self.shapes = _RouteShapes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = self.owner
        if scope["type"] == "http" and not owner.dependency_overrides and "fastapi.telemetry" not in scope:
            for route in self.shapes.candidates(owner.router.routes, scope):
                match, child = route.matches(scope)
                if match is Match.NONE:
                    continue
                handler = getattr(route, "direct", None)
                if match is Match.FULL and handler is not None and "fastapi" not in child:
                    await self._answer(handler, {**child, "router": owner.router}, scope, receive, send)
                    return
                break
        await self.app(scope, receive, send)

    async def _answer(
        self,
        handler: Callable[[Request], Coroutine[Any, Any, Response]],
        child: dict[str, Any],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        scope.update(child)
        scope.setdefault("app", self.owner)
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            answer = self._handler_for(exc)
            if answer is None:
                raise
            response = await answer(request, exc)
        await response(scope, receive, send)

    def _handler_for(self, exc: Exception) -> Callable[..., Any] | None:
        """The app's handler of `exc` as Starlette's exception middleware finds it (None: it
        leaves `exc` to the middleware above it). The handlers of 500 and `Exception` belong to
        its outermost middleware, which the service's own answers first."""
        handlers = self.owner.exception_handlers
        if isinstance(exc, HTTPException) and exc.status_code in handlers and exc.status_code != 500:
            return handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls is Exception:
                break
            if cls in handlers:
                found: Callable[..., Any] = handlers[cls]
                return found
        return None


class _RouteShapes:
    """The routes a request's path can match, in the router's order, found by the path's shape:
    its number of segments and its last segment. A route whose parameters each match within one
    segment (any convertor but `path`) matches only paths of its own number of segments, and of
    its own last segment where that is literal; any other route (a `path` parameter, a mount, a
    host) may match anything and stays on every list. `DirectRoutes` still asks each candidate's
    `matches`, so the answer is the router's; it asks one route or two instead of each route
    before the one that matches (a run's stats: five routes, ~5 us)."""

    def __init__(self) -> None:
        self._of: tuple[int, int] | None = None
        self._routes: Sequence[Any] = ()
        #: per route: (segments, literal last segment or None), or None for any path
        self._shapes: list[tuple[int, str | None] | None] = []
        self._literal: set[tuple[int, str]] = set()
        self._lists: dict[tuple[int, str | None], list[Any]] = {}

    def candidates(self, routes: Sequence[Any], scope: Scope) -> Sequence[Any]:
        if scope.get("root_path"):  # matched against the path below it: every route, as the router
            return routes
        if self._of != (id(routes), len(routes)):
            self._index(routes)
        path: str = scope["path"]
        n = path.count("/")
        last = path[path.rfind("/") + 1 :]
        key = (n, last if (n, last) in self._literal else None)
        found = self._lists.get(key)
        if found is None:
            found = self._lists[key] = [
                r
                for r, shape in zip(self._routes, self._shapes, strict=True)
                if shape is None or (shape[0] == n and shape[1] in (None, key[1]))
            ]
        return found

    def _index(self, routes: Sequence[Any]) -> None:
        self._of, self._routes = (id(routes), len(routes)), list(routes)
        self._shapes = [_shape(r) for r in self._routes]
        self._literal = {(s[0], s[1]) for s in self._shapes if s is not None and s[1] is not None}
        self._lists = {}


def _shape(route: Any) -> tuple[int, str | None] | None:
    """(segments, literal last segment or None) of a plain route whose parameters each match
    within a segment; None for any other route."""
    if not isinstance(route, Route) or not all(
        isinstance(c, _ONE_SEGMENT) for c in route.param_convertors.values()
    ):
        return None
    path = route.path
    last = path[path.rfind("/") + 1 :]
    return path.count("/"), None if "{" in last else last
