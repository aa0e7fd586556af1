"""Where the tests find the shared evaluation data.

The ExGRPO/LUFFY parquet files are not part of this repository. Tests read them from
`../shared/data` next to the repository root, or from the folder named by `EXGRPO_SHARED_DATA`;
a test that needs one of them is skipped when it is absent (`needs`).

    from shared_data import VALID, needs

    @needs(VALID)
    def test_reads_the_validation_set() -> None: ...
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""
DATA = Path(os.environ.get("EXGRPO_SHARED_DATA") or ROOT.parent / "shared" / "data")
"""The shared data folder: $EXGRPO_SHARED_DATA, else ../shared/data beside the repository."""

VALID = DATA / "exgrpo" / "valid.parquet"
"""ExGRPO's in-training validation set (2,259 rows)."""
TEST_ID = DATA / "exgrpo" / "test.id.parquet"
"""ExGRPO's in-distribution test set (6,023 rows)."""
ARC_C = DATA / "luffy_ood" / "valid.arc_c.parquet"
GPQA = DATA / "luffy_ood" / "valid.gpqa.parquet"


def needs(*paths: Path) -> pytest.MarkDecorator:
    """Skip the test (or module, as `pytestmark`) unless every file in `paths` exists."""
    missing = [str(p) for p in paths if not p.is_file()]
    return pytest.mark.skipif(
        bool(missing), reason=f"not on this machine: {', '.join(missing)} (set EXGRPO_SHARED_DATA)"
    )
