"""tallies of states, trajectories and questions, kept by triggers

Run stats, pool stats and a pool's page of questions counted rows: a run's state histogram over
every question state of its scope, its trajectory total over every trajectory it stored, a pool's
totals over all its questions and trajectories. At 1M questions a run's stats took 124 ms of
statements on SQLite, and the trainer asks for them with every commit. Now triggers on
`run_question`, `trajectory` and `question` keep counts per cell (scope x bucket x retired; pool x
source run, with the token sum; pool), and the reads sum a few rows.

SQLite keeps one row per cell, updated by row triggers (one writer at a time). Postgres adds one
row per statement and cell from statement triggers over the transition tables, so that no writer
waits for another's count; `repo.fold_tallies` folds each cell's rows into one, after writes.
Postgres has no INSERT trigger on `trajectory`: a transition table holds each new row with its
payload copied in (~10 ms for a commit's 340 trajectories), so `repo.insert_trajectories` adds
the tally rows of what it inserted in the same statement (`repo.tally_trajectories` counts
rows inserted otherwise, as a bulk load does).

The pool's trajectory index, (pool, tokens) since 0009 for the token sum, becomes (pool, id): the
sum is the tally's now, and what reads a pool's trajectories in order (eviction of the oldest, the
export) walks it; a new trajectory goes at its pool's end instead of among those of its length.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 19:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

#: per tally: the counted table, the cell's key columns as read from a counted row, the counted
#: values, and the counted row's columns they read; `{r}` is the counted row (`new`/`old` in
#: SQLite, a transition table's row in Postgres)
TALLIES = {
    "state_tally": (
        "run_question",
        {"scope": "{r}.scope", "bucket": "coalesce({r}.bucket, -1)", "retired": "{r}.retired"},
        {"n": "1"},
        ("scope", "bucket", "retired"),
    ),
    "trajectory_tally": (
        "trajectory",
        {"pool_id": "{r}.pool_id", "run_id": "coalesce({r}.source_run_id, 0)"},
        {"n": "1", "tokens": "{r}.num_tokens"},
        ("pool_id", "source_run_id", "num_tokens"),
    ),
    "question_tally": ("question", {"pool_id": "{r}.pool_id"}, {"n": "1"}, ("pool_id",)),
}


def _create_tables() -> None:
    op.create_table(
        "state_tally",
        sa.Column("scope", sa.BigInteger(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("retired", sa.Boolean(), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_state_tally_cell", "state_tally", ["scope", "bucket", "retired"])
    op.create_table(
        "trajectory_tally",
        sa.Column("pool_id", sa.BigInteger(), nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_trajectory_tally_cell", "trajectory_tally", ["pool_id", "run_id"])
    op.create_table(
        "question_tally",
        sa.Column("pool_id", sa.BigInteger(), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_question_tally_cell", "question_tally", ["pool_id"])


def _backfill() -> None:
    for tally, (counted, keys, values, _) in TALLIES.items():
        key_exprs = [e.format(r=counted) for e in keys.values()]
        sums = [f"sum({e.format(r=counted)})" for e in values.values()]
        columns = ", ".join([*keys, *values])
        op.execute(
            f"INSERT INTO {tally} ({columns}) SELECT {', '.join(key_exprs + sums)} FROM {counted} "
            f"GROUP BY {', '.join(key_exprs)}"
        )


def _sqlite_bump(tally: str, row: str, sign: str) -> str:
    """SQLite: add a counted row (`new`, sign '') or take it away (`old`, '-') in its cell."""
    _, keys, values, _ = TALLIES[tally]
    match = " AND ".join(f"{k} = {e.format(r=row)}" for k, e in keys.items())
    adds = ", ".join(f"{v} = {v} + {sign}({e.format(r=row)})" for v, e in values.items())
    cols = ", ".join([*keys, *values])
    exprs = ", ".join(
        [e.format(r=row) for e in keys.values()] + [f"{sign}({e.format(r=row)})" for e in values.values()]
    )
    return (
        f"UPDATE {tally} SET {adds} WHERE {match}; "
        f"INSERT INTO {tally} ({cols}) SELECT {exprs} WHERE NOT EXISTS (SELECT 1 FROM {tally} WHERE {match});"
    )


def _sqlite_triggers() -> None:
    for tally, (counted, _, _, read) in TALLIES.items():
        moved = " OR ".join(f"old.{c} IS NOT new.{c}" for c in read)
        op.execute(
            f"CREATE TRIGGER {tally}_insert AFTER INSERT ON {counted} BEGIN "
            f"{_sqlite_bump(tally, 'new', '')} END"
        )
        op.execute(
            f"CREATE TRIGGER {tally}_delete AFTER DELETE ON {counted} BEGIN "
            f"{_sqlite_bump(tally, 'old', '-')} END"
        )
        op.execute(
            f"CREATE TRIGGER {tally}_update AFTER UPDATE OF {', '.join(read)} ON {counted} "
            f"WHEN {moved} BEGIN {_sqlite_bump(tally, 'old', '-')} {_sqlite_bump(tally, 'new', '')} END"
        )


def _cells(tally: str, rows: str, sign: str) -> str:
    """Postgres: the cells and counted values of a transition table's rows, negated with '-'."""
    _, keys, values, _ = TALLIES[tally]
    keyed = ", ".join(f"{e.format(r='c')} AS {k}" for k, e in keys.items())
    counted = ", ".join(f"{sign}{e.format(r='c')} AS {v}" for v, e in values.items())
    return f"SELECT {keyed}, {counted} FROM {rows} AS c"


