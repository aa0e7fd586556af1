"""A selection's trips to the Redis index: sizes then picks, against picks checked against the sizes
known to the replica, in one trip.

In one process, on a Redis scope of ``--buckets`` buckets of ``--members`` questions each, each way
draws ``--n`` questions (the spec's sampler, seeded) and picks them:

* ``two trips``: `loaded_sizes` (the marker and every bucket's size), then `pick`, as a plan does
  (and a selection did before sizes were kept);
* ``one trip``: `pick_sized` with the sizes this process read last, as a selection of a scope
  unchanged since does (the script checks them and picks);
* ``sizes first``: `pick_sized` with no ranks (the sizes it answers), then `pick`, as a selection
  after this replica's own commit does (the commit dropped the sizes it knew), and while the scope
  does not look quiet;
* ``another replica's write``: `pick_sized` with sizes one question off and the ranks drawn from
  them (in vain), the sizes it answers, then `pick`, as the first selection after another
  replica's commit on a quiet scope does.

and ``the draw alone``: the sampler's draws with a fresh generator, no trip (part of every way).

Rounds alternate the five; wall time and this thread's CPU per selection are taken per round and
the medians printed. Every way picks the same questions (checked before timing).

    .venv/bin/python bench/index_trips.py [--redis redis://127.0.0.1:6379/0] [--buckets 7]
        [--members 8000] [--n 64] [--rounds 20] [--per-round 100]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from exgrpo_pool.domain import Draw, ExperienceRules, make_rng, sample_replay
from exgrpo_pool.index.redis import RedisIndex

SCOPE = 1


def _ranks(draws: list[Draw]) -> dict[int, list[int]]:
    ranks: dict[int, list[int]] = {}
    for d in draws:
        ranks.setdefault(d.bucket, []).append(d.index)
    return ranks


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--buckets", type=int, default=7)
    ap.add_argument("--members", type=int, default=8000)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=100)
    opts = ap.parse_args()

    index = RedisIndex(aioredis.from_url(opts.redis), f"bench-index-trips-{uuid.uuid4().hex[:8]}")
    rules = ExperienceRules()
    try:
        members = {
            b: list(range(b * 10_000_000, b * 10_000_000 + opts.members)) for b in range(1, opts.buckets + 1)
        }
        await index.replace(SCOPE, members)
        known = await index.loaded_sizes(SCOPE)
        assert known is not None
        stale = {**known, 1: known[1] + 1}

        def draws(sizes: dict[int, int]) -> list[Draw]:
            return sample_replay(sizes, opts.n, rules, make_rng(1, 2, "select"))

        async def two_trips() -> dict[int, list[int]]:
            sizes = await index.loaded_sizes(SCOPE)
            assert sizes is not None
            return await index.pick(SCOPE, _ranks(draws(sizes)))

        async def one_trip() -> dict[int, list[int]]:
            ids, _ = await index.pick_sized(SCOPE, known, _ranks(draws(known)))
            assert ids is not None
            return ids

        async def sizes_first() -> dict[int, list[int]]:
            ids, now = await index.pick_sized(SCOPE, stale, {})
            assert ids is None and now is not None
            return await index.pick(SCOPE, _ranks(draws(now)))

        async def other_write() -> dict[int, list[int]]:
            ids, now = await index.pick_sized(SCOPE, stale, _ranks(draws(stale)))
            assert ids is None and now is not None
            return await index.pick(SCOPE, _ranks(draws(now)))

        async def draw_alone() -> dict[int, list[int]]:
            return _ranks(draws(known))

        ways: dict[str, Callable[[], Awaitable[dict[int, list[int]]]]] = {
            "two trips (sizes, then picks)": two_trips,
            "one trip (sizes known)": one_trip,
            "sizes first (sizes, then picks)": sizes_first,
            "another replica's write (checked, then picks)": other_write,
        }
        alone = {"the draw alone (no trip)": draw_alone}
        answers = [await way() for way in ways.values()]
        assert all(a == answers[0] for a in answers), "the ways picked unlike"
        ways.update(alone)
        wall: dict[str, list[float]] = {name: [] for name in ways}
        cpu: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(opts.rounds):
            for name, way in ways.items():
                c0, t0 = time.thread_time(), time.perf_counter()
                for _ in range(opts.per_round):
                    await way()
                wall[name].append((time.perf_counter() - t0) / opts.per_round * 1e6)
                cpu[name].append((time.thread_time() - c0) / opts.per_round * 1e6)
    finally:
        await index.drop(SCOPE)
        await index.close()

    base = statistics.median(wall["two trips (sizes, then picks)"])
    print(
        f"\nRedis index, {opts.buckets} buckets x {opts.members:,} questions, {opts.n} drawn, "
        f"us per selection, median of {opts.rounds} rounds\n"
    )
    print("| way | wall | CPU | wall / two trips |")
    print("|---|---:|---:|---:|")
    for name in ways:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"| {name} | {w:.0f} | {c:.0f} | {w / base:.2f} |")


if __name__ == "__main__":
    asyncio.run(main())
