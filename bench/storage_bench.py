"""Where trajectory payloads live in Postgres: three layouts measured side by side in one run.

* ``inline``: today's table, token ids and log-probs as ``bytea`` columns of the trajectory row
  (Postgres' default ``EXTENDED`` storage: compressed, then moved out of line when large);
* ``external``: the same table with ``ALTER COLUMN ... SET STORAGE EXTERNAL`` on both payload
  columns (out of line, never compressed);
* ``separate``: the metadata row in one table and the payload in a second one, keyed by the
  trajectory id.

For each layout: seed ``--rows`` trajectories (512-1536 tokens each, as the pool benchmark's), then
time, interleaved round by round so every layout sees the same load: a commit's insert (340
trajectories in one transaction), the replay-candidate read of a plan (metadata of all
trajectories of 64 questions, no payload) and the payload read of a plan (the same with payloads).

    .venv/bin/python bench/storage_bench.py [--rows 20000] [--rounds 15]

Needs a Postgres user that may create databases (default ``postgresql://postgres@127.0.0.1:5432``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import asyncpg
import numpy as np

META = (
    "question_id bigint NOT NULL, scope bigint NOT NULL, reward real NOT NULL, entropy real, "
    "num_tokens int NOT NULL, step int NOT NULL, created_at timestamptz NOT NULL DEFAULT now()"
)
PAYLOAD = "token_ids bytea NOT NULL, logprobs bytea NOT NULL"
LAYOUTS = ("inline", "external", "separate")
QUESTIONS = 4000


def _ddl(layout: str) -> list[str]:
    if layout == "separate":
        return [
            f"CREATE TABLE t_separate (id bigserial PRIMARY KEY, {META})",
            f"CREATE TABLE t_separate_payload (id bigint PRIMARY KEY, {PAYLOAD})",
            "CREATE INDEX ON t_separate (question_id)",
        ]
    out = [
        f"CREATE TABLE t_{layout} (id bigserial PRIMARY KEY, {META}, {PAYLOAD})",
        f"CREATE INDEX ON t_{layout} (question_id)",
    ]
    if layout == "external":
        out += [
            "ALTER TABLE t_external ALTER COLUMN token_ids SET STORAGE EXTERNAL",
            "ALTER TABLE t_external ALTER COLUMN logprobs SET STORAGE EXTERNAL",
        ]
    return out


def _rows(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    out = []
    for _ in range(n):
        k = int(rng.integers(512, 1537))
        ids = rng.integers(0, 151_000, k, dtype=np.int32).astype("<i4").tobytes()
        lps = (-rng.exponential(0.6, k)).astype("<f4").tobytes()
        out.append((int(rng.integers(1, QUESTIONS + 1)), 1, 1.0, 0.5, k, 3, ids, lps))
    return out


async def _insert(conn: asyncpg.Connection, layout: str, rows: list[tuple[Any, ...]]) -> None:
    async with conn.transaction():
        if layout != "separate":
            await conn.executemany(
                f"INSERT INTO t_{layout} (question_id, scope, reward, entropy, num_tokens, step, token_ids, "
                "logprobs) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                rows,
            )
            return
        ids = await conn.fetch(
            "INSERT INTO t_separate (question_id, scope, reward, entropy, num_tokens, step) "
            "SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::real[], $4::real[], $5::int[], $6::int[]) "
            "RETURNING id",
            *[[r[i] for r in rows] for i in range(6)],
        )
        await conn.executemany(
            "INSERT INTO t_separate_payload (id, token_ids, logprobs) VALUES ($1, $2, $3)",
            [(rec["id"], r[6], r[7]) for rec, r in zip(ids, rows, strict=True)],
        )


async def _read(conn: asyncpg.Connection, layout: str, qids: list[int], payload: bool) -> int:
    cols = "id, question_id, reward, entropy, num_tokens, step, created_at"
    if layout == "separate":
        sql = (
            f"SELECT t.{cols.replace(', ', ', t.')}, p.token_ids, p.logprobs FROM t_separate t "
            "JOIN t_separate_payload p USING (id) WHERE t.question_id = ANY($1)"
            if payload
            else f"SELECT {cols} FROM t_separate WHERE question_id = ANY($1)"
        )
    else:
        more = ", token_ids, logprobs" if payload else ""
        sql = f"SELECT {cols}{more} FROM t_{layout} WHERE question_id = ANY($1)"
    return len(await conn.fetch(sql, qids))


async def main_async(args: argparse.Namespace) -> None:
    name = "exgrpo_storage_bench"
    admin = await asyncpg.connect(f"{args.pg_dsn}/postgres")
    await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    await admin.execute(f"CREATE DATABASE {name}")
    conn = await asyncpg.connect(f"{args.pg_dsn}/{name}")
    rng = np.random.default_rng(0)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for layout in LAYOUTS:
            for stmt in _ddl(layout):
                await conn.execute(stmt)
        for start in range(0, args.rows, 2000):
            chunk = _rows(rng, min(2000, args.rows - start))
            for layout in LAYOUTS:
                await _insert(conn, layout, chunk)
        await conn.execute("VACUUM ANALYZE")
        for _ in range(args.rounds):
            rows = _rows(rng, 340)
            qids = [int(q) for q in rng.choice(QUESTIONS, 64, replace=False) + 1]
            for layout in LAYOUTS:
                for what in ("insert 340", "read metadata", "read payloads"):
                    t0 = time.perf_counter()
                    if what == "insert 340":
                        await _insert(conn, layout, rows)
                    else:
                        await _read(conn, layout, qids, what == "read payloads")
                    times.setdefault((layout, what), []).append((time.perf_counter() - t0) * 1000)
        sizes = {
            layout: await conn.fetchval(
                "SELECT pg_total_relation_size($1::regclass)"
                + (" + pg_total_relation_size('t_separate_payload')" if layout == "separate" else ""),
                f"t_{layout}",
            )
            for layout in LAYOUTS
        }
        heap = {
            layout: await conn.fetchval("SELECT pg_relation_size($1::regclass)", f"t_{layout}")
            for layout in LAYOUTS
        }
    finally:
        await conn.close()
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
    print(f"{args.rows:,} seeded trajectories, {args.rounds} rounds, medians in ms")
    print("| layout | insert 340 | read metadata (64 q) | read payloads (64 q) | heap MB | total MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for layout in LAYOUTS:
        med = [
            statistics.median(times[(layout, w)]) for w in ("insert 340", "read metadata", "read payloads")
        ]

        print(
            f"| {layout} | {med[0]:.1f} | {med[1]:.2f} | {med[2]:.1f} | {heap[layout] / 2**20:.1f} "
            f"| {sizes[layout] / 2**20:.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
