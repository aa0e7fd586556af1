"""Answers the SDK returns that are not part of the shared wire contract in `schemas.py`.

These are tolerant (unknown fields are kept, not refused): the endpoints behind them answer with
small ad-hoc JSON objects, and an older client should keep working against a newer service.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from exgrpo_client.schemas import ExportHeader


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow")


class Health(_Tolerant):
    """`GET /healthz`: the process is up."""

    status: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Readiness(_Tolerant):
    """`GET /readyz`: the database and the sampling index answer."""

    status: str
    checks: dict[str, str] = {}

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class PoolImported(_Tolerant):
    """`POST /v1/pools/import`: what a pool import created."""

    pool: str
    questions: int
    runs: int
    states: int
    trajectories: int
    duplicates: int


class PoolExported(BaseModel):
    """What `export_pool` wrote: the export's header line and the size of the stream."""

    header: ExportHeader
    num_bytes: int
    path: str | None = None
