"""The hot sampling index: per scope (a run, or a pooled pool), bucket k -> question ids.

Members of a bucket are kept ordered by question id, so "the i-th member" is well defined and a
seeded draw of ranks picks the same questions in process and in Redis. Everything here can be
rebuilt from the database (`run_question` rows that are bucketed and not retired).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

#: (question id, new bucket or None to remove from every bucket)
Move = tuple[int, int | None]


class RebuildLost(RuntimeError):
    """What a rebuild staged vanished before it was swapped in (Redis flushed or restarted): the
    scope is as it was; rebuild again."""


class BucketIndex(Protocol):
    """Every change of a scope (`apply`, `drop`) counts up the scope's generation. A rebuild reads
    the generation before it reads the database and hands it to `replace`: if a change came in
    meanwhile, the rebuilt scope may lack it, so it is installed but not marked loaded (the next
    use rebuilds it again). Rebuilds of one scope may run concurrently: each is installed whole."""

    name: str

    async def generation(self, scope: int) -> int:
        """The scope's change counter (0 for a scope never changed)."""

    async def replace(
        self, scope: int, members: Mapping[int, Sequence[int]], *, generation: int | None = None
    ) -> bool:
        """Make `scope` hold exactly these buckets, atomically for readers and concurrent rebuilds.
        Marks the scope loaded unless it changed since `generation` (None: unconditionally);
        answers whether it did."""

    async def apply(self, scope: int, moves: Sequence[Move]) -> None:
        """Move questions between buckets; a question is in at most one bucket."""

    async def sizes(self, scope: int) -> dict[int, int]:
        """Non-empty buckets and their sizes."""

    async def pick(self, scope: int, ranks: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """Question ids at the given ranks (0-based, ascending id order) of each bucket."""

    async def pick_sized(
        self, scope: int, sizes: Mapping[int, int], ranks: Mapping[int, Sequence[int]]
    ) -> tuple[dict[int, list[int]] | None, dict[int, int] | None]:
        """`pick`, if the scope is loaded and its non-empty buckets have exactly these `sizes` (the
        ones the ranks were drawn from): (the picks, the sizes). Else (None, the sizes now), or
        (None, None) for a scope not loaded. One read: sizes, marker and picks seen together."""

    async def is_loaded(self, scope: int) -> bool:
        """Whether `scope` was built since the index was last emptied."""

    async def loaded_sizes(self, scope: int) -> dict[int, int] | None:
        """`sizes` of a loaded scope (empty for a loaded scope without members), None for one that
        is not loaded: `is_loaded` and `sizes` at once, read together."""

    async def drop(self, scope: int) -> None:
        """Forget a scope (its run was deleted, or the index could not follow a change): it is not
        loaded until rebuilt."""

    async def prepare(self) -> None:
        """Once at start-up, before the first rebuild: bring over what an older version left."""

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
