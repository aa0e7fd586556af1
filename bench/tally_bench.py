"""What the tallies' triggers (migration 0010) cost a write.

Two databases migrated to the head, one with the tallies' triggers and one with them dropped, get
the same writes in turn: a transaction of what a commit of ``--groups`` groups stores (that many
question states moved to another bucket, ``--stored`` trajectories of ``--tokens`` tokens
inserted) over a pool of ``--questions`` questions with a state each, in the service's forms: on
SQLite one prepared statement run per state and per trajectory, on Postgres one upsert of the
states and one INSERT of the trajectories over arrays. Per backend the median time per
transaction over ``--rounds`` rounds of ``--per-round`` transactions is printed, with the
triggers and without, and their ratio (wall time: on Postgres the server's work is not in this
process's CPU). On SQLite since migration 0013 a trajectory's insert fires no trigger (the
service's insert counts it itself), so the difference there is the states' triggers.

``--evicted N``: each transaction also deletes the pool's N oldest trajectories in one statement,
as a commit does at a capacity limit (and retirement and trimming do by question): on Postgres
the DELETE's statement trigger gets them in a transition table.

    .venv/bin/python bench/tally_bench.py [--backend sqlite|postgres|both] [--questions 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import secrets
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo

COUNTED = {"state_tally": "run_question", "trajectory_tally": "trajectory", "question_tally": "question"}
TRIGGERS = [f"{t}_{e}" for t in COUNTED for e in ("insert", "delete", "update")]


def _writes(args: argparse.Namespace, rng: np.random.Generator, step: int) -> tuple[list[Any], list[Any]]:
    """The states moved (bucket, question id) and the trajectories stored by one transaction."""
    qids = rng.choice(args.questions, size=args.groups, replace=False) + 1
    states = [(int(step % 7), int(q)) for q in qids]
    payload = rng.integers(0, 150_000, size=args.tokens, dtype=np.int32).tobytes()
    lps = rng.random(args.tokens, dtype=np.float32).tobytes()
    trajs = [
        (int(qids[i % len(qids)]), step, payload, lps, args.tokens, 1.0, 0.5, secrets.token_bytes(16))
        for i in range(args.stored)
    ]
    return states, trajs


_SEED_QUESTIONS = (
    "INSERT INTO question (id, pool_id, content_hash, prompt, ground_truth, data_source, metadata, "
    "created_at) VALUES ({marks})"
)
_TRAJ_PG = (
    "INSERT INTO trajectory (question_id, pool_id, scope, source_run_id, step, token_ids, logprobs, "
    "num_tokens, reward, entropy, dedup_key, policy_version, created_at, period) "
    "SELECT *, 0, now(), floor(extract(epoch FROM now()) / 10)::bigint FROM unnest("
    "$1::bigint[], $2::bigint[], $3::bigint[], $4::bigint[], $5::int[], $6::bytea[], $7::bytea[], $8::int[], "
    "$9::float8[], $10::float8[], $11::bytea[])"
)
#: with the tallies: the tally rows of what the INSERT stored, in the same statement (as the service)
_TRAJ_PG_COUNTED = (
    f"WITH stored AS ({_TRAJ_PG} RETURNING pool_id, source_run_id, num_tokens, period), "
    "counted AS (INSERT INTO trajectory_tally (pool_id, run_id, period, n, tokens) "
    "SELECT pool_id, coalesce(source_run_id, 0), period, count(*), sum(num_tokens) FROM stored "
    "GROUP BY 1, 2, 3) SELECT count(*) FROM stored"
)
#: the pool's oldest trajectories removed, as an eviction does
_EVICT = (
    "DELETE FROM trajectory WHERE id IN (SELECT id FROM trajectory WHERE pool_id = 1 ORDER BY id LIMIT {n})"
)
_TRAJ = (
    "INSERT INTO trajectory (question_id, pool_id, scope, source_run_id, step, token_ids, logprobs, "
    "num_tokens, reward, entropy, dedup_key, policy_version, created_at) VALUES "
)


def _sqlite(path: Path, triggers: bool, args: argparse.Namespace) -> Callable[[int], float]:
    dbmod.upgrade(f"sqlite+aiosqlite:///{path}")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute(f"PRAGMA cache_size=-{dbmod.SQLITE_CACHE_MB * 1024}")  # as the service
    if not triggers:
        for name in TRIGGERS:
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")  # no INSERT trigger on trajectory since 0013
    conn.execute("BEGIN")
    conn.execute(
        "INSERT INTO pool (id, name, description, config, created_at, updated_at) "
        "VALUES (1, 'p', '', '{}', '2026-01-01', '2026-01-01')"
    )
    conn.execute(
        "INSERT INTO run (id, pool_id, name, seed, phase, step, policy_version, overrides, created_at, "
        "updated_at, epoch, cursor) "
        "VALUES (1, 1, 'r', 0, 'mixed', 0, 0, '{}', '2026-01-01', '2026-01-01', 1, 0)"
    )
    conn.executemany(
        _SEED_QUESTIONS.format(marks="?, 1, ?, '[]', '1', '', '{}', '2026-01-01'"),
        ((i, i.to_bytes(8, "little")) for i in range(1, args.questions + 1)),
    )
    conn.executemany(
        "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, last_step, "
        "updated_at) VALUES (1, ?, 1, 2, 3, 0, 0, '2026-01-01')",
        ((i,) for i in range(1, args.questions + 1)),
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    rng = np.random.default_rng(0)

    def one(step: int) -> float:
        states, trajs = _writes(args, rng, step)
        t0 = time.perf_counter()
        conn.execute("BEGIN")
        conn.executemany("UPDATE run_question SET bucket = ? WHERE scope = 1 AND question_id = ?", states)
        conn.executemany(
            _TRAJ + "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, '2026-01-01')",
            [(row[0], 1, 1, 1, *row[1:]) for row in trajs],
        )
        if args.evicted:
            conn.execute(_EVICT.format(n=args.evicted))
        conn.execute("COMMIT")
        return time.perf_counter() - t0

    return one


async def _postgres(dsn: str, triggers: bool, args: argparse.Namespace) -> tuple[Any, Callable[[int], Any]]:
    name = f"exgrpo_tally_bench_{'on' if triggers else 'off'}"
    admin = await asyncpg.connect(f"{dsn}/postgres")
    await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    await admin.execute(f"CREATE DATABASE {name}")
    await admin.close()
    await asyncio.to_thread(dbmod.upgrade, f"{dsn.replace('postgresql://', 'postgresql+asyncpg://')}/{name}")
    conn = await asyncpg.connect(f"{dsn}/{name}")
    if not triggers:
        for trig in TRIGGERS:
            await conn.execute(f"DROP TRIGGER IF EXISTS {trig} ON {COUNTED[trig.rsplit('_', 1)[0]]}")
    await conn.execute(
        "INSERT INTO pool (id, name, description, config, created_at, updated_at) "
        "VALUES (1, 'p', '', '{}', now(), now())"
    )
    await conn.execute(
        "INSERT INTO run (id, pool_id, name, seed, phase, step, policy_version, overrides, created_at, "
        "updated_at, epoch, cursor) VALUES (1, 1, 'r', 0, 'mixed', 0, 0, '{}', now(), now(), 1, 0)"
    )
    await conn.execute(
        "INSERT INTO question (id, pool_id, content_hash, prompt, ground_truth, data_source, metadata, "
        "created_at) SELECT i, 1, int8send(i), '[]', '1', '', '{}', now() FROM generate_series(1, $1) i",
        args.questions,
    )
    await conn.execute(
        "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, last_step, "
        "updated_at) SELECT 1, i, 1, 2, 3, false, 0, now() FROM generate_series(1, $1) i",
        args.questions,
    )
    await conn.execute("VACUUM ANALYZE")
    rng = np.random.default_rng(0)

    async def one(step: int) -> float:
        states, trajs = _writes(args, rng, step)
        t0 = time.perf_counter()
        async with conn.transaction():
            now = datetime.now(UTC)
            await conn.execute(
                repo._STATES_UPSERT_PG,
                *[
                    [1] * len(states),
                    [q for _, q in sorted(states, key=lambda s: s[1])],
                    [1] * len(states),
                    [2] * len(states),
                    [b for b, _ in sorted(states, key=lambda s: s[1])],
                    [False] * len(states),
                    [step] * len(states),
                    [1] * len(states),
                    [now] * len(states),
                ],
            )
            columns = [list(c) for c in zip(*[(row[0], 1, 1, 1, *row[1:]) for row in trajs], strict=True)]
            await conn.execute(_TRAJ_PG_COUNTED if triggers else _TRAJ_PG, *columns)
            if args.evicted:
                await conn.execute(_EVICT.format(n=args.evicted))
        return time.perf_counter() - t0

    return conn, one


def _table(backend: str, times: dict[bool, list[float]]) -> None:
    on, off = statistics.median(times[True]) * 1000, statistics.median(times[False]) * 1000
    print(f"| {backend} | {on:.2f} | {off:.2f} | {on / off:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    ap.add_argument("--questions", type=int, default=10_000)
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--stored", type=int, default=340)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--evicted", type=int, default=0, help="oldest trajectories deleted per transaction")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument(
        "--pg-dsn", default=os.environ.get("EXGRPO_BENCH_PG", "postgresql://postgres@127.0.0.1:5432")
    )
    args = ap.parse_args()
    print(
        f"\n{args.questions:,} questions; a transaction moves {args.groups} states and stores {args.stored} "
        f"trajectories of {args.tokens} tokens, evicts {args.evicted}; "
        f"median of {args.rounds} rounds of {args.per_round}\n"
    )
    print("| backend | with tallies, ms | without, ms | ratio |")
    print("|---|---:|---:|---:|")
    step = 0
    if args.backend in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            sqlite_sides = {t: _sqlite(Path(tmp) / f"{t}.db", t, args) for t in (True, False)}

            async def run_sqlite() -> tuple[dict[bool, list[float]], int]:
                async def side(write: Callable[[int], float], n: int) -> float:
                    return write(n)

                writes = {t: functools.partial(side, w) for t, w in sqlite_sides.items()}
                return await _rounds(args, writes, step)

            times, step = asyncio.run(run_sqlite())
            _table("sqlite", times)
    if args.backend in ("postgres", "both"):
        _table("postgres", asyncio.run(_postgres_rounds(args, step)))


async def _rounds(
    args: argparse.Namespace, sides: dict[bool, Callable[[int], Awaitable[float]]], step: int
) -> tuple[dict[bool, list[float]], int]:
    """Each side's median transaction time per round, the sides taking turns at going first;
    with the step count reached."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for t in (True, False) if r % 2 == 0 else (False, True):
            batch = []
            for _ in range(args.per_round):
                step += 1
                batch.append(await sides[t](step))
            times[t].append(statistics.median(batch))
    return times, step


async def _postgres_rounds(args: argparse.Namespace, step: int) -> dict[bool, list[float]]:
    pg = {t: await _postgres(args.pg_dsn, t, args) for t in (True, False)}
    try:
        times, _ = await _rounds(args, {t: one for t, (_, one) in pg.items()}, step)
    finally:
        for conn, _ in pg.values():
            await conn.close()
    return times


if __name__ == "__main__":
    main()
