"""Where the pool service's CPU goes, per request type: cProfile of the real service on a seeded pool.

Starts the service as `pool_bench.py` does (uvicorn in a subprocess, on a copy of the cached
seeded pool of `--size` questions, Postgres + Redis or SQLite), runs 2 warm-up plan+commit steps,
then `--requests` rounds of plan, commit, select (64 questions, all candidates) and ingest (32
fresh groups), each in JSON and in frames. Every request type has its own profiler, switched on
(SIGUSR1) just before the request and off (SIGUSR2) just after it; the profilers count the CPU
time of the event-loop thread (`time.thread_time`), so waiting (for the database, for a CPU on a
loaded machine) is not counted, and SQLite's own work in its driver thread is not either.

Writes `bench/out/profile/<backend>/<request>_<encoding>.pstats` and `.txt` (the top functions by
own and cumulative time) and prints a summary: CPU per request of the profiled thread, and that
time by package. The seeded pools come from `pool_bench.py` (run it once at that size first).

    .venv/bin/python bench/pool_profile.py --backends sqlite,postgres --size 10000 --requests 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import json
import os
import pstats
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed
import pool_bench as pb

OUT = pb.OUT / "profile"
KINDS = ("plan", "commit", "select", "select_ids", "ingest")


def serve() -> None:
    """The service with one profiler per request type (the name is read from $PROFILE_CONTROL)."""
    import _serve
    import uvicorn

    from exgrpo_pool.app import create_app
    from exgrpo_pool.config import Settings

    control, out = Path(os.environ["PROFILE_CONTROL"]), Path(os.environ["PROFILE_DIR"])
    profilers: dict[str, cProfile.Profile] = {}
    current: list[str] = []

    def start(*_: Any) -> None:
        kind = control.read_text().strip()
        current[:] = [kind]
        profilers.setdefault(kind, cProfile.Profile(time.thread_time)).enable()

    def stop(*_: Any) -> None:
        for kind in current:
            profilers[kind].disable()
        current.clear()

    def dump(*_: Any) -> None:
        for kind, prof in profilers.items():
            prof.dump_stats(str(out / f"{kind}.pstats"))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    signal.signal(signal.SIGHUP, dump)
    settings = Settings()
    app: Any = create_app(settings, freeze_heap=True)
    _serve._install_sql_timer()
    if settings.redis_url:
        _serve._install_redis_timer()
    uvicorn.run(_serve.ServerTiming(app), host=settings.host, port=settings.port, log_level="warning")


def by_package(stats: pstats.Stats, top: int = 8) -> list[tuple[str, float]]:
    """Own time summed by package (site-packages name, this project's file, or the builtin)."""
    agg: dict[str, float] = collections.defaultdict(float)
    for (path, _line, name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "site-packages/" in path:
            key = path.split("site-packages/")[1].split("/")[0]
        elif path == "~":
            key = name.strip("<>").replace("built-in method ", "").replace("method ", "")[:40]
        elif "/services/" in path or "/clients/" in path:
            key = "exgrpo:" + Path(path).name
        else:
            key = "stdlib:" + Path(path).name
        agg[key] += own
    return sorted(agg.items(), key=lambda kv: -kv[1])[:top]


async def profile(backend: str, size: int, requests: int, opts: argparse.Namespace) -> None:
    where = OUT / backend
    where.mkdir(parents=True, exist_ok=True)
    control = where / "control"
    env_extra = {"PROFILE_SERVE": "1", "PROFILE_CONTROL": str(control), "PROFILE_DIR": str(where)}
    work_db = f"exgrpo_profile_{os.getpid()}"
    prefix_redis = f"exgrpo-profile-{os.getpid()}"
    if backend == "sqlite":
        seed = pb.CACHE / f"sqlite-{size}.db"
        if not seed.exists():
            raise SystemExit(f"no seeded pool at {seed}: run pool_bench.py --sizes {size} first")
        work = where / "work.db"
        _seed.copy_sqlite(seed, work)
        env = {"EXGRPO_DATABASE_URL": f"sqlite+aiosqlite:///{work}"}
    else:
        await _seed.copy_postgres(opts.pg_dsn, f"exgrpo_bench_seed_{size}", work_db)
        env = {
            "EXGRPO_DATABASE_URL": _seed.pg_url(opts.pg_dsn, work_db, driver=True),
            "EXGRPO_REDIS_URL": opts.redis_url,
            "EXGRPO_REDIS_PREFIX": prefix_redis,
        }
    server = pb.start_server({**env, **env_extra}, where / "server.log", None, Path(__file__).resolve())
    pid = server.proc.pid
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    trainer = pb.Trainer(seed=size)
    samples: dict[str, list[pb.Sample]] = {}
    try:
        async with pb.bench_client(server.url) as c:
            api = pb.Api(c, pid)

            async def post(
                kind: str | None, path: str, body: bytes, headers: dict[str, str]
            ) -> httpx.Response:
                if kind is None:
                    return (await pb.timed_post(api, path, body, headers))[0]
                control.write_text(kind)
                os.kill(pid, signal.SIGUSR1)
                await asyncio.sleep(0.05)  # the handler runs between two of the loop's steps
                r, smp = await pb.timed_post(api, path, body, headers)
                os.kill(pid, signal.SIGUSR2)
                await asyncio.sleep(0.05)
                samples.setdefault(kind, []).append(smp)
                return r

            for i in range(2 + requests):
                for enc in ("json", "binary"):
                    measured = i >= 2
                    key = {"Idempotency-Key": uuid.uuid4().hex}
                    r = await post(
                        f"plan_{enc}" if measured else None,
                        f"{prefix}/runs/{_seed.RUN_NAME}/batches",
                        json.dumps({"candidates": "all"}).encode(),
                        {**key, **pb.wire_headers(enc)},
                    )
                    plan = pb.answer(r)
                    await post(
                        f"commit_{enc}" if measured else None,
                        f"{prefix}/batches/{plan['id']}/commit",
                        trainer.commit_body(plan, enc),
                        {"Idempotency-Key": uuid.uuid4().hex, **pb.wire_headers(enc, frame_body=True)},
                    )
                    if not measured:
                        continue
                    await post(
                        f"select_{enc}",
                        f"{prefix}/runs/{_seed.RUN_NAME}/select",
                        json.dumps({"n": 64, "seed": i, "candidates": "all"}).encode(),
                        pb.wire_headers(enc),
                    )
                    await post(
                        f"select_ids_{enc}",
                        f"{prefix}/runs/{_seed.RUN_NAME}/select",
                        json.dumps({"n": 64, "seed": i, "candidates": "none"}).encode(),
                        pb.wire_headers(enc),
                    )
                    rng = np.random.default_rng([size, i, 9])
                    qids = [int(q) + 1 for q in rng.choice(size, size=32, replace=False)]
                    await post(
                        f"ingest_{enc}",
                        f"{prefix}/runs/{_seed.RUN_NAME}/ingest",
                        trainer.ingest_body(qids, enc),
                        {"Idempotency-Key": uuid.uuid4().hex, **pb.wire_headers(enc, frame_body=True)},
                    )
            os.kill(pid, signal.SIGHUP)
            await asyncio.sleep(1.0)
    finally:
        server.stop()
        if backend == "postgres":
            await _seed.pg_admin(opts.pg_dsn, f"DROP DATABASE IF EXISTS {work_db} WITH (FORCE)")
            pb._redis_cleanup(opts.redis_url, prefix_redis)
    print(f"## {backend}, {size:,} questions, {requests} requests each (ms per request)")
    for kind in (f"{k}_{e}" for k in KINDS for e in ("json", "binary")):
        st = pstats.Stats(str(where / f"{kind}.pstats"))
        buf = io.StringIO()
        st.stream = buf  # type: ignore[attr-defined]
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(50)
        (where / f"{kind}.txt").write_text(buf.getvalue())
        n = len(samples[kind])
        summary = pb.summarize(samples[kind])
        total = st.total_tt / n * 1000  # type: ignore[attr-defined]
        parts = ", ".join(f"{k} {v / n * 1000:.1f}" for k, v in by_package(st))
        print(
            f"{kind}: loop thread {total:.1f} (process {summary['server_cpu_mean_ms']:.1f}, "
            f"{summary['server_sql_statements_p50']:.0f} SQL statements); {parts}"
        )


def main() -> None:
    if os.environ.get("PROFILE_SERVE") == "1":
        serve()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=5)
    args = ap.parse_args()
    opts = pb.parse([])
    for backend in args.backends.split(","):
        asyncio.run(profile(backend, args.size, args.requests, opts))


if __name__ == "__main__":
    main()
