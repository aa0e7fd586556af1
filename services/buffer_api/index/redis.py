"""Bucket index in Redis, shared by every API replica.

Keys (prefix P, scope S): `P:idx:S:b:<k>` sorted set of question ids (score = id, so ranks follow
id order), `P:idx:S:of` hash question -> bucket, `P:idx:S:bk` set of the buckets that may hold
members, `P:idx:S:gen` the scope's change counter, `P:idx:S:loaded` marker. A write's moves run in
one Lua script call (per 1,000 moves), so a question is never in two buckets, even with concurrent
writers.

A rebuild stages the new buckets under keys of its own (`P:idx:S:stage:<random>:...`, expiring),
then one Lua script swaps them in: rebuilds running at once never touch each other's keys, and
readers see either the old scope or a new one, whole. The script changes nothing when a staged key
is gone (Redis flushed meanwhile).

No request walks the db (SCAN, KEYS): a scope's buckets are found through its `bk` set, so the cost
of a plan or a select does not depend on how many other keys the db holds. Bucket keys written
before the `bk` set existed are found once, at start-up (`prepare`), under the `P:idx:format`
marker.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from exgrpo_pool.index.base import Move, RebuildLost

# KEYS[1] of, KEYS[2] bk, KEYS[3] gen; ARGV[1] bucket key prefix, then pairs of question and new
# bucket ('' = none). The change counter first: a rebuild that read the database before these
# moves sees the scope changed.
_MOVES = """
redis.call('INCR', KEYS[3])
for i = 2, #ARGV, 2 do
  local q, new = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[1], q)
  if old then
    redis.call('ZREM', ARGV[1] .. old, q)
  end
  if new == '' then
    redis.call('HDEL', KEYS[1], q)
  else
    redis.call('ZADD', ARGV[1] .. new, q, q)
    redis.call('HSET', KEYS[1], q, new)
    redis.call('SADD', KEYS[2], new)
  end
end
return 1
"""

# Scripts on a scope get KEYS[1] of, KEYS[2] bk, KEYS[3] loaded, KEYS[4] gen, KEYS[5..] more keys
# to delete (bucket keys left by older versions), and ARGV[1] the prefix of its bucket keys.

# empties the scope: every bucket the bk set names, the more keys, the hash and the set
_CLEAR = """
for _, b in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('UNLINK', ARGV[1] .. b)
end
for i = 5, #KEYS do
  redis.call('UNLINK', KEYS[i])
end
redis.call('UNLINK', KEYS[1], KEYS[2])
"""

# ARGV[2] expected generation ('' = any), ARGV[3] staged hash, ARGV[4] staged bucket key prefix,
# ARGV[5..] the staged buckets. Answers 1 (installed and loaded), 0 (installed, but the scope
# changed meanwhile: not loaded), -1 (something staged is gone: nothing changed).
_SWAP = (
    """
for i = 5, #ARGV do
  if redis.call('EXISTS', ARGV[4] .. ARGV[i]) == 0 then return -1 end
end
if #ARGV >= 5 and redis.call('EXISTS', ARGV[3]) == 0 then return -1 end
"""
    + _CLEAR
    + """
for i = 5, #ARGV do
  redis.call('RENAME', ARGV[4] .. ARGV[i], ARGV[1] .. ARGV[i])
  redis.call('PERSIST', ARGV[1] .. ARGV[i])
  redis.call('SADD', KEYS[2], ARGV[i])
end
if #ARGV >= 5 then
  redis.call('RENAME', ARGV[3], KEYS[1])
  redis.call('PERSIST', KEYS[1])
end
local gen = redis.call('GET', KEYS[4]) or '0'
if ARGV[2] == '' or ARGV[2] == gen then
  redis.call('SET', KEYS[3], '1')
  return 1
end
redis.call('DEL', KEYS[3])
return 0
"""
)

# a change: not loaded until rebuilt
_DROP = (
    _CLEAR
    + """
redis.call('DEL', KEYS[3])
redis.call('INCR', KEYS[4])
return 1
"""
)

# KEYS[1] loaded, KEYS[2] bk; ARGV[1] bucket key prefix. Answers nil (not loaded) or the non-empty
# buckets and their sizes, flat: bucket, size, bucket, size...
_LOADED_SIZES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local out = {}
for _, b in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local n = redis.call('ZCARD', ARGV[1] .. b)
  if n > 0 then
    out[#out + 1] = b
    out[#out + 1] = n
  end
end
return out
"""

