"""a trajectory's tally period stored with it, on both backends

Migration 0014 gave the trajectory tally ten-second periods of `created_at` on Postgres only: on
SQLite the tally's DELETE trigger would have had to compute a deleted row's period, and a SQLite
trigger that calls any SQL function makes every DELETE of trajectories write the pages it changes
to a statement journal (`tests/unit/test_sqlite_tally_journal.py`). So SQLite counted a run's
trajectories of the last five minutes row by row: after a run ingested ~30k of them, ~1.4 ms of
each stats request, and more as the ingest rate grows.

Now every trajectory keeps its period in a column of its own (`trajectory.period`, written by
`repo.insert_trajectories` from the row's `created_at`). The triggers read the column, a plain
value: no function, no statement journal. SQLite keeps periods as Postgres does, and both read a
run's recent trajectories from the tally's whole periods (`repo.run_trajectory_counts`).

Rows stored before keep period 0 (long past) but those of the last `FOLD_AFTER_S`, whose periods
are set here; the trajectory tally is counted again with the periods, those long past folded into
period 0. A trajectory whose period was folded away and that is deleted later adds a row for its
old period, which the next fold puts in period 0 again (the counts' sums stay exact throughout).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07 13:20:00.000000
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

PERIOD_S = 10
#: periods that ended this long ago are folded into period 0 (`repo.TALLY_FOLD_AFTER`)
FOLD_AFTER_S = 600


def _computed(dialect: str, column: str) -> str:
    """A `created_at` column's period in SQL (allowed here: no trigger computes it)."""
    if dialect == "postgresql":
        return f"floor(extract(epoch FROM {column}) / {PERIOD_S})::bigint"
    return f"CAST(strftime('%s', {column}) AS INTEGER) / {PERIOD_S}"


def _sqlite_bump(row: str, sign: str, period: bool) -> str:
    """SQLite: a trajectory's row (`old` or `new`) added to (sign '') or taken from (sign '-') its
    tally cell, as 0010 made the statements and 0011 left them (OR IGNORE), with the period or not."""
    keys = {"pool_id": f"{row}.pool_id", "run_id": f"coalesce({row}.source_run_id, 0)"}
    if period:
        keys["period"] = f"{row}.period"
    match = " AND ".join(f"{k} = {e}" for k, e in keys.items())
    cols = ", ".join([*keys, "n", "tokens"])
    exprs = ", ".join([*keys.values(), f"{sign}(1)", f"{sign}({row}.num_tokens)"])
    adds = f"n = n + {sign}(1), tokens = tokens + {sign}({row}.num_tokens)"
    return (
        f"UPDATE OR IGNORE trajectory_tally SET {adds} WHERE {match}; "
        f"INSERT OR IGNORE INTO trajectory_tally ({cols}) SELECT {exprs} "
        f"WHERE NOT EXISTS (SELECT 1 FROM trajectory_tally WHERE {match});"
    )


def _sqlite_triggers(period: bool) -> None:
    read = ["pool_id", "source_run_id", "num_tokens", *(["period"] if period else [])]
    moved = " OR ".join(f"old.{c} IS NOT new.{c}" for c in read)
    op.execute("DROP TRIGGER IF EXISTS trajectory_tally_delete")
    op.execute("DROP TRIGGER IF EXISTS trajectory_tally_update")
    op.execute(
        "CREATE TRIGGER trajectory_tally_delete AFTER DELETE ON trajectory BEGIN "
        f"{_sqlite_bump('old', '-', period)} END"
    )
    op.execute(
        f"CREATE TRIGGER trajectory_tally_update AFTER UPDATE OF {', '.join(read)} ON trajectory "
        f"WHEN {moved} BEGIN {_sqlite_bump('old', '-', period)} {_sqlite_bump('new', '', period)} END"
    )


def _postgres_function(period: str) -> None:
    """The statement triggers' function (0014's), a changed row's period read as `period` (an
    expression of the changed rows `c`)."""
    keyed = f"c.pool_id AS pool_id, coalesce(c.source_run_id, 0) AS run_id, {period} AS period"

    def cells(rows: str, sign: str) -> str:
        return f"SELECT {keyed}, {sign}1 AS n, {sign}c.num_tokens AS tokens FROM {rows} AS c"

    cols = "pool_id, run_id, period, n, tokens"
    summed = "SELECT pool_id, run_id, period, sum(n), sum(tokens)"
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION trajectory_tally_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'INSERT' THEN
                INSERT INTO trajectory_tally ({cols})
                {summed} FROM ({cells("new_rows", "")}) AS d GROUP BY 1, 2, 3;
            ELSIF TG_OP = 'DELETE' THEN
                INSERT INTO trajectory_tally ({cols})
                {summed} FROM ({cells("old_rows", "-")}) AS d GROUP BY 1, 2, 3;
            ELSE
                INSERT INTO trajectory_tally ({cols})
                {summed} FROM ({cells("new_rows", "")} UNION ALL {cells("old_rows", "-")}) AS d
                GROUP BY 1, 2, 3 HAVING sum(n) <> 0 OR sum(tokens) <> 0;
            END IF;
            RETURN NULL;
        END $$
        """
    )


def _recount(period: str) -> None:
    """The trajectory tally counted again, each row in `period` (an expression of its columns),
    the periods long past folded into period 0."""
    cut = (int(time.time()) - FOLD_AFTER_S) // PERIOD_S
    op.execute("DELETE FROM trajectory_tally")
    op.execute(
        "INSERT INTO trajectory_tally (pool_id, run_id, period, n, tokens) "
        f"SELECT pool_id, coalesce(source_run_id, 0), CASE WHEN {period} < {cut} THEN 0 ELSE {period} END, "
        "count(*), sum(num_tokens) FROM trajectory GROUP BY 1, 2, 3"
    )


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.add_column(
        "trajectory", sa.Column("period", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
    )
    # the periods of the rows a fold would not yet fold, found over the (run, created) index
    since = datetime.fromtimestamp(time.time() - FOLD_AFTER_S - PERIOD_S, UTC)
    bound = since if dialect == "postgresql" else since.strftime("%Y-%m-%d %H:%M:%S.%f")
    for runs in ("source_run_id IN (SELECT id FROM run)", "source_run_id IS NULL"):
        op.get_bind().execute(
            sa.text(
                f"UPDATE trajectory SET period = {_computed(dialect, 'created_at')} "
                f"WHERE {runs} AND created_at >= :since"
            ),
            {"since": bound},
        )
    if dialect == "postgresql":
        _postgres_function("c.period")
    else:
        _sqlite_triggers(period=True)
    _recount("period")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _postgres_function(_computed(dialect, "c.created_at"))
    else:
        _sqlite_triggers(period=False)
    op.drop_column("trajectory", "period")
    # 0014's tally: periods of `created_at` on Postgres, period 0 on SQLite
    _recount(_computed(dialect, "created_at") if dialect == "postgresql" else "0")