def _postgres_triggers() -> None:
    for tally, (counted, keys, values, _) in TALLIES.items():
        cols = ", ".join([*keys, *values])
        group = ", ".join(str(i + 1) for i in range(len(keys)))
        sums = ", ".join(f"sum({v})" for v in values)
        nonzero = " OR ".join(f"sum({v}) <> 0" for v in values)
        op.execute(
            f"""
            CREATE FUNCTION {tally}_changed() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP = 'INSERT' THEN
                    INSERT INTO {tally} ({cols})
                    SELECT {", ".join(keys)}, {sums} FROM ({_cells(tally, "new_rows", "")}) AS d
                    GROUP BY {group};
                ELSIF TG_OP = 'DELETE' THEN
                    INSERT INTO {tally} ({cols})
                    SELECT {", ".join(keys)}, {sums} FROM ({_cells(tally, "old_rows", "-")}) AS d
                    GROUP BY {group};
                ELSE
                    INSERT INTO {tally} ({cols})
                    SELECT {", ".join(keys)}, {sums}
                    FROM ({_cells(tally, "new_rows", "")} UNION ALL {_cells(tally, "old_rows", "-")}) AS d
                    GROUP BY {group} HAVING {nonzero};
                END IF;
                RETURN NULL;
            END $$
            """
        )
        for event, refs in (
            ("INSERT", "NEW TABLE AS new_rows"),
            ("DELETE", "OLD TABLE AS old_rows"),
            ("UPDATE", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
        ):
            if (counted, event) == ("trajectory", "INSERT"):
                continue  # counted by the INSERT itself (`repo.insert_trajectories`)
            op.execute(
                f"CREATE TRIGGER {tally}_{event.lower()} AFTER {event} ON {counted} "
                f"REFERENCING {refs} FOR EACH STATEMENT EXECUTE FUNCTION {tally}_changed()"
            )


def upgrade() -> None:
    _create_tables()
    _backfill()
    op.create_index("ix_trajectory_pool_id", "trajectory", ["pool_id", "id"])
    op.drop_index("ix_trajectory_pool_tokens", table_name="trajectory")
    if op.get_bind().dialect.name == "postgresql":
        _postgres_triggers()
    else:
        _sqlite_triggers()


def downgrade() -> None:
    op.create_index("ix_trajectory_pool_tokens", "trajectory", ["pool_id", "num_tokens"])
    op.drop_index("ix_trajectory_pool_id", table_name="trajectory")
    postgres = op.get_bind().dialect.name == "postgresql"
    for tally, (counted, *_) in TALLIES.items():
        for event in ("insert", "delete", "update"):
            if postgres:
                op.execute(f"DROP TRIGGER IF EXISTS {tally}_{event} ON {counted}")
            else:
                op.execute(f"DROP TRIGGER IF EXISTS {tally}_{event}")
        if postgres:
            op.execute(f"DROP FUNCTION IF EXISTS {tally}_changed()")
        op.drop_table(tally)
