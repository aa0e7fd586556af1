"""SQLite called from the event loop against aiosqlite's thread per connection (`sqlite_driver`).

In one process, two apps of the service on two copies of the cached seeded SQLite pool of
``--size`` questions (``pool_bench.py`` seeds it), one per driver, each request sent through the
whole app with ``httpx.ASGITransport``. Rounds alternate between the drivers; each round sends
every request kind 20 times and takes the process's CPU (all threads: aiosqlite's work is in its
threads) and the wall time per request. Medians of the rounds are printed, with thread/inline.

Request kinds: a selection of ``--n`` questions with ids only (``candidates: none``), the same
selection with every candidate trajectory's payload (``candidates: all``), the pool's stats, and
the run's stats.

    .venv/bin/python bench/sqlite_driver.py [--size 10000] [--n 64] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed
import pool_bench as pb

from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

DRIVERS = ("thread", "inline")
REPEAT = 20


@contextlib.asynccontextmanager
async def _client(seed: Path, work: Path, driver: str) -> AsyncIterator[httpx.AsyncClient]:
    _seed.copy_sqlite(seed, work)
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{work}",
        allow_anonymous=True,
        sqlite_driver=driver,  # type: ignore[arg-type]
    )
    app = create_app(settings, freeze_heap=True)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            yield client


def _kinds(client: httpx.AsyncClient, n: int) -> dict[str, Callable[[], Awaitable[None]]]:
    run = f"/v1/pools/{_seed.POOL_NAME}/runs/{_seed.RUN_NAME}"

    def select(candidates: str) -> Callable[[], Awaitable[None]]:
        raw = json.dumps({"n": n, "seed": 1, "candidates": candidates}).encode()

        async def call() -> None:
            r = await client.post(f"{run}/select", content=raw, headers={"content-type": "application/json"})
            r.raise_for_status()

        return call

    def get(path: str) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            (await client.get(path)).raise_for_status()

        return call

    return {
        f"select n={n}, ids only": select("none"),
        f"select n={n}, all candidates": select("all"),
        "pool stats": get(f"/v1/pools/{_seed.POOL_NAME}/stats"),
        "run stats": get(f"{run}/stats"),
    }


async def measure(size: int, n: int, rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    seed = pb.CACHE / f"sqlite-{size}.db"
    if not seed.exists():
        raise SystemExit(f"no seeded pool at {seed}: run pool_bench.py --sizes {size} first")
    with tempfile.TemporaryDirectory() as tmp:
        async with contextlib.AsyncExitStack() as stack:
            kinds = {}
            for driver in DRIVERS:
                client = await stack.enter_async_context(_client(seed, Path(tmp) / f"{driver}.db", driver))
                kinds[driver] = _kinds(client, n)
            for driver in DRIVERS:  # warm-up: every page of what is read is in the page cache
                for fn in kinds[driver].values():
                    for _ in range(3):
                        await fn()
            cpu: dict[str, dict[str, list[float]]] = {d: {k: [] for k in kinds[d]} for d in DRIVERS}
            wall: dict[str, dict[str, list[float]]] = {d: {k: [] for k in kinds[d]} for d in DRIVERS}
            for r in range(rounds):
                for driver in DRIVERS if r % 2 == 0 else DRIVERS[::-1]:
                    for kind, fn in kinds[driver].items():
                        c0, w0 = time.process_time(), time.perf_counter()
                        for _ in range(REPEAT):
                            await fn()
                        cpu[driver][kind].append((time.process_time() - c0) / REPEAT * 1000)
                        wall[driver][kind].append((time.perf_counter() - w0) / REPEAT * 1000)
                print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return {
        d: {
            k: {"cpu_ms": statistics.median(cpu[d][k]), "wall_ms": statistics.median(wall[d][k])}
            for k in cpu[d]
        }
        for d in DRIVERS
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=10_000)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    out = asyncio.run(measure(args.size, args.n, args.rounds))
    print(f"\n{args.size:,} questions, median of {args.rounds} rounds of {REPEAT} requests, ms per request\n")
    print("| request | thread CPU | inline CPU | thread/inline | thread wall | inline wall | thread/inline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in out["thread"]:
        t, i = out["thread"][kind], out["inline"][kind]
        print(
            f"| {kind} | {t['cpu_ms']:.2f} | {i['cpu_ms']:.2f} | {t['cpu_ms'] / i['cpu_ms']:.2f} "
            f"| {t['wall_ms']:.2f} | {i['wall_ms']:.2f} | {t['wall_ms'] / i['wall_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
