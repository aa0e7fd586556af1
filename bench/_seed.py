"""Seeded pools for `pool_bench.py`, written straight into the database (not through the API).

The shape of a pool of N questions (see `Shape`):

* N questions (a ~150-700 character chat prompt each), all in the pool;
* one run ``r1`` in the mixed phase, in its second epoch at cursor 0, that has seen 20% of them:
  10% of N are eligible (bucketed in 1..7 out of K = 8), 3% retired and 7% seen with 0 correct;
* 5 stored trajectories per eligible question on average (1 + Poisson(4)), each 512-1536 tokens
  (1024 on average) of int32 ids + float32 log-probs, i.e. ~8 KB of payload per trajectory.

So 1M questions hold 100k eligible questions and ~500k trajectories (~4 GB of payload). Seeded
databases are cached (Postgres: database ``exgrpo_bench_seed_<N>``; SQLite: a file under
``bench/out/cache``) and copied for every measurement, so a measurement never changes the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import asyncpg
import numpy as np

from exgrpo_client import schemas as s
from exgrpo_pool.config import Settings
from exgrpo_pool.domain import epoch_order, trajectory_key
from exgrpo_pool.service.convert import content_hash
from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo

SEED_FORMAT = 2
RUN_ID = 1
POOL_ID = 1
POOL_NAME = "bench"
RUN_NAME = "r1"
RUN_SEED = 1
VOCAB = 151_000
BASE_TIME = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Shape:
    questions: int
    eligible_frac: float = 0.10
    retired_frac: float = 0.03
    unsolved_frac: float = 0.07
    extra_traj_mean: float = 4.0  # trajectories per eligible question = 1 + Poisson(this), at most 12
    tokens_min: int = 512
    tokens_max: int = 1536
    bucket_weights: tuple[float, ...] = (0.20, 0.17, 0.15, 0.14, 0.12, 0.11, 0.11)  # buckets 1..7
    k: int = 8
    batch_size: int = 128
    experience_ratio: float = 0.5

    @property
    def eligible(self) -> int:
        return round(self.questions * self.eligible_frac)

    @property
    def retired(self) -> int:
        return round(self.questions * self.retired_frac)

    @property
    def unsolved(self) -> int:
        return round(self.questions * self.unsolved_frac)

    @property
    def seen(self) -> int:
        return self.eligible + self.retired + self.unsolved

    @property
    def step(self) -> int:
        return max(1, math.ceil(self.seen / self.batch_size))

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "eligible": self.eligible, "retired": self.retired, "seen": self.seen}


@dataclass
class Layout:
    """The deterministic content of a seeded pool (everything but the trajectory payloads)."""

    shape: Shape
    eligible: np.ndarray
    buckets: np.ndarray
    retired: np.ndarray
    unsolved: np.ndarray
    traj_qids: np.ndarray  # question of each trajectory, in insertion (= id) order
    traj_steps: np.ndarray
    order: np.ndarray  # epoch 1 order of the run
    stats: dict[str, Any] = field(default_factory=dict)


def layout(shape: Shape) -> Layout:
    rng = np.random.default_rng([SEED_FORMAT, shape.questions, 1])
    ids = rng.permutation(shape.questions).astype(np.int64) + 1
    e, r, u = shape.eligible, shape.retired, shape.unsolved
    eligible, retired, unsolved = ids[:e], ids[e : e + r], ids[e + r : e + r + u]
    weights = np.asarray(shape.bucket_weights) / sum(shape.bucket_weights)
    buckets = rng.choice(np.arange(1, 8), size=e, p=weights)
    counts = np.minimum(1 + rng.poisson(shape.extra_traj_mean, size=e), 12)
    traj_qids = rng.permutation(np.repeat(eligible, counts))
    traj_steps = np.sort(rng.integers(1, shape.step + 1, size=traj_qids.size))
    active = np.setdiff1d(np.arange(1, shape.questions + 1, dtype=np.int64), retired)
    order = epoch_order(active, seed=RUN_SEED, epoch=1)
    out = Layout(shape, eligible, buckets, retired, unsolved, traj_qids, traj_steps, order)
    out.stats = {
        "questions": shape.questions,
        "eligible": int(e),
        "retired": int(r),
        "trajectories": int(traj_qids.size),
        "payload_gb_approx": round(traj_qids.size * (shape.tokens_min + shape.tokens_max) / 2 * 8 / 1e9, 2),
    }
    return out


def cache_tag(shape: Shape) -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(dbmod.alembic_config("sqlite://")).get_current_head()
    return f"bench-seed format={SEED_FORMAT} schema={head} " + json.dumps(asdict(shape), sort_keys=True)


# ------------------------------------------------------------------------------------ rows
_TEXT = (
    "let x be a positive integer such that the sum of its digits equals the product of two primes "
    "find the number of ordered pairs of real numbers satisfying the system of equations below "
    "a triangle has sides of length and its circumcircle has radius compute the area of the region "
    "bounded by the parabola and the line express your answer as a common fraction in lowest terms "
    "the probability that a randomly chosen divisor of is a perfect square can be written as m over n"
)
_WORDS = _TEXT.split(" ")
_FILLER = " ".join(_WORDS[(i * 7) % len(_WORDS)] for i in range(2000))


def question_rows(shape: Shape, start: int, stop: int) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng([SEED_FORMAT, shape.questions, 2, start])
    lengths = rng.integers(150, 700, size=stop - start)
    offsets = rng.integers(0, len(_FILLER) - 700, size=stop - start)
    created = BASE_TIME
    for i, qid in enumerate(range(start, stop)):
        body = _FILLER[offsets[i] : offsets[i] + lengths[i]]
        text = f"Problem {qid}: {body}. Put the answer in \\boxed{{}}."
        prompt = [{"role": "user", "content": text}]
        truth = str((qid * 7919) % 100_003)
        yield {
            "id": qid,
            "pool_id": POOL_ID,
            "content_hash": content_hash(prompt, truth),
            "prompt": prompt,
            "ground_truth": truth,
            "data_source": "bench/math",
            "external_id": None,
            "metadata": {},
            "created_at": created,
        }


def state_rows(lay: Layout) -> list[dict[str, Any]]:
    shape = lay.shape
    rng = np.random.default_rng([SEED_FORMAT, shape.questions, 3])
    rows = []
    groups = (
        (lay.eligible, lay.buckets, False),
        (lay.retired, np.full(lay.retired.size, shape.k), True),
        (lay.unsolved, np.zeros(lay.unsolved.size, dtype=np.int64), False),
    )
    for qids, ks, retired in groups:
        steps = rng.integers(1, shape.step + 1, size=qids.size)
        for qid, k, step in zip(qids.tolist(), ks.tolist(), steps.tolist(), strict=True):
            rows.append(
                {
                    "scope": RUN_ID,
                    "question_id": qid,
                    "pool_id": POOL_ID,
                    "last_k": k,
                    "bucket": None if retired or k == 0 else k,
                    "retired": retired,
                    "last_step": step,
                    "last_run_id": RUN_ID,
                    "updated_at": BASE_TIME + timedelta(seconds=30 * step),
                }
            )
    rows.sort(key=lambda r: r["question_id"])
    return rows


def trajectory_rows(lay: Layout, chunk: int = 2000) -> Iterator[list[dict[str, Any]]]:
    shape = lay.shape
    total = lay.traj_qids.size
    for start in range(0, total, chunk):
        stop = min(total, start + chunk)
        rng = np.random.default_rng([SEED_FORMAT, shape.questions, 4, start])
        n = stop - start
        lengths = rng.integers(shape.tokens_min, shape.tokens_max + 1, size=n)
        ends = np.cumsum(lengths)
        ids = rng.integers(0, VOCAB, size=int(ends[-1]), dtype=np.int32).astype("<i4")
        lps = (-rng.exponential(0.6, size=int(ends[-1]))).astype("<f4")
        entropy = rng.uniform(0.05, 1.5, size=n)
        rows = []
        for j in range(n):
            a, b = int(ends[j] - lengths[j]), int(ends[j])
            raw = ids[a:b].tobytes()
            step = int(lay.traj_steps[start + j])
            rows.append(
                {
                    "id": start + j + 1,
                    "question_id": int(lay.traj_qids[start + j]),
                    "pool_id": POOL_ID,
                    "scope": RUN_ID,  # a per_run pool: the run owns its trajectories
                    "source_run_id": RUN_ID,
                    "policy_version": step // 4,
                    "step": step,
                    "token_ids": raw,
                    "logprobs": lps[a:b].tobytes(),
                    "num_tokens": b - a,
                    "reward": 1.0,
                    "entropy": float(entropy[j]),
                    "dedup_key": trajectory_key(raw),
                    "created_at": BASE_TIME + timedelta(seconds=30 * step),
                }
            )
        yield rows


def pool_row(shape: Shape, tag: str) -> dict[str, Any]:
    config = s.PoolConfig(
        k=shape.k, batch_size=shape.batch_size, experience_ratio=shape.experience_ratio
    ).model_dump()
    return {
        "id": POOL_ID,
        "name": POOL_NAME,
        "description": tag,
        "config": config,
        "created_at": BASE_TIME,
        "updated_at": BASE_TIME,
    }


def run_row(shape: Shape) -> dict[str, Any]:
    return {
        "id": RUN_ID,
        "pool_id": POOL_ID,
        "name": RUN_NAME,
        "seed": RUN_SEED,
        "phase": "mixed",
        "switched_at_step": 1,
        "step": shape.step,
        "policy_version": shape.step // 4,
        "epoch": 1,
        "cursor": 0,
        "overrides": s.RunOverrides().model_dump(),
        "created_at": BASE_TIME,
        "updated_at": BASE_TIME + timedelta(seconds=30 * shape.step),
    }


# ----------------------------------------------------------------------------------- SQLite
def seed_sqlite(shape: Shape, path: Path, log: Any = print) -> float:
    """Write the seeded pool to `path` (atomically: a temporary file renamed at the end)."""
    from sqlalchemy import create_engine, event, insert

    from exgrpo_pool.store.models import Pool, Question, Run, RunEpoch, RunQuestion, Trajectory

    t0 = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        p.unlink(missing_ok=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    dbmod.upgrade(f"sqlite+aiosqlite:///{tmp}")
    lay = layout(shape)
    engine = create_engine(f"sqlite:///{tmp}")

    @event.listens_for(engine, "connect")
    def _fast(conn: Any, _rec: Any) -> None:
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("PRAGMA cache_size=-262144")

    tag = cache_tag(shape)
    with engine.begin() as conn:
        conn.execute(insert(Pool.__table__), [{**pool_row(shape, "seeding")}])
        conn.execute(insert(Run.__table__), [run_row(shape)])
        conn.execute(
            insert(RunEpoch.__table__),
            [
                {
                    "run_id": RUN_ID,
                    "epoch": 1,
                    "order": lay.order.astype("<i8").tobytes(),
                    "created_at": BASE_TIME,
                }
            ],
        )
    step = 50_000
    for start in range(1, shape.questions + 1, step):
        with engine.begin() as conn:
            conn.execute(
                insert(Question.__table__),
                list(question_rows(shape, start, min(shape.questions + 1, start + step))),
            )
    log(f"  sqlite {shape.questions}: questions done ({time.perf_counter() - t0:.0f}s)")
    with engine.begin() as conn:
        conn.execute(insert(RunQuestion.__table__), state_rows(lay))
    done = 0
    for rows in trajectory_rows(lay):
        with engine.begin() as conn:
            conn.execute(insert(Trajectory.__table__), rows)
        done += len(rows)
        if done % 100_000 < len(rows):
            secs = time.perf_counter() - t0
            log(f"  sqlite {shape.questions}: {done}/{lay.traj_qids.size} trajectories ({secs:.0f}s)")
    with engine.begin() as conn:
        conn.exec_driver_sql(repo.tally_trajectories())  # not counted by a trigger (migration 0013)
        conn.exec_driver_sql("UPDATE pool SET description = ?", (tag,))
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=DELETE")
    engine.dispose()
    os.replace(tmp, path)
    return time.perf_counter() - t0


def sqlite_cache_ok(shape: Shape, path: Path) -> bool:
    import sqlite3

    if not path.exists():
        return False
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            row = conn.execute("SELECT description FROM pool WHERE id = ?", (POOL_ID,)).fetchone()
    except sqlite3.Error:
        return False
    return row is not None and row[0] == cache_tag(shape)


def copy_sqlite(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    for p in (dst, Path(f"{dst}-wal"), Path(f"{dst}-shm")):
        p.unlink(missing_ok=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------- Postgres
_PG_TABLES: dict[str, list[str]] = {
    "question": [
        "id", "pool_id", "content_hash", "prompt", "ground_truth", "data_source", "external_id",
        "metadata", "created_at",
    ],
    "run_question": [
        "scope", "question_id", "pool_id", "last_k", "bucket", "retired", "last_step", "last_run_id",
        "updated_at",
    ],
    "trajectory": [
        "id", "question_id", "pool_id", "scope", "source_run_id", "policy_version", "step", "token_ids",
        "logprobs", "num_tokens", "reward", "entropy", "dedup_key", "created_at",
    ],
}  # fmt: skip


def _pg_record(table: str, row: dict[str, Any]) -> tuple[Any, ...]:
    out = []
    for col in _PG_TABLES[table]:
        v = row[col]
        out.append(json.dumps(v) if col in ("prompt", "metadata") else v)
    return tuple(out)


def pg_url(dsn: str, database: str, *, driver: bool = False) -> str:
    base = dsn.rstrip("/")
    url = f"{base}/{database}"
    return url.replace("postgresql://", "postgresql+asyncpg://", 1) if driver else url


async def pg_admin(dsn: str, *sql: str) -> None:
    conn = await asyncpg.connect(pg_url(dsn, "postgres"))
    try:
        for stmt in sql:
            await conn.execute(stmt)
    finally:
        await conn.close()


async def pg_exists(dsn: str, database: str) -> bool:
    conn = await asyncpg.connect(pg_url(dsn, "postgres"))
    try:
        return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database))
    finally:
        await conn.close()


async def pg_cache_ok(shape: Shape, dsn: str, database: str) -> bool:
    if not await pg_exists(dsn, database):
        return False
    conn = await asyncpg.connect(pg_url(dsn, database))
    try:
        desc = await conn.fetchval("SELECT description FROM pool WHERE id = $1", POOL_ID)
    except asyncpg.PostgresError:
        return False
    finally:
        await conn.close()
    return desc == cache_tag(shape)


async def seed_postgres(shape: Shape, dsn: str, database: str, log: Any = print) -> float:
    """Create `database` holding the seeded pool (built under a temporary name, renamed at the end)."""
    t0 = time.perf_counter()
    tmp = f"{database}_tmp"
    await pg_admin(dsn, f"DROP DATABASE IF EXISTS {tmp} WITH (FORCE)", f"CREATE DATABASE {tmp}")
    await asyncio.to_thread(dbmod.upgrade, pg_url(dsn, tmp, driver=True))
    lay = layout(shape)
    conn = await asyncpg.connect(pg_url(dsn, tmp))
    try:
        await conn.execute("SET synchronous_commit = off")
        p = pool_row(shape, "seeding")
        await conn.execute(
            "INSERT INTO pool (id, name, description, config, created_at, updated_at) "
            "VALUES ($1, $2, $3, $4::jsonb, $5, $6)",
            p["id"], p["name"], p["description"], json.dumps(p["config"]), p["created_at"], p["updated_at"],
        )  # fmt: skip
        r = run_row(shape)
        cols = list(r)
        marks = [f"${i + 1}" + ("::jsonb" if c == "overrides" else "") for i, c in enumerate(cols)]
        await conn.execute(
            f"INSERT INTO run ({', '.join(cols)}) VALUES ({', '.join(marks)})",
            *[json.dumps(r[c]) if c == "overrides" else r[c] for c in cols],
        )
        await conn.execute(
            'INSERT INTO run_epoch (run_id, epoch, "order", created_at) VALUES ($1, $2, $3, $4)',
            RUN_ID, 1, lay.order.astype("<i8").tobytes(), BASE_TIME,
        )  # fmt: skip
        step = 50_000
        for start in range(1, shape.questions + 1, step):
            rows = question_rows(shape, start, min(shape.questions + 1, start + step))
            await conn.copy_records_to_table(
                "question", records=[_pg_record("question", q) for q in rows], columns=_PG_TABLES["question"]
            )
        log(f"  postgres {shape.questions}: questions done ({time.perf_counter() - t0:.0f}s)")
        await conn.copy_records_to_table(
            "run_question",
            records=[_pg_record("run_question", q) for q in state_rows(lay)],
            columns=_PG_TABLES["run_question"],
        )
        done = 0
        for rows in trajectory_rows(lay):
            await conn.copy_records_to_table(
                "trajectory",
                records=[_pg_record("trajectory", t) for t in rows],
                columns=_PG_TABLES["trajectory"],
            )
            done += len(rows)
            if done % 100_000 < len(rows):
                log(
                    f"  postgres {shape.questions}: {done}/{lay.traj_qids.size} trajectories "
                    f"({time.perf_counter() - t0:.0f}s)"
                )
        await conn.execute(repo.tally_trajectories())  # a COPY is not counted by a trigger
        for table in ("pool", "question", "run", "trajectory"):
            await conn.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))"
            )
        await conn.execute("UPDATE pool SET description = $1", cache_tag(shape))
        await conn.execute("VACUUM ANALYZE")
    finally:
        await conn.close()
    await pg_admin(
        dsn, f"DROP DATABASE IF EXISTS {database} WITH (FORCE)", f"ALTER DATABASE {tmp} RENAME TO {database}"
    )
    return time.perf_counter() - t0


async def copy_postgres(dsn: str, template: str, database: str) -> float:
    t0 = time.perf_counter()
    await pg_admin(
        dsn,
        f"DROP DATABASE IF EXISTS {database} WITH (FORCE)",
        f"CREATE DATABASE {database} TEMPLATE {template} STRATEGY FILE_COPY",
    )
    return time.perf_counter() - t0


def warm_sqlite(path: Path, chunk: int = 1 << 24) -> float:
    """Read a copy's file once, so that its pages are in the OS's page cache as a pool's in use
    are (the seconds it took)."""
    t0 = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while f.read(chunk):
            pass
    return time.perf_counter() - t0


async def warm_postgres(dsn: str, database: str) -> float:
    """Read every table, index and TOAST relation of a copy once (`pg_prewarm` in `read` mode: into
    the OS's page cache, not Postgres's buffers), so that it is read as a pool's in use is; without
    the extension, every trajectory's payload is read by a scan (the seconds it took)."""
    t0 = time.perf_counter()
    conn = await asyncpg.connect(pg_url(dsn, database))
    try:
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
        except asyncpg.PostgresError:
            await conn.fetchval("SELECT sum(get_byte(token_ids, 0) + get_byte(logprobs, 0)) FROM trajectory")
        else:
            await conn.fetchval(
                "SELECT sum(pg_prewarm(c.oid, 'read')) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE c.relkind IN ('r', 'i', 't') AND n.nspname IN ('public', 'pg_toast') "
                "AND pg_relation_filenode(c.oid) IS NOT NULL"
            )
    finally:
        await conn.close()
    return time.perf_counter() - t0


