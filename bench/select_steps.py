"""Where an ids-only selection's CPU goes, step by step, against the floor's.

In one process, on a copy of the cached seeded pool (SQLite, or Postgres + Redis; `pool_bench.py`
seeds it), the service's selection (`batches.select_replay`: the request's model, the service call,
the answer's JSON) and the floor's (`bench/_floor.py`'s `Floor.select`, its answer's dict) each
select 64 questions, ids only, `--per-round` times a round, alternating for `--rounds` rounds. The
event-loop thread's CPU per selection is printed (medians), then each side's steps (their functions
wrapped, inclusive means per selection; the wrappers cost ~1-2 us a call).

    .venv/bin/python bench/select_steps.py [--backend sqlite|postgres] [--size 10000]
        [--rounds 10] [--per-round 100]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _floor
import _seed
from request_layers import arguments, started
from write_steps import Timer, wrap

from exgrpo_client import schemas as s
from exgrpo_pool.service import batches
from exgrpo_pool.store import repo


async def measure(args: argparse.Namespace) -> None:
    pool, run = _seed.POOL_NAME, _seed.RUN_NAME
    body = json.dumps({"n": 64, "seed": 3, "candidates": "none"}).encode()
    service_steps, floor_steps = Timer(), Timer()
    for name in ("read_run", "_select_draws", "_pick_replay", "_replay_items", "sample_replay"):
        wrap(batches, name, f"batches.{name}", service_steps)
    for name in ("get_states", "questions_with_trajectories", "question_prompts", "picked_states"):
        if hasattr(repo, name):  # a tree before `picked_states` (`PYTHONPATH`) has the other three
            wrap(repo, name, f"repo.{name}", service_steps)
    for name in ("_replay", "_states", "_questions"):
        wrap(_floor.Floor, name, f"Floor.{name}", floor_steps)
    wrap(_floor, "sample_replay", "sample_replay", floor_steps)
    async with contextlib.AsyncExitStack() as stack:
        app, floor = await started(stack, args, "select_steps")
        ctx = app.state.ctx

        async def service() -> None:
            with ctx.db.hot():
                req = s.SelectRequest.model_validate_json(body)
                (await batches.select_replay(ctx, pool, run, req)).json()

        async def floor_select() -> None:
            await floor.select(run, json.loads(body))

        sides = {"service": (service, service_steps), "floor": (floor_select, floor_steps)}
        for fn, _ in sides.values():  # warm-up: the scope's sizes known, the statements prepared
            for _ in range(50):
                await fn()
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in list(sides)[:: 1 if r % 2 else -1]:
                fn, steps = sides[side]
                steps.on = True
                t0 = time.thread_time()
                for _ in range(args.per_round):
                    await fn()
                cpu[side].append((time.thread_time() - t0) / args.per_round * 1e6)
                steps.on = False
    total = args.rounds * args.per_round
    what = "SQLite" if args.backend == "sqlite" else "Postgres + Redis"
    print(f"\n{what}, {args.size:,} questions, ids-only selection of 64, loop-thread CPU us per selection\n")
    print("| side | CPU (median of rounds) |")
    print("|---|---:|")
    for side, values in cpu.items():
        print(f"| {side} | {statistics.median(values):.0f} |")
    print("\n| side | step (inclusive) | us |")
    print("|---|---|---:|")
    for side, (_, steps) in sides.items():
        for label, ms, _ in steps.rows(total):
            print(f"| {side} | {label} | {ms * 1e3:.0f} |")


def main() -> None:
    asyncio.run(measure(arguments(__doc__).parse_args()))


if __name__ == "__main__":
    main()
