"""scopes per pool and trajectory scopes

A pooled pool's shared state moves from scope 0 (which every pooled pool shared) to its own scope,
-pool id. Trajectories get a scope: in `per_run` pools the run that collected them, elsewhere the
pool's shared scope; de-duplication is per scope.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 12:00:00.000000
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table("trajectory") as b:
        b.add_column(sa.Column("scope", sa.BigInteger(), nullable=True))
    bind.execute(sa.text("UPDATE run_question SET scope = -pool_id WHERE scope = 0"))
    for pool_id, config in bind.execute(sa.text("SELECT id, config FROM pool")).all():
        cfg = json.loads(config) if isinstance(config, str) else (config or {})
        if cfg.get("sharing", "per_run") == "per_run":
            bind.execute(
                sa.text(
                    "UPDATE trajectory SET scope = source_run_id "
                    "WHERE pool_id = :p AND source_run_id IS NOT NULL"
                ),
                {"p": pool_id},
            )
    bind.execute(sa.text("UPDATE trajectory SET scope = -pool_id WHERE scope IS NULL"))
    with op.batch_alter_table("trajectory") as b:
        b.alter_column("scope", existing_type=sa.BigInteger(), nullable=False)
        b.drop_constraint("uq_trajectory_dedup", type_="unique")
        b.create_unique_constraint("uq_trajectory_scope_dedup", ["question_id", "scope", "dedup_key"])


def downgrade() -> None:
    bind = op.get_bind()
    # one trajectory per (question, token ids) again: keep the oldest copy
    bind.execute(
        sa.text(
            "DELETE FROM trajectory WHERE id NOT IN "
            "(SELECT MIN(id) FROM trajectory GROUP BY question_id, dedup_key)"
        )
    )
    with op.batch_alter_table("trajectory") as b:
        b.drop_constraint("uq_trajectory_scope_dedup", type_="unique")
        b.create_unique_constraint("uq_trajectory_dedup", ["question_id", "dedup_key"])
        b.drop_column("scope")
    bind.execute(sa.text("UPDATE run_question SET scope = 0 WHERE scope < 0"))
