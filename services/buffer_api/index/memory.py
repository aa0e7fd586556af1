"""In-process bucket index (embedded default; one service process)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sortedcontainers import SortedList

from exgrpo_pool.index.base import Move


class _Scope:
    __slots__ = ("bucket_of", "buckets")

    def __init__(self) -> None:
        self.buckets: dict[int, SortedList] = {}
        self.bucket_of: dict[int, int] = {}


class MemoryIndex:
    name = "memory"

    def __init__(self) -> None:
        self._scopes: dict[int, _Scope] = {}
        self._loaded: set[int] = set()
        self._generation: dict[int, int] = {}

    async def generation(self, scope: int) -> int:
        return self._generation.get(scope, 0)

    async def replace(
        self, scope: int, members: Mapping[int, Sequence[int]], *, generation: int | None = None
    ) -> bool:
        s = _Scope()
        for bucket, ids in members.items():
            if ids:
                s.buckets[bucket] = SortedList(ids)
                for q in ids:
                    s.bucket_of[q] = bucket
        self._scopes[scope] = s
        current = generation is None or generation == self._generation.get(scope, 0)
        if current:
            self._loaded.add(scope)
        else:
            self._loaded.discard(scope)
        return current

    async def apply(self, scope: int, moves: Sequence[Move]) -> None:
        self._generation[scope] = self._generation.get(scope, 0) + 1
        s = self._scopes.setdefault(scope, _Scope())
        for q, new in moves:
            old = s.bucket_of.pop(q, None)
            if old is not None:
                members = s.buckets[old]
                members.discard(q)
                if not members:
                    del s.buckets[old]
            if new is not None:
                s.buckets.setdefault(new, SortedList()).add(q)
                s.bucket_of[q] = new

    async def sizes(self, scope: int) -> dict[int, int]:
        s = self._scopes.get(scope)
        return {} if s is None else {b: len(m) for b, m in s.buckets.items() if m}

    async def pick(self, scope: int, ranks: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        s = self._scopes.get(scope)
        if s is None:
            return {b: [] for b in ranks}
        out: dict[int, list[int]] = {}
        for b, rs in ranks.items():
            members = s.buckets.get(b, ())
            # a rank past the end picks nothing: the bucket shrank since it was sized
            out[b] = [members[int(r)] for r in rs if int(r) < len(members)]
        return out

    async def pick_sized(
        self, scope: int, sizes: Mapping[int, int], ranks: Mapping[int, Sequence[int]]
    ) -> tuple[dict[int, list[int]] | None, dict[int, int] | None]:
        if scope not in self._loaded:
            return None, None
        now = await self.sizes(scope)
        if now != {b: n for b, n in sizes.items() if n}:
            return None, now
        return await self.pick(scope, ranks), now

    async def is_loaded(self, scope: int) -> bool:
        return scope in self._loaded

    async def loaded_sizes(self, scope: int) -> dict[int, int] | None:
        return await self.sizes(scope) if scope in self._loaded else None

    async def drop(self, scope: int) -> None:
        self._generation[scope] = self._generation.get(scope, 0) + 1
        self._loaded.discard(scope)
        self._scopes.pop(scope, None)

    async def prepare(self) -> None:
        return None

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._scopes.clear()
        self._loaded.clear()
