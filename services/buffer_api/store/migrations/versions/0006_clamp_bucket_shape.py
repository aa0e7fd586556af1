"""clamp stored bucket shapes

Pool configs now bound `sigma` to [1e-6, 1e6] and `mu` to [-1e6, 1e6], so every accepted config
gives finite, normalisable bucket weights. A pool stored before with a value outside those bounds
would no longer load: its value is clamped to the nearest bound (a value that is not a finite
number becomes the default: sigma 1.0, mu unset).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 16:00:00.000000
"""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

BOUNDS = {"sigma": (1e-6, 1e6, 1.0), "mu": (-1e6, 1e6, None)}
"""Field -> (lowest, highest, what a non-finite value becomes)."""


def clamp_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with `sigma` and `mu` inside their bounds (other keys untouched)."""
    out = dict(config)
    for key, (low, high, fallback) in BOUNDS.items():
        value = out.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key] = min(max(float(value), low), high) if math.isfinite(value) else fallback
    return out


def upgrade() -> None:
    conn = op.get_bind()
    json_type = sa.JSON().with_variant(JSONB(), "postgresql")
    pool = sa.table("pool", sa.column("id", sa.Integer), sa.column("config", json_type))
    for pid, config in conn.execute(sa.select(pool.c.id, pool.c.config)).all():
        fixed = clamp_config(config)
        if fixed != config:
            conn.execute(sa.update(pool).where(pool.c.id == pid).values(config=fixed))


def downgrade() -> None:
    """Nothing to undo: clamped values are valid for the older code too."""