def uncache_file(path: Path) -> bool:
    """Drop a file's clean pages from the OS's page cache (`posix_fadvise` DONTNEED): whether it
    could."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


async def uncache_postgres(dsn: str, database: str) -> int:
    """Drop a database's files from the OS's page cache, where its server's data directory is on
    this host and readable here (the files it could: 0 when it is not)."""
    conn = await asyncpg.connect(pg_url(dsn, "postgres"))
    try:
        data_dir = await conn.fetchval("SELECT current_setting('data_directory')")
        oid = await conn.fetchval("SELECT oid FROM pg_database WHERE datname = $1", database)
    except asyncpg.PostgresError:  # not allowed to read the setting
        return 0
    finally:
        await conn.close()
    try:
        files = [f for f in (Path(data_dir) / "base" / str(oid)).iterdir() if f.is_file()]
    except OSError:
        return 0
    return sum(uncache_file(f) for f in files)


# ---------------------------------------------------------------------- copies to measure on
class SeededCopy(NamedTuple):
    url: str
    """The copy's plain address: a SQLite file's path, or a Postgres URL without the driver."""
    settings: Settings
    """The service's settings on the copy (anonymous access; Postgres with Redis under a prefix
    of its own)."""


@contextlib.asynccontextmanager
async def seeded_copy(
    backend: str,
    size: int,
    cache: Path,
    tmp: Path,
    name: str,
    *,
    pg_dsn: str = "",
    redis_url: str = "",
) -> AsyncIterator[SeededCopy]:
    """A copy of the cached seeded pool of `size` questions (`pool_bench.py` seeds it into `cache`
    and the template database `exgrpo_bench_seed_<size>`), named `name`: the SQLite file
    `tmp/<name>.db`, or the Postgres database `<name>`. The Postgres database and the Redis keys
    under the copy's prefix are removed at the end."""
    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    if backend == "sqlite":
        seed = cache / f"sqlite-{size}.db"
        if not seed.exists():
            raise SystemExit(f"no seeded pool at {seed}: run pool_bench.py --sizes {size} first")
        path = tmp / f"{name}.db"
        copy_sqlite(seed, path)
        yield SeededCopy(
            str(path), Settings(database_url=f"sqlite+aiosqlite:///{path}", allow_anonymous=True)
        )
        return
    template = f"exgrpo_bench_seed_{size}"
    if not await pg_exists(pg_dsn, template):
        raise SystemExit(f"no seeded database {template}: run pool_bench.py --backends postgres first")
    await copy_postgres(pg_dsn, template, name)
    settings = Settings(
        database_url=pg_url(pg_dsn, name, driver=True),
        redis_url=redis_url,
        redis_prefix=prefix,
        allow_anonymous=True,
    )
    try:
        yield SeededCopy(pg_url(pg_dsn, name), settings)
    finally:
        import redis

        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
        await pg_admin(pg_dsn, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
