"""task generation settings

A generation task says how it must be generated: `sampling` (the trainer's sampling settings, JSON;
none: the worker's own), `policy_exact` (generate with exactly `policy_version`, or with any
published version at least as new) and `generated_version` (the version the worker reported when
it completed the task). Tasks queued before are exact tasks of their version, with no settings and
no reported version.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 17:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("task") as batch:
        batch.add_column(
            sa.Column(
                "sampling",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=True,
            )
        )
        batch.add_column(sa.Column("policy_exact", sa.Boolean(), nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column("generated_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("task") as batch:
        batch.drop_column("generated_version")
        batch.drop_column("policy_exact")
        batch.drop_column("sampling")
