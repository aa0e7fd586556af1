"""The Redis bucket index's moves: client CPU and wall time of one write's moves.

A commit or an ingest moves the questions it decided between buckets (`RedisIndex.apply`). This
sends `--moves` moves per call, `--calls` calls per round, rounds alternating between the index
as it is (one script call for all of a write's moves) and, with `--per-question`, the way it was
before: one script command per question in a pipeline (the script below, kept here only as the
baseline). Medians of the rounds, ms per call; the client's CPU is the process's (Redis's own work
is in its server).

    .venv/bin/python bench/index_bench.py [--moves 200] [--calls 10] [--rounds 20] [--per-question]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as aioredis

from exgrpo_pool.index.base import Move
from exgrpo_pool.index.redis import RedisIndex

# the move of one question, as the index ran it before it took a write's moves in one call
_PER_QUESTION = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  redis.call('ZREM', ARGV[3] .. old, ARGV[1])
end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('ZADD', ARGV[3] .. ARGV[2], ARGV[1], ARGV[1])
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('SADD', KEYS[2], ARGV[2])
end
return 1
"""

Apply = Callable[[int, Sequence[Move]], Awaitable[None]]


def _per_question(client: aioredis.Redis, prefix: str) -> Apply:
    script = client.register_script(_PER_QUESTION)

    async def apply(scope: int, moves: Sequence[Move]) -> None:
        head = f"{prefix}:idx:{scope}:"
        pipe = client.pipeline(transaction=False)
        pipe.incr(head + "gen")
        for q, new in moves:
            args = [q, "" if new is None else new, head + "b:"]
            await script(keys=[head + "of", head + "bk"], args=args, client=pipe)
        await pipe.execute()

    return apply


async def measure(
    url: str, moves: int, calls: int, rounds: int, per_question: bool
) -> dict[str, list[float]]:
    client = aioredis.from_url(url)
    prefix = f"bench-index-{uuid.uuid4().hex[:8]}"
    index = RedisIndex(client, prefix)
    ways: dict[str, Apply] = {"one call per write": index.apply}
    if per_question:
        ways["one script per question"] = _per_question(client, prefix)
    batch = [(q, 1 + q % 6) for q in range(moves)]
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    wall: dict[str, list[float]] = {w: [] for w in ways}
    try:
        for fn in ways.values():  # warm-up: scripts loaded, keys created
            await fn(1, batch)
        for r in range(rounds):
            for name in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(calls):
                    await ways[name](1, batch)
                cpu[name].append((time.process_time() - c0) / calls * 1000)
                wall[name].append((time.perf_counter() - w0) / calls * 1000)
    finally:
        async for key in client.scan_iter(f"{prefix}:*"):
            await client.delete(key)
        await client.aclose()
    return {f"{w} cpu": cpu[w] for w in ways} | {f"{w} wall": wall[w] for w in ways}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--moves", type=int, default=200)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-question", action="store_true", help="also the baseline: a script per question")
    args = ap.parse_args()
    out = asyncio.run(measure(args.redis_url, args.moves, args.calls, args.rounds, args.per_question))
    ways = [k.removesuffix(" cpu") for k in out if k.endswith(" cpu")]
    print(
        f"\n{args.moves} moves per call, median of {args.rounds} rounds of {args.calls} calls, ms per call\n"
    )
    print("| moves applied as | client CPU ms | wall ms |")
    print("|---|---:|---:|")
    for w in ways:
        print(
            f"| {w} | {statistics.median(out[w + ' cpu']):.2f} | {statistics.median(out[w + ' wall']):.2f} |"
        )


if __name__ == "__main__":
    main()
