"""Where a small request's CPU goes, layer by layer, against the floor's.

In one process, on a copy of the cached seeded pool (SQLite, or Postgres + Redis; `pool_bench.py`
seeds it), each of
the polled reads (a page of 50 questions, a run's stats, the pool's stats) and an ids-only
selection of 64 questions is sent as a bare ASGI call (no HTTP, no client) to:

* ``app``: the whole service app (middleware, routing, the route's handler, the endpoint);
* ``middleware``: the app's middleware stack with a trivial app where the lean routes' dispatch
  (`DirectRoutes`, the innermost) was;
* ``route``: the matched route's own part (a lean route's handler as `DirectRoutes` calls it, else
  the route's ASGI app: its handler and the endpoint, no routing);
* ``service``: the endpoint's service call alone (`exgrpo_pool.service`, the answer's bytes);
* ``floor``: the floor's whole app (`bench/_floor.py`: the same work, a minimal implementation).

Rounds alternate the five; the event-loop thread's CPU per request is taken per round and the
medians printed, with app/floor. Routing is what ``app`` leaves after ``route`` and
``middleware``; the framework's handler what ``route`` leaves after ``service``.

    .venv/bin/python bench/request_layers.py [--size 10000] [--rounds 10] [--per-round 100]
        [--backend sqlite|postgres]  (Postgres + Redis: the seeded template of `pool_bench.py`)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _floor
import _seed
import pool_bench as pb
from starlette.requests import Request

from exgrpo_client import schemas as s
from exgrpo_pool.api.deps import json_response
from exgrpo_pool.api.lean import DirectRoutes
from exgrpo_pool.app import create_app
from exgrpo_pool.service import batches
from exgrpo_pool.service import pools as svc

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _scope(
    method: str, path: str, query: bytes = b"", headers: tuple[tuple[bytes, bytes], ...] = ()
) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query,
        "headers": [(b"host", b"bench"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("bench", 80),
    }


async def asgi_request(app: Asgi, scope: dict[str, Any], body: bytes) -> tuple[int, bytes, dict[str, Any]]:
    """One request to `app` as a bare ASGI call: its status, its answer's body, and its scope as
    the app left it (the route it matched)."""
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return pending.pop() if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    sc = {**scope, "headers": list(scope["headers"])}
    await app(sc, receive, send)
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], answer, sc


async def _call(app: Asgi, scope: dict[str, Any], body: bytes) -> dict[str, Any]:
    """One request to `app` that must answer 200; its scope as the app left it."""
    status, answer, sc = await asgi_request(app, scope, body)
    if status != 200:
        raise SystemExit(f"{scope['path']}: {status} {answer[:300]!r}")
    return sc


def _route_app(route: Any) -> Asgi:
    """The matched route's own part as the app runs it: a lean route's handler (`LeanRoute.direct`,
    as `DirectRoutes` calls it), else the route's ASGI app (FastAPI's handler)."""
    handler = getattr(route, "direct", None)
    if handler is None:
        return route.handle  # type: ignore[no-any-return]

    async def direct(scope: dict[str, Any], receive: Any, send: Any) -> None:
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    return direct


async def _trivial(_scope: dict[str, Any], _receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def started(
    stack: contextlib.AsyncExitStack, args: argparse.Namespace, tag: str
) -> tuple[Any, _floor.Floor]:
    """The service's app (its lifespan entered) and the floor, each on its own copy of the cached
    seeded pool of `args.backend` and `args.size`, closed with `stack`."""
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    copy = await stack.enter_async_context(
        _seed.seeded_copy(
            args.backend, args.size, pb.CACHE, tmp, tag, pg_dsn=args.pg_dsn, redis_url=args.redis_url
        )
    )
    app = create_app(copy.settings, freeze_heap=True)
    await stack.enter_async_context(app.router.lifespan_context(app))
    floor = _floor.Floor(await _floor._connect(copy.url))
    await floor.load()
    return app, floor


async def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    pool, run = _seed.POOL_NAME, _seed.RUN_NAME
    select = json.dumps({"n": 64, "seed": 3, "candidates": "none"}).encode()
    json_in = (b"content-type", b"application/json")
    requests: dict[str, tuple[dict[str, Any], bytes]] = {
        "questions": (_scope("GET", f"{prefix}/questions", b"limit=50"), b""),
        "run_stats": (_scope("GET", f"{prefix}/runs/{run}/stats"), b""),
        "pool_stats": (_scope("GET", f"{prefix}/stats"), b""),
        "select_ids": (_scope("POST", f"{prefix}/runs/{run}/select", headers=(json_in,)), select),
    }
    out: dict[str, dict[str, float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        app, floor = await started(stack, args, "request_layers")
        ctx = app.state.ctx
        floor_app = _floor.app_for(floor)
        # the middleware stack over a trivial app where the lean routes' dispatch was
        bare: Any = app.build_middleware_stack()
        node = bare
        while not isinstance(node.app, DirectRoutes) and not hasattr(node.app, "routes"):
            node = node.app
        node.app = _trivial

        async def questions() -> None:
            with ctx.db.hot():
                json_response(await svc.list_questions(ctx, pool, 0, 50), 200)

        async def run_stats() -> None:
            with ctx.db.hot():
                json_response(await svc.run_stats(ctx, pool, run), 200)

        async def pool_stats() -> None:
            with ctx.db.hot():
                json_response(await svc.pool_stats(ctx, pool), 200)

        async def select_ids() -> None:
            with ctx.db.hot():
                req = s.SelectRequest.model_validate_json(select)
                (await batches.select_replay(ctx, pool, run, req)).json()

        services = {
            "questions": questions,
            "run_stats": run_stats,
            "pool_stats": pool_stats,
            "select_ids": select_ids,
        }
        for kind, (scope, body) in requests.items():
            routed = await _call(app, scope, body)
            route_scope = {k: v for k, v in routed.items() if k != "state"}
            route_app = _route_app(routed["route"])
            layers: dict[str, Callable[[], Awaitable[Any]]] = {
                "app": lambda sc=scope, b=body: _call(app, sc, b),
                "middleware": lambda sc=scope, b=body: _call(bare, sc, b),
                "route": lambda sc=route_scope, b=body, ra=route_app: _call(ra, sc, b),
                "service": services[kind],
                "floor": lambda sc=scope, b=body: _call(floor_app, sc, b),
            }
            for fn in layers.values():  # warm-up
                for _ in range(20):
                    await fn()
            cpu: dict[str, list[float]] = {k: [] for k in layers}
            for r in range(args.rounds):
                for name in list(layers)[:: 1 if r % 2 else -1]:
                    t0 = time.thread_time()
                    for _ in range(args.per_round):
                        await layers[name]()
                    cpu[name].append((time.thread_time() - t0) / args.per_round * 1e6)
            out[kind] = {k: statistics.median(v) for k, v in cpu.items()}
            print(f"{kind} done", file=sys.stderr, flush=True)
    return out


def arguments(doc: str | None) -> argparse.ArgumentParser:
    """The command line of an in-process comparison with the floor (this script's, and
    `select_steps.py`'s): the pool's size and backend, the rounds, the services' addresses."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument(
        "--pg-dsn", default=os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432")
    )
    ap.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return ap


def main() -> None:
    args = arguments(__doc__).parse_args()
    out = asyncio.run(measure(args))
    print(
        f"\n{'SQLite' if args.backend == 'sqlite' else 'Postgres + Redis'}, {args.size:,} questions, "
        "event-loop thread CPU us per request, "
        f"median of {args.rounds} rounds\n"
    )
    print("| request | app | middleware | routing | route's handler | service call | floor | app / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, m in out.items():
        routing = m["app"] - m["route"] - m["middleware"]
        handler = m["route"] - m["service"]
        print(
            f"| {kind} | {m['app']:.0f} | {m['middleware']:.0f} | {routing:.0f} | {handler:.0f} "
            f"| {m['service']:.0f} | {m['floor']:.0f} | {m['app'] / m['floor']:.2f} |"
        )


if __name__ == "__main__":
    main()
