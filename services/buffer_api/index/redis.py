"""Bucket index in Redis, shared by every API replica.

Keys (prefix P, scope S): `P:idx:S:b:<k>` sorted set of question ids (score = id, so ranks follow
id order), `P:idx:S:of` hash question -> bucket, `P:idx:S:loaded` marker. Moves run as one Lua
script per question so a question is never in two buckets, even with concurrent writers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis

from exgrpo_pool.index.base import Move

_MOVE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  redis.call('ZREM', ARGV[3] .. old, ARGV[1])
end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('ZADD', ARGV[3] .. ARGV[2], ARGV[1], ARGV[1])
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return 1
"""

_CHUNK = 5000


class RedisIndex:
    name = "redis"

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self._r = client
        self._prefix = prefix
        self._move = client.register_script(_MOVE)

    def _k(self, scope: int, suffix: str) -> str:
        return f"{self._prefix}:idx:{scope}:{suffix}"

    async def _bucket_keys(self, scope: int) -> list[str]:
        pattern = self._k(scope, "b:*")
        return [k.decode() if isinstance(k, bytes) else k async for k in self._r.scan_iter(pattern)]

    async def replace(self, scope: int, members: Mapping[int, Sequence[int]]) -> None:
        tmp = f"{self._prefix}:idx:{scope}:tmp"
        pipe = self._r.pipeline(transaction=False)
        for key in [k async for k in self._r.scan_iter(f"{tmp}:*")]:
            pipe.delete(key)
        for bucket, ids in members.items():
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i : i + _CHUNK]
                pipe.zadd(f"{tmp}:b:{bucket}", {str(q): q for q in chunk})
                pipe.hset(f"{tmp}:of", mapping={str(q): bucket for q in chunk})
        await pipe.execute()
        old_keys = await self._bucket_keys(scope)
        tx = self._r.pipeline(transaction=True)
        for key in old_keys:
            tx.delete(key)
        tx.delete(self._k(scope, "of"))
        for bucket, ids in members.items():
            if ids:
                tx.rename(f"{tmp}:b:{bucket}", self._k(scope, f"b:{bucket}"))
        if any(members.values()):
            tx.rename(f"{tmp}:of", self._k(scope, "of"))
        tx.set(self._k(scope, "loaded"), "1")
        await tx.execute()

    async def apply(self, scope: int, moves: Sequence[Move]) -> None:
        if not moves:
            return
        of_key = self._k(scope, "of")
        bucket_prefix = self._k(scope, "b:")
        pipe = self._r.pipeline(transaction=False)
        for q, new in moves:
            await self._move(keys=[of_key], args=[q, "" if new is None else new, bucket_prefix], client=pipe)
        await pipe.execute()

    async def sizes(self, scope: int) -> dict[int, int]:
        keys = await self._bucket_keys(scope)
        if not keys:
            return {}
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.zcard(key)
        counts = await pipe.execute()
        return {int(k.rsplit(":", 1)[1]): int(c) for k, c in zip(keys, counts, strict=True) if c}

    async def pick(self, scope: int, ranks: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        pipe = self._r.pipeline(transaction=False)
        order: list[int] = []
        for bucket, rs in ranks.items():
            key = self._k(scope, f"b:{bucket}")
            for r in rs:
                pipe.zrange(key, int(r), int(r))
                order.append(bucket)
        replies = await pipe.execute()
        out: dict[int, list[int]] = {b: [] for b in ranks}
        for bucket, reply in zip(order, replies, strict=True):
            if reply:
                out[bucket].append(int(reply[0]))
        return out

    async def is_loaded(self, scope: int) -> bool:
        return bool(await self._r.exists(self._k(scope, "loaded")))

    async def drop(self, scope: int) -> None:
        keys = [*await self._bucket_keys(scope), self._k(scope, "of"), self._k(scope, "loaded")]
        await self._r.delete(*keys)

    async def ping(self) -> bool:
        return bool(await self._r.ping())

    async def close(self) -> None:
        await self._r.aclose()