# ARGV[1] bucket key prefix, ARGV[2] pairs of bucket and rank in one text, "b r b r ..." (one
# argument: the client encodes each argument in Python, ~0.5 us apiece, two per question). Answers
# the member at each rank, or '' where the bucket has no such rank (it shrank since it was sized)
_PICK = """
local out = {}
local bucket = nil
for word in string.gmatch(ARGV[2], '%S+') do
  if bucket == nil then
    bucket = word
  else
    local m = redis.call('ZRANGE', ARGV[1] .. bucket, word, word)
    out[#out + 1] = m[1] or ''
    bucket = nil
  end
end
return out
"""

# KEYS[1] loaded, KEYS[2] bk; ARGV[1] bucket key prefix, ARGV[2] the sizes the ranks were drawn
# from, "b n b n ...", ARGV[3] the ranks as `_PICK` takes them. Answers nil (not loaded), {0, the
# non-empty buckets and their sizes now, flat} when they are not exactly ARGV[2], else {1, picks}
_PICK_SIZED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local expected, count, bucket = {}, 0, nil
for word in string.gmatch(ARGV[2], '%S+') do
  if bucket == nil then
    bucket = word
  else
    expected[bucket] = tonumber(word)
    count = count + 1
    bucket = nil
  end
end
local sizes, same, seen = {}, true, 0
for _, b in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local n = redis.call('ZCARD', ARGV[1] .. b)
  if n > 0 then
    sizes[#sizes + 1] = b
    sizes[#sizes + 1] = n
    seen = seen + 1
    if expected[b] ~= n then same = false end
  end
end
if not same or seen ~= count then return {0, sizes} end
""" + _PICK.replace("ARGV[2]", "ARGV[3]").replace("return out", "return {1, out}")

_CHUNK = 5000
#: moves per script call (Redis runs a script alone: this bounds how long one call holds it)
_MOVES_PER_CALL = 1000
#: the key layout this module writes (the `bk` set of every scope); older layouts are dropped once
_FORMAT = "2"
#: staged keys of a rebuild that died half-way expire after this long
_STAGE_TTL_S = 600


class RedisIndex:
    name = "redis"

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self._r = client
        self._prefix = prefix
        self._moves = client.register_script(_MOVES)
        self._swap = client.register_script(_SWAP)
        self._drop = client.register_script(_DROP)
        self._loaded_sizes = client.register_script(_LOADED_SIZES)
        self._pick = client.register_script(_PICK)
        self._pick_sized = client.register_script(_PICK_SIZED)

    def _k(self, scope: int, suffix: str) -> str:
        return f"{self._prefix}:idx:{scope}:{suffix}"

    def _fixed(self, scope: int) -> list[str]:
        return [self._k(scope, "of"), self._k(scope, "bk"), self._k(scope, "loaded"), self._k(scope, "gen")]

    async def _buckets(self, scope: int) -> list[int]:
        return sorted(int(b) for b in await self._r.smembers(self._k(scope, "bk")))

    async def prepare(self) -> None:
        """Once per Redis db and key prefix, at start-up: drop the scopes whose bucket keys were
        written before the `bk` set existed (they are rebuilt from the database on their next
        use), so no request ever has to look for such keys."""
        marker = f"{self._prefix}:idx:format"
        if await self._r.get(marker) == _FORMAT.encode():
            return
        head = f"{self._prefix}:idx:"
        legacy: dict[int, list[str]] = {}
        async for raw in self._r.scan_iter(f"{head}*:b:*", count=1000):
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            name, sep, bucket = key[len(head) :].partition(":b:")
            if sep and bucket.isdigit() and name.lstrip("-").isdigit():  # not a staged key
                legacy.setdefault(int(name), []).append(key)
        for scope, keys in legacy.items():
            if not await self._r.exists(self._k(scope, "bk")):
                await self._drop(keys=[*self._fixed(scope), *keys], args=[self._k(scope, "b:")])
        await self._r.set(marker, _FORMAT)

    async def generation(self, scope: int) -> int:
        return int(await self._r.get(self._k(scope, "gen")) or 0)

    async def replace(
        self, scope: int, members: Mapping[int, Sequence[int]], *, generation: int | None = None
    ) -> bool:
        stage = self._k(scope, f"stage:{uuid.uuid4().hex}")
        buckets = [b for b, ids in members.items() if ids]
        pipe = self._r.pipeline(transaction=False)
        for bucket in buckets:
            ids = members[bucket]
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i : i + _CHUNK]
                pipe.zadd(f"{stage}:b:{bucket}", {str(q): q for q in chunk})
                pipe.hset(f"{stage}:of", mapping={str(q): bucket for q in chunk})
            pipe.expire(f"{stage}:b:{bucket}", _STAGE_TTL_S)
        if buckets:
            pipe.expire(f"{stage}:of", _STAGE_TTL_S)
        await pipe.execute()
        outcome = await self._swap(
            keys=self._fixed(scope),
            args=[
                self._k(scope, "b:"),
                "" if generation is None else generation,
                f"{stage}:of",
                f"{stage}:b:",
                *buckets,
            ],
        )
        if int(outcome) < 0:
            raise RebuildLost(f"the staged index of scope {scope} vanished before it was swapped in")
        return int(outcome) == 1

    async def apply(self, scope: int, moves: Sequence[Move]) -> None:
        """The moves of a write, as one script call per `_MOVES_PER_CALL` moves: a command per move
        cost the client more than the rest of the request's Redis work (packing and parsing ~200
        commands of a 256-group ingest)."""
        if not moves:
            return
        keys = [self._k(scope, "of"), self._k(scope, "bk"), self._k(scope, "gen")]
        bucket_prefix = self._k(scope, "b:")
        for i in range(0, len(moves), _MOVES_PER_CALL):
            args: list[int | str] = [bucket_prefix]
            for q, new in moves[i : i + _MOVES_PER_CALL]:
                args += (q, "" if new is None else new)
            await self._moves(keys=keys, args=args)

    async def sizes(self, scope: int) -> dict[int, int]:
        buckets = await self._buckets(scope)
        if not buckets:
            return {}
        pipe = self._r.pipeline(transaction=False)
        for b in buckets:
            pipe.zcard(self._k(scope, f"b:{b}"))
        counts = await pipe.execute()
        return {b: int(c) for b, c in zip(buckets, counts, strict=True) if c}

    async def pick(self, scope: int, ranks: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """One trip: a script reads every rank (a pipeline of one ZRANGE per rank costs the client
        three times as much)."""
        text, order = _packed(ranks)
        if not order:
            return {b: [] for b in ranks}
        replies = await self._pick(keys=[], args=[self._k(scope, "b:"), text])
        return _picked(ranks, order, replies)

    async def pick_sized(
        self, scope: int, sizes: Mapping[int, int], ranks: Mapping[int, Sequence[int]]
    ) -> tuple[dict[int, list[int]] | None, dict[int, int] | None]:
        """One trip: a script checks the marker and every bucket's size, and picks if they are
        the ones given."""
        known = {int(b): int(n) for b, n in sizes.items() if n}
        text, order = _packed(ranks)
        reply = await self._pick_sized(
            keys=[self._k(scope, "loaded"), self._k(scope, "bk")],
            args=[self._k(scope, "b:"), " ".join(f"{b} {n}" for b, n in known.items()), text],
        )
        if reply is None:
            return None, None
        same, body = reply
        if not int(same):
            flat = [int(x) for x in body]
            return None, dict(sorted(zip(flat[::2], flat[1::2], strict=True)))
        return _picked(ranks, order, body), known

    async def is_loaded(self, scope: int) -> bool:
        return bool(await self._r.exists(self._k(scope, "loaded")))

    async def loaded_sizes(self, scope: int) -> dict[int, int] | None:
        """One trip: a script reads the marker and every bucket's size."""
        reply = await self._loaded_sizes(
            keys=[self._k(scope, "loaded"), self._k(scope, "bk")], args=[self._k(scope, "b:")]
        )
        if reply is None:
            return None
        flat = [int(x) for x in reply]
        return dict(sorted(zip(flat[::2], flat[1::2], strict=True)))

    async def drop(self, scope: int) -> None:
        await self._drop(keys=self._fixed(scope), args=[self._k(scope, "b:")])

    async def ping(self) -> bool:
        return bool(await self._r.ping())

    async def close(self) -> None:
        await self._r.aclose()


def _packed(ranks: Mapping[int, Sequence[int]]) -> tuple[str, list[int]]:
    """The ranks as the pick scripts take them ("b r b r ..."), and the bucket of each."""
    pairs: list[str] = []
    order: list[int] = []
    for bucket, rs in ranks.items():
        for r in rs:
            pairs.append(f"{int(bucket)} {int(r)}")
            order.append(bucket)
    return " ".join(pairs), order


def _picked(
    ranks: Mapping[int, Sequence[int]], order: list[int], replies: Sequence[Any]
) -> dict[int, list[int]]:
    """A pick script's replies by bucket ('' where a bucket had no such rank: it shrank)."""
    out: dict[int, list[int]] = {b: [] for b in ranks}
    for bucket, reply in zip(order, replies, strict=True):
        if reply:
            out[bucket].append(int(reply))
    return out
