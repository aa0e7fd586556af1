"""SQLite: a stored trajectory is counted by the insert that stores it, not by a row trigger

The INSERT trigger of `trajectory` (migration 0010) ran two tally statements for every stored
row: ~4 us a row on this machine, 0.3 ms of an ingest's 85 trajectories and ~1.3 ms of a commit's
340. `repo.insert_trajectories`, the one writer of trajectories, now counts what it stored in one
statement per tally cell, as it does on Postgres, which never had this trigger. The DELETE and
UPDATE triggers stay: a cascade from a deleted question or pool removes rows that no statement
of the service names. Rows loaded around `insert_trajectories` (a bulk load) are counted by
`repo.tally_trajectories` into an empty tally.

The counts stand as they are both ways: what was stored before was counted by the trigger, what
is stored after by the insert.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 21:00:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

#: the trigger as 0010 made it and 0011 left it (OR IGNORE: no statement journal)
_CELL = "pool_id = new.pool_id AND run_id = coalesce(new.source_run_id, 0)"
_TRIGGER = (
    "CREATE TRIGGER trajectory_tally_insert AFTER INSERT ON trajectory BEGIN "
    f"UPDATE OR IGNORE trajectory_tally SET n = n + (1), tokens = tokens + (new.num_tokens) WHERE {_CELL}; "
    "INSERT OR IGNORE INTO trajectory_tally (pool_id, run_id, n, tokens) "
    "SELECT new.pool_id, coalesce(new.source_run_id, 0), (1), (new.num_tokens) "
    f"WHERE NOT EXISTS (SELECT 1 FROM trajectory_tally WHERE {_CELL}); END"
)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trajectory_tally_insert")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(_TRIGGER)
