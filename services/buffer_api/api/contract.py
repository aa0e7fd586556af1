"""The OpenAPI document describes the API that runs, and a wrong method says which are right.

FastAPI documents the success answer of each operation and a 422 with its own validation body.
This service answers every error as problem+json (RFC 9457, `schemas.Problem`) and can answer
400, 401, 403, 404, 409, 413, 422 and 503, so `install_openapi` rewrites the generated document once:
each operation lists the errors it can give with the Problem schema, writes declare their
`Idempotency-Key` header, and the few bodies that are not JSON models say their media type.
Which errors an operation can give follows from what it is (its path, its method, whether it
has parameters or a body), so a new route is described without anything written for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, routing
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, compile_path

from exgrpo_client.schemas import Problem
from exgrpo_pool.api.deps import idempotency

PROBLEM = "application/problem+json"
PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}

ERRORS: dict[int, str] = {
    400: "The body could not be read (not UTF-8 text of the declared media type).",
    401: "No bearer token, or an unknown one.",
    403: "The token lacks the scope this needs (read, write:<pool>, write:* or admin).",
    404: "The pool, run, batch, task or question in the path does not exist.",
    409: "The state does not allow it: the name is taken, the batch is committed or abandoned, "
    "the lease is lost, or the same Idempotency-Key was used for another request.",
    413: "The request body is over the service's limit: split it.",
    422: "The request breaks the schema or a rule of the pool; `detail` says what to change.",
    503: "The database or the sampling index is unavailable; the request changed nothing: retry.",
}

IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    "description": "Send a write again with the same key (and body) to get the first answer back "
    "instead of applying it twice.",
}

#: Operations whose bodies are not JSON models: (method, path) -> where and what.
MEDIA: dict[tuple[str, str], tuple[str, str, str]] = {
    ("get", "/metrics"): ("response", "text/plain", "Prometheus metrics in the text format."),
}
# an export's answer and an import's body are declared by their routes, both forms of each
# (`wire.frame_answer` / `wire.frame_body`)


@dataclass(frozen=True)
class Operation:
    """One route as the app serves it: its full path (router prefixes included) and methods."""

    path: str
    methods: frozenset[str]
    route: BaseRoute

    @property
    def regex(self) -> re.Pattern[str]:
        return compile_path(self.path)[0]


def operations(routes: Sequence[BaseRoute]) -> Iterator[Operation]:
    """Every route of an app, included routers flattened (FastAPI keeps them nested)."""
    iter_contexts = getattr(routing, "iter_route_contexts", None)
    if iter_contexts is None:  # FastAPI before nested included routers: routes are flat
        for route in routes:
            yield Operation(getattr(route, "path", ""), frozenset(getattr(route, "methods", ()) or ()), route)
        return
    for ctx in iter_contexts(routes):
        if ctx.path_format is not None:
            yield Operation(ctx.path_format, frozenset(ctx.methods or ()), ctx.original_route)


def dependency_calls(dependant: Dependant) -> set[Any]:
    """Every callable a route depends on, directly or through other dependencies."""
    out = {dependant.call}
    for sub in dependant.dependencies:
        out |= dependency_calls(sub)
    return out


def _errors_of(path: str, method: str, op: dict[str, Any]) -> list[int]:
    statuses = set()
    if path.startswith("/v1/"):
        statuses |= {401, 403, 503}
        if method in {"post", "put", "patch", "delete"} and path.startswith("/v1/pools"):
            statuses.add(409)
    if "{" in path:
        statuses.add(404)
    if op.get("parameters") or "requestBody" in op:
        statuses.add(422)
    if "requestBody" in op:
        statuses |= {400, 413}
    return sorted(statuses)


INT64_MAX = 2**63 - 1


def _exact_integer_bounds(node: Any) -> None:
    """FastAPI's document model keeps bounds as floats, so the largest int64 reads back as 2**63
    (one more than a BIGINT column holds). Integer bounds are written as exact integers again."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                value = node.get(key)
                if isinstance(value, float) and value.is_integer():
                    node[key] = INT64_MAX if value == 2.0**63 else int(value)
        for value in node.values():
            _exact_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_integer_bounds(value)


def describe(spec: dict[str, Any], routes: list[Any]) -> None:
    """Rewrite a generated OpenAPI document in place (see the module docstring)."""
    _exact_integer_bounds(spec)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for operation in operations(routes):
        route = operation.route
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        calls = dependency_calls(route.dependant)
        path = operation.path
        for method in sorted(m.lower() for m in operation.methods):
            op = spec["paths"].get(path, {}).get(method)
            if op is None:
                continue
            if idempotency in calls:
                op.setdefault("parameters", []).append(dict(IDEMPOTENCY_KEY))
            media = MEDIA.get((method, path))
            if media is not None:
                where, media_type, description = media
                body = {media_type: {"schema": {"type": "string"}}}
                if where == "request":
                    op["requestBody"] = {"required": True, "description": description, "content": body}
                else:
                    op["responses"]["200"] = {"description": description, "content": body}
            responses = op["responses"]
            for status in _errors_of(path, method, op):
                responses[str(status)] = {
                    "description": ERRORS[status],
                    "content": {PROBLEM: {"schema": PROBLEM_REF}},
                }
    ready = spec["paths"].get("/readyz", {}).get("get")
    if ready is not None:
        ready["responses"]["503"] = {
            "description": "Not ready: `checks` says which dependency failed.",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }


def install_openapi(app: FastAPI, paths_order: Sequence[str] = ()) -> None:
    """Serve the described document at /openapi.json (built once, on first use), its paths in
    `paths_order` (the order the routes are declared in; the app matches some of them first)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = generate()
            describe(spec, app.routes)
            place = {path: i for i, path in enumerate(dict.fromkeys(paths_order))}
            paths = spec["paths"]
            spec["paths"] = {p: paths[p] for p in sorted(paths, key=lambda p: place.get(p, len(place)))}
        return app.openapi_schema  # type: ignore[return-value]  # set by generate()

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise it


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of this path answers (a 405 names them in its Allow header)."""
    methods: set[str] = set()
    for operation in operations(app.routes):
        if operation.regex.match(path):
            methods |= operation.methods
    return sorted(methods)
