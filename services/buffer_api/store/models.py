"""Tables of the experience pool (SQLAlchemy 2 typed ORM). Postgres is the source of truth.

Token ids and log-probs are stored as packed little-endian arrays (int32 / float32) in binary
columns: a 4k-token trajectory costs 32 KB instead of ~60 KB of JSON text.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from exgrpo_client.schemas import BatchStatus, Phase, PoolConfig, RunOverrides, TaskStatus

# SQLite only auto-increments an INTEGER PRIMARY KEY; Postgres gets a real BIGINT identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")
Blob = LargeBinary().with_variant(BYTEA(), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on both backends (SQLite hands back naive datetimes)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value

    def result_processor(self, dialect: Any, coltype: Any) -> Any:
        if dialect.name == "postgresql":
            # a timestamptz comes back aware: no Python call per value (the driver's processor, if any)
            return self.impl_instance.result_processor(dialect, coltype)
        return super().result_processor(dialect, coltype)


def pool_scope(pool_id: int) -> int:
    """The scope shared by the runs of one pool (run scopes are run ids, > 0)."""
    return -pool_id


def is_pool_scope(scope: int) -> bool:
    return scope < 0


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Pool(Base):
    __tablename__ = "pool"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")
    config: Mapped[dict[str, Any]] = mapped_column(Json)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Question(Base):
    __tablename__ = "question"
    __table_args__ = (
        UniqueConstraint("pool_id", "content_hash", name="uq_question_pool_hash"),
        Index("ix_question_pool_id", "pool_id", "id"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pool.id", ondelete="CASCADE"))
    content_hash: Mapped[bytes] = mapped_column(Blob)
    prompt: Mapped[list[dict[str, Any]]] = mapped_column(Json)
    ground_truth: Mapped[str] = mapped_column(Text)
    data_source: Mapped[str] = mapped_column(String(256), default="")
    external_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", Json, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Run(Base):
    __tablename__ = "run"
    __table_args__ = (UniqueConstraint("pool_id", "name", name="uq_run_pool_name"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pool.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    seed: Mapped[int] = mapped_column(BigInteger, default=0)
    phase: Mapped[Phase] = mapped_column(String(16), default="on_policy")
    switched_at_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    step: Mapped[int] = mapped_column(Integer, default=0)
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    epoch: Mapped[int] = mapped_column(Integer, default=-1)
    cursor: Mapped[int] = mapped_column(Integer, default=0)
    overrides: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RunLease(Base):
    """The writer lease of a run: who may write (holder) and its fencing generation. The row
    outlives a release or an expiry so the next holder gets the next generation."""

    __tablename__ = "run_lease"
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    generation: Mapped[int] = mapped_column(Integer)
    ttl_s: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RunEpoch(Base):
    """The shuffled fresh-question order of a run's current epoch (packed int64 ids)."""

    __tablename__ = "run_epoch"
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    order: Mapped[bytes] = mapped_column(Blob)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RunQuestion(Base):
    """One run's view of one question (scope = run id, or `pool_scope(pool id)` for pooled pools)."""

    __tablename__ = "run_question"
    __table_args__ = (
        Index("ix_run_question_bucket", "scope", "retired", "bucket"),
        # a deleted question's states (its foreign key's cascade) found without reading them all
        Index("ix_run_question_question", "question_id"),
    )
    scope: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    question_id: Mapped[int] = mapped_column(ForeignKey("question.id", ondelete="CASCADE"), primary_key=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pool.id", ondelete="CASCADE"))
    last_k: Mapped[int] = mapped_column(Integer)
    bucket: Mapped[int | None] = mapped_column(Integer, nullable=True)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    last_step: Mapped[int] = mapped_column(Integer, default=0)
    last_run_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


#: a column default of 0 in the schema (a name: `Trajectory.text` hides `text` in its class)
_ZERO = text("0")


class Trajectory(Base):
    """A stored correct rollout. `scope` owns it: the run id (sharing `per_run`) or the pool's
    shared scope `pool_scope(pool id)`; replay and de-duplication stay inside the scope."""

    __tablename__ = "trajectory"
    __table_args__ = (
        UniqueConstraint("question_id", "scope", "dedup_key", name="uq_trajectory_scope_dedup"),
        Index("ix_trajectory_run_created", "source_run_id", "created_at"),
        Index("ix_trajectory_pool_id", "pool_id", "id"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    question_id: Mapped[int] = mapped_column(ForeignKey("question.id", ondelete="CASCADE"))
    pool_id: Mapped[int] = mapped_column(ForeignKey("pool.id", ondelete="CASCADE"))
    scope: Mapped[int] = mapped_column(BigInteger)
    source_run_id: Mapped[int | None] = mapped_column(
        ForeignKey("run.id", ondelete="SET NULL"), nullable=True
    )
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=0)
    token_ids: Mapped[bytes] = mapped_column(Blob)
    logprobs: Mapped[bytes] = mapped_column(Blob)
    num_tokens: Mapped[int] = mapped_column(Integer)
    reward: Mapped[float] = mapped_column(Float)
    entropy: Mapped[float | None] = mapped_column(Float, nullable=True)
    dedup_key: Mapped[bytes] = mapped_column(Blob)
    text: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The response as text, when its producer sent it (for people to read; never replayed)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    period: Mapped[int] = mapped_column(BigInteger, default=0, server_default=_ZERO)
    """The trajectory tally's period of `created_at` (`repo.tally_period`: ten seconds from the
    epoch), written with the row so that the tally's triggers read it as a plain value (migration
    0015); 0 for rows stored long before that migration."""


class Batch(Base):
    __tablename__ = "batch"
    __table_args__ = (Index("ix_batch_run_step", "run_id", "step"),)
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    status: Mapped[BatchStatus] = mapped_column(String(16), default="planned")
    phase: Mapped[Phase] = mapped_column(String(16))
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    plan: Mapped[dict[str, Any]] = mapped_column(Json)
    result: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    committed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Task(Base):
    __tablename__ = "task"
    __table_args__ = (
        Index("ix_task_run_status", "run_id", "status", "id"),
        Index("ix_task_batch", "batch_id"),
        Index("ix_task_question", "question_id"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batch.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"))
    question_id: Mapped[int] = mapped_column(ForeignKey("question.id", ondelete="CASCADE"))
    num_samples: Mapped[int] = mapped_column(Integer)
    replayed: Mapped[bool] = mapped_column(Boolean, default=False)
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    """Exact tasks: the version to generate with; otherwise the oldest version allowed."""
    policy_exact: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    sampling: Mapped[dict[str, Any] | None] = mapped_column(Json, nullable=True)
    """The sampling settings the plan asked for (None: the worker's own)."""
    generated_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The version the worker said it generated with (None: it did not say, or not completed)."""
    status: Mapped[TaskStatus] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    lease_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    result: Mapped[list[dict[str, Any]] | None] = mapped_column(Json, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class PolicyVersion(Base):
    __tablename__ = "policy_version"
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    step: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class RunMetric(Base):
    """One step's numbers of a run: what the trainer commits and posts (curves for the dashboard)."""

    __tablename__ = "run_metric"
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(Json)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class IdempotencyKey(Base):
    __tablename__ = "idempotency_key"
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    principal: Mapped[str] = mapped_column(String(255), primary_key=True)
    route: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int] = mapped_column(Integer)
    response: Mapped[Any] = mapped_column(Json)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


# ------------------------------------------------------------------------ plain rows (hot path)
# The per-request rows of plan, commit, ingest and select, read with Core statements and written
# back with explicit UPDATEs: no ORM identity map, flush or refresh on the hot path. Their fields
# are named and typed like the mapped classes', so the code that reads them takes either.


# Tallies: how many rows the pool's large tables hold, per pool, run and scope, kept by triggers
# on those tables (migration 0010), so that stats read a handful of rows instead of counting the
# pool. A cell's count is the sum of its rows: SQLite keeps one row per cell, Postgres adds a row
# per statement that changed the cell (no writer waits on another's count) and folds them
# (`repo.fold_tallies`, after writes). `bucket` -1: no bucket; `run_id` 0: no source run.
state_tally = Table(
    "state_tally",
    Base.metadata,
    Column("scope", BigInteger, nullable=False),
    Column("bucket", Integer, nullable=False),
    Column("retired", Boolean, nullable=False),
    Column("n", BigInteger, nullable=False),
    Index("ix_state_tally_cell", "scope", "bucket", "retired"),
)
trajectory_tally = Table(
    "trajectory_tally",
    Base.metadata,
    Column("pool_id", BigInteger, nullable=False),
    Column("run_id", BigInteger, nullable=False),
    # the ten seconds of `created_at` its trajectories were made in (`trajectory.period`), 0 for
    # periods folded as long past (`repo.fold_tallies`, migrations 0014 and 0015)
    Column("period", BigInteger, nullable=False, server_default=text("0")),
    Column("n", BigInteger, nullable=False),
    Column("tokens", BigInteger, nullable=False),
    Index("ix_trajectory_tally_cell", "pool_id", "run_id", "period"),
)
question_tally = Table(
    "question_tally",
    Base.metadata,
    Column("pool_id", BigInteger, nullable=False),
    Column("n", BigInteger, nullable=False),
    Index("ix_question_tally_cell", "pool_id"),
)


@dataclass(slots=True)
class PoolRow:
    id: int
    name: str
    #: the config's JSON text as stored (Postgres: `jsonb::text`), validated by `convert.pool_config`
    config: str
    #: `config` as validated (by `convert.pool_config`: shared by every row of the same text)
    parsed: PoolConfig | None = None


@dataclass(slots=True)
class RunRow:
    id: int
    pool_id: int
    name: str
    seed: int
    phase: Phase
    switched_at_step: int | None
    step: int
    policy_version: int
    epoch: int
    cursor: int
    #: the overrides' JSON text as stored (Postgres: `jsonb::text`), validated by `convert.run_overrides`
    overrides: str
    created_at: datetime
    updated_at: datetime
    #: `overrides` as validated (by `convert.run_overrides`: shared by every row of the same text)
    parsed: RunOverrides | None = None


@dataclass(slots=True)
class LeaseRow:
    holder: str
    generation: int
    ttl_s: float
    expires_at: datetime


@dataclass(slots=True)
class BatchRow:
    id: str
    run_id: int
    step: int
    status: BatchStatus
    phase: Phase
    policy_version: int
    plan: dict[str, Any]
    result: dict[str, Any] | None
    created_at: datetime


#: a question of a page (`repo.question_page`): id, prompt, ground truth, data source, external
#: id, metadata and creation time, each as SQLAlchemy gives it, but on Postgres the prompt and the
#: metadata as their JSON text, to be written into the answer as they are (`orjson.Fragment`)
PageRow = tuple[int, Any, str, str, str | None, Any, datetime]

AnyPool = Pool | PoolRow
AnyRun = Run | RunRow
AnyLease = RunLease | LeaseRow
AnyBatch = Batch | BatchRow
