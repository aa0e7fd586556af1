"""the pool's trajectory index carries the token count

A pool's token total (pool stats, and the `max_payload_bytes` check of every write when that limit
is set) summed `num_tokens` over the pool's trajectory rows, reading every row, and a trajectory
row's pages hold its payload: 49 ms for 10k trajectories on SQLite, growing with the pool. With
`num_tokens` in the index beside `pool_id`, the total and the count are read from the index alone.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 17:50:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_trajectory_pool_tokens", "trajectory", ["pool_id", "num_tokens"])
    op.drop_index("ix_trajectory_pool", table_name="trajectory")


def downgrade() -> None:
    op.create_index("ix_trajectory_pool", "trajectory", ["pool_id"])
    op.drop_index("ix_trajectory_pool_tokens", table_name="trajectory")
