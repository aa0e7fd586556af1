"""the trajectory tally per ten-second period of the trajectories' creation

A run's stats count its trajectories of the last five minutes (`ingest_per_minute`). That count
read every one of them through the (run, created) index: ~50k for a run ingesting at full speed,
6-9 ms of Postgres CPU per stats request, and it grows with the ingest rate (300k trajectories
in five minutes at 1k/s). Now the trajectory tally's cells are (pool, source run, period), a
period being ten seconds of `created_at` counted from the epoch: the stats sum the whole periods
inside the five minutes from the tally, and count rows only inside the period the five minutes
begin in (`repo.run_trajectory_counts`).

Periods that ended more than `repo.TALLY_FOLD_AFTER` ago are folded into period 0 of their cell
(`repo.fold_tallies`), so a cell keeps a few dozen rows however long its run ingests. The counts
are recounted here, the old periods folded at once; the statement triggers that keep the tally
on deletes and updates count the period too.

Postgres only: on SQLite every row stays in period 0 and a run's recent trajectories are counted
row by row as before. Its DELETE trigger would have to compute the period, and a SQLite trigger
that calls any SQL function (`strftime`, even `substr`) makes every DELETE of trajectories copy
the pages it changes into a statement journal on disk: 1.78 MB written before the commit for an
eviction of 200 trajectories of 1k tokens (`tests/unit/test_sqlite_tally_journal.py`), which
migration 0011 took away.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 11:30:00.000000
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

PERIOD_S = 10
#: periods that ended this long ago are folded into period 0 (`repo.TALLY_FOLD_AFTER`)
FOLD_AFTER_S = 600


def _period(column: str) -> str:
    return f"floor(extract(epoch FROM {column}) / {PERIOD_S})::bigint"


def _recount(periods: bool) -> None:
    """Postgres: the trajectory tally counted again, with periods (the old ones folded) or not."""
    op.execute("DELETE FROM trajectory_tally")
    if periods:
        cut = (int(time.time()) - FOLD_AFTER_S) // PERIOD_S
        period = _period("created_at")
        op.execute(
            "INSERT INTO trajectory_tally (pool_id, run_id, period, n, tokens) "
            "SELECT pool_id, coalesce(source_run_id, 0), "
            f"CASE WHEN {period} < {cut} THEN 0 ELSE {period} END, count(*), sum(num_tokens) "
            "FROM trajectory GROUP BY 1, 2, 3"
        )
    else:
        op.execute(
            "INSERT INTO trajectory_tally (pool_id, run_id, n, tokens) "
            "SELECT pool_id, coalesce(source_run_id, 0), count(*), sum(num_tokens) FROM trajectory "
            "GROUP BY 1, 2"
        )


def _postgres_function(periods: bool) -> None:
    """The statement triggers' function (0010's, the period added): a row per statement and cell."""
    keys = ["pool_id", "run_id", *(["period"] if periods else [])]
    key_exprs = ["c.pool_id", "coalesce(c.source_run_id, 0)"]
    if periods:
        key_exprs.append(_period("c.created_at"))
    keyed = ", ".join(f"{e} AS {k}" for k, e in zip(keys, key_exprs, strict=True))
    group = ", ".join(str(i + 1) for i in range(len(keys)))
    cols = ", ".join([*keys, "n", "tokens"])

    def cells(rows: str, sign: str) -> str:
        return f"SELECT {keyed}, {sign}1 AS n, {sign}c.num_tokens AS tokens FROM {rows} AS c"

    summed = f"SELECT {', '.join(keys)}, sum(n), sum(tokens)"
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION trajectory_tally_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'INSERT' THEN
                INSERT INTO trajectory_tally ({cols})
                {summed} FROM ({cells("new_rows", "")}) AS d GROUP BY {group};
            ELSIF TG_OP = 'DELETE' THEN
                INSERT INTO trajectory_tally ({cols})
                {summed} FROM ({cells("old_rows", "-")}) AS d GROUP BY {group};
            ELSE
                INSERT INTO trajectory_tally ({cols})
                {summed} FROM ({cells("new_rows", "")} UNION ALL {cells("old_rows", "-")}) AS d
                GROUP BY {group} HAVING sum(n) <> 0 OR sum(tokens) <> 0;
            END IF;
            RETURN NULL;
        END $$
        """
    )


def upgrade() -> None:
    op.add_column(
        "trajectory_tally", sa.Column("period", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
    )
    op.drop_index("ix_trajectory_tally_cell", table_name="trajectory_tally")
    op.create_index("ix_trajectory_tally_cell", "trajectory_tally", ["pool_id", "run_id", "period"])
    if op.get_bind().dialect.name == "postgresql":
        _postgres_function(periods=True)
        _recount(periods=True)


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        _postgres_function(periods=False)
    op.drop_index("ix_trajectory_tally_cell", table_name="trajectory_tally")
    op.drop_column("trajectory_tally", "period")
    op.create_index("ix_trajectory_tally_cell", "trajectory_tally", ["pool_id", "run_id"])
    if postgres:
        _recount(periods=False)
