"""What the dashboard's reads cost: run stats, pool stats and a page of questions, in one process.

On a copy of the cached seeded pool of ``--size`` questions (``pool_bench.py`` seeds it), SQLite
or Postgres + Redis, ``--runs`` runs in the mixed phase each plan and commit ``--steps`` batches
(128 groups x 8 rollouts in frames, as pool_bench's trainers send them), so that every run has a
last committed batch and stored trajectories. Then each read is sent through the whole app with
``httpx.ASGITransport``, ``--rounds`` rounds of 10, and the process's CPU per request (all threads:
SQLite's work included, Postgres's not) and the wall time are printed as the medians of the
rounds. Pool stats read the totals and every run's stats; the 50-client mix of ``pool_bench.py``
sends one pool stats in four reads. The seeded run holds most of the pool (at 1M questions 200k
question states and ~500k trajectories): its stats, and its commits with and without the stats a
trainer asks for with every commit (``with_stats``, taking turns, ``--rounds`` of each; a commit's
time is the request's, its plan not counted), show what grows with the pool.

    .venv/bin/python bench/stats_bench.py [--backend sqlite|postgres] [--runs 20] [--steps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed
import pool_bench as pb

from exgrpo_client import frames
from exgrpo_pool.app import create_app


@contextlib.asynccontextmanager
async def _service(args: argparse.Namespace, tmp: Path) -> AsyncIterator[httpx.AsyncClient]:
    copy = _seed.seeded_copy(
        args.backend,
        args.size,
        pb.CACHE,
        tmp,
        "exgrpo_bench_stats",
        pg_dsn=args.pg_dsn,
        redis_url=args.redis_url,
    )
    async with copy as seeded:
        app = create_app(seeded.settings, freeze_heap=True)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://pool", timeout=120) as client:
                yield client


async def _train(client: httpx.AsyncClient, runs: list[str], steps: int) -> None:
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    trainer = pb.Trainer(0)
    for i, name in enumerate(runs):
        r = await client.post(f"{prefix}/runs", json={"name": name, "seed": i, "phase": "mixed"})
        if r.status_code != 201:
            raise SystemExit(f"create run: {r.status_code} {r.text[:300]}")
    for _ in range(steps):
        for name in runs:
            path = f"{prefix}/runs/{name}/batches"
            r = await client.post(path, json={"candidates": "all"}, headers={"accept": frames.MEDIA_TYPE})
            if r.status_code != 201:
                raise SystemExit(f"plan: {r.status_code} {r.text[:300]}")
            plan = pb.answer(r)
            body = trainer.commit_body(plan, "binary")
            path = f"{prefix}/batches/{plan['id']}/commit"
            r = await client.post(path, content=body, headers={"content-type": frames.MEDIA_TYPE})
            if r.status_code != 200:
                raise SystemExit(f"commit: {r.status_code} {r.text[:300]}")


async def _commits(client: httpx.AsyncClient, rounds: int) -> dict[str, dict[str, Any]]:
    """The seeded run's commits, with and without stats in turn: CPU and wall time of the commit
    request alone (its plan before it is not counted)."""
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    trainer = pb.Trainer(1)
    cpu: dict[str, list[float]] = {"commit": [], "commit with stats": []}
    wall: dict[str, list[float]] = {"commit": [], "commit with stats": []}
    for i in range(2 * rounds + 2):
        path = f"{prefix}/runs/{_seed.RUN_NAME}/batches"
        r = await client.post(path, json={"candidates": "all"}, headers={"accept": frames.MEDIA_TYPE})
        if r.status_code != 201:
            raise SystemExit(f"plan: {r.status_code} {r.text[:300]}")
        plan = pb.answer(r)
        name = "commit with stats" if i % 2 else "commit"
        body = trainer.commit_body(plan, "binary", with_stats=i % 2 == 1)
        c0, w0 = time.process_time(), time.perf_counter()
        r = await client.post(
            f"{prefix}/batches/{plan['id']}/commit", content=body, headers={"content-type": frames.MEDIA_TYPE}
        )
        c1, w1 = time.process_time(), time.perf_counter()
        if r.status_code != 200:
            raise SystemExit(f"commit: {r.status_code} {r.text[:300]}")
        if (r.json().get("stats") is not None) != (i % 2 == 1):
            raise SystemExit("commit: stats answered when not asked, or not when asked")
        if i >= 2:  # one of each to warm up
            cpu[name].append((c1 - c0) * 1000)
            wall[name].append((w1 - w0) * 1000)
    return {
        name: {"cpu_ms": statistics.median(cpu[name]), "wall_ms": statistics.median(wall[name]), "bytes": 0}
        for name in cpu
    }


async def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    runs = [f"stats-{i}" for i in range(args.runs)]
    reads = {
        "run stats": f"{prefix}/runs/{runs[len(runs) // 2]}/stats",
        "seeded run stats": f"{prefix}/runs/{_seed.RUN_NAME}/stats",
        "pool stats": f"{prefix}/stats",
        "questions (50)": f"{prefix}/questions?limit=50",
    }
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with _service(args, Path(tmp)) as client:
            await _train(client, runs, args.steps)
            cpu: dict[str, list[float]] = {name: [] for name in reads}
            wall: dict[str, list[float]] = {name: [] for name in reads}
            size: dict[str, int] = {}
            for name, url in reads.items():  # warm-up
                for _ in range(3):
                    r = await client.get(url)
                    if r.status_code != 200:
                        raise SystemExit(f"{name}: {r.status_code} {r.text[:300]}")
                size[name] = len(r.content)
            for _ in range(args.rounds):  # the reads take turns, round by round
                for name, url in reads.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    for _ in range(10):
                        await client.get(url)
                    cpu[name].append((time.process_time() - c0) / 10 * 1000)
                    wall[name].append((time.perf_counter() - w0) / 10 * 1000)
            for name in reads:
                out[name] = {
                    "cpu_ms": statistics.median(cpu[name]),
                    "wall_ms": statistics.median(wall[name]),
                    "bytes": size[name],
                }
            out.update(await _commits(client, args.rounds))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    res = asyncio.run(measure(args))
    print(
        f"\n{args.backend}, {args.size:,} questions, {args.runs} runs of {args.steps} committed steps"
        f" (+ the seeded run), median of {args.rounds} rounds of 10\n"
    )
    print("| request | CPU ms | wall ms | answer bytes |")
    print("|---|---:|---:|---:|")
    for name, r in res.items():
        size = f"{r['bytes']:,}" if r["bytes"] else ""
        print(f"| {name} | {r['cpu_ms']:.2f} | {r['wall_ms']:.2f} | {size} |")


if __name__ == "__main__":
    main()
