"""Where the benchmarks find the shared evaluation data (the ExGRPO parquet files, not part of
this repository): `../shared/data` next to the repository root, or the folder named by
`EXGRPO_SHARED_DATA`. Benchmarks fall back to synthetic inputs when a file is absent."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("EXGRPO_SHARED_DATA") or ROOT.parent / "shared" / "data")
VALID = DATA / "exgrpo" / "valid.parquet"
TEST_ID = DATA / "exgrpo" / "test.id.parquet"
