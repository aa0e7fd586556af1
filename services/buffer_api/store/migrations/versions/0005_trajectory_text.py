"""trajectory text

A stored trajectory may keep its response text as its producer decoded it (the trainer sends it
with each collected rollout), so people can read it without the run's tokenizer. Trajectories
stored before have none.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 14:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trajectory") as batch:
        batch.add_column(sa.Column("text", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trajectory") as batch:
        batch.drop_column("text")
