"""Everything a service function needs, built once per app by the lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from exgrpo_pool.config import Settings
from exgrpo_pool.index.base import BucketIndex
from exgrpo_pool.metrics import Metrics
from exgrpo_pool.store.db import Database


@dataclass(frozen=True, slots=True)
class KnownSizes:
    """A scope's bucket sizes as this replica last read them (None: its own write moved them since)
    and whether the scope looked quiet then: while it does, a selection draws from these sizes and
    the index checks them in the same trip as the picks; once another replica's write is found that
    way (a draw made in vain), a selection reads the sizes first until they are found unchanged.
    Replaced, never changed: a reader that awaited the index stores what it read only if the entry
    is still the one it started from (a write's `batches._follow` replaces it meanwhile)."""

    sizes: dict[int, int] | None
    quiet: bool = True


@dataclass
class Context:
    settings: Settings
    db: Database
    index: BucketIndex
    metrics: Metrics
    redis: Any | None = None
    #: (run id, epoch) -> shuffled fresh-question order; loaded from `run_epoch` on a miss.
    epoch_cache: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    #: scopes whose index missed a change (Redis unreachable after a commit): rebuilt on next use
    stale_scopes: set[int] = field(default_factory=set)
    #: scope -> its bucket sizes as last read here, for a selection to draw from
    #: (`batches._select_draws`)
    known_sizes: dict[int, KnownSizes] = field(default_factory=dict)
