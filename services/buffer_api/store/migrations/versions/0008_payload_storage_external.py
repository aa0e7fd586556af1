"""trajectory payloads stored without compression

Token ids and log-probs do not compress (random-looking int32 and float32), but Postgres' default
storage of a `bytea` column (EXTENDED) tries to compress every value before moving it out of line.
With STORAGE EXTERNAL the values go out of line as they are: a commit's insert of 340 trajectories
took 106 ms instead of 150 in bench/storage_bench.py, the reads the same (docs/benchmarks.md).
Rows stored before keep their form until rewritten. SQLite has no such setting: nothing to do.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 18:30:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

COLUMNS = ("token_ids", "logprobs")


def _set_storage(storage: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for column in COLUMNS:
        op.execute(f"ALTER TABLE trajectory ALTER COLUMN {column} SET STORAGE {storage}")


def upgrade() -> None:
    _set_storage("EXTERNAL")


def downgrade() -> None:
    _set_storage("EXTENDED")
