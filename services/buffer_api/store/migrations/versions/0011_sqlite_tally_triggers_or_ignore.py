"""SQLite: the tallies' trigger statements as UPDATE OR IGNORE / INSERT OR IGNORE

A statement that may fail halfway (ABORT, SQLite's default conflict resolution) inside a
transaction needs a statement journal, so that its own changes can be undone alone; a row
trigger with an UPDATE or INSERT makes every statement on the counted table such a statement.
SQLite keeps that journal in a temporary file past 64 KiB and copies into it the original of
every page the statement changes: a commit's trajectories (their payloads on overflow pages)
went through it page by page. Deleting 340 trajectories of 1k tokens took 12 ms with the
triggers against 6.5 ms without them; with OR IGNORE, 7.9 ms (`bench/tally_bench.py
--evicted`). No tally statement can fail a constraint (no unique keys, no NULLs: a cell's
bucket is coalesced), so IGNORE changes no count, only the journal.

Postgres is unchanged. The triggers' statements are rewritten from their stored SQL.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 22:10:00.000000
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

#: a trigger body's tally statements (the header's `AFTER UPDATE OF` does not match), each as
#: (plain, with IGNORE)
_STATEMENTS = (
    ("UPDATE {} SET ", "UPDATE OR IGNORE {} SET "),
    ("INSERT INTO {} ", "INSERT OR IGNORE INTO {} "),
)
_TRIGGERS = (
    "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND name LIKE '%!_tally!_%' ESCAPE '!'"
)


def _rewrite(to_ignore: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for name, sql in list(op.get_bind().execute(sa.text(_TRIGGERS))):
        new = sql
        for plain, ignoring in _STATEMENTS:
            old, replacement = (plain, ignoring) if to_ignore else (ignoring, plain)
            pattern = r"\b" + re.escape(old).replace(re.escape("{}"), r"(\w+_tally)")
            new = re.sub(pattern, replacement.replace("{}", r"\1"), new)
        op.execute(f"DROP TRIGGER {name}")
        op.execute(new)


def upgrade() -> None:
    _rewrite(to_ignore=True)


def downgrade() -> None:
    _rewrite(to_ignore=False)
