"""Where trajectory payloads live: four layouts measured side by side in one run.

* ``inline``: today's table, token ids and log-probs as ``bytea`` columns of the trajectory row
  (Postgres' default ``EXTENDED`` storage: compressed, then moved out of line when large);
* ``external``: the same table with ``ALTER COLUMN ... SET STORAGE EXTERNAL`` on both payload
  columns (out of line, never compressed);
* ``separate``: the metadata row in one table and the payload in a second one, keyed by the
  trajectory id;
* ``file``: the metadata row in Postgres with the payload's place (``payload_offset``, token and
  log-prob byte lengths) in one append-only file on local disk. A commit's insert appends all its
  payload bytes with one ``writev``, ``fdatasync``s the file and only then inserts the metadata rows
  in one transaction, so a committed row never points past the synced end of the file. A crash
  between the append and the COMMIT leaves garbage bytes only (bytes no row points to), which is
  also what a retired trajectory's bytes become: reclaiming them needs a compaction that copies the
  live bytes into a new file and rewrites the offsets. One writer at a time (the offset is the
  file's end before the append). The payload read fetches the metadata rows (offsets and lengths),
  then ``pread``s each row's bytes in offset order; both are timed.

For each layout: seed ``--rows`` trajectories (512-1536 tokens each, as the pool benchmark's), then
time, interleaved round by round so every layout sees the same load: a commit's insert (340
trajectories in one transaction), the replay-candidate read of a plan (metadata of all
trajectories of 64 questions, no payload) and the payload read of a plan (the same with payloads).

    .venv/bin/python bench/storage_bench.py [--rows 20000] [--rounds 15] [--file-dir DIR]
        [--file-read pread|preadv]

Needs a Postgres user that may create databases (default ``postgresql://postgres@127.0.0.1:5432``).
The payload file lives in a temporary directory made under ``--file-dir`` (default: the system's
temporary directory; put it on the same kind of disk as the database) and removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

META = (
    "question_id bigint NOT NULL, scope bigint NOT NULL, reward real NOT NULL, entropy real, "
    "num_tokens int NOT NULL, step int NOT NULL, created_at timestamptz NOT NULL DEFAULT now()"
)
PAYLOAD = "token_ids bytea NOT NULL, logprobs bytea NOT NULL"
LAYOUTS = ("inline", "external", "separate", "file")
FILE_META = "payload_offset bigint NOT NULL, token_len int NOT NULL, logprob_len int NOT NULL"
QUESTIONS = 4000
IOV_MAX = os.sysconf("SC_IOV_MAX")


class PayloadFile:
    """The ``file`` layout's append-only payload file: one writer, offsets are byte positions."""

    def __init__(self, path: Path, read_mode: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the file's directory entry, once
        finally:
            os.close(dfd)
        self.end = os.fstat(self.fd).st_size
        self.read_mode = read_mode

    def append(self, bufs: list[bytes]) -> int:
        """Append ``bufs`` and ``fdatasync``; return the offset of the first byte.

        One ``writev`` for up to ``IOV_MAX`` buffers (a commit's 340 trajectories are 680); more
        buffers, or a short write, take further calls.
        """
        start = self.end
        for i in range(0, len(bufs), IOV_MAX):
            group = bufs[i : i + IOV_MAX]
            done, want = os.writev(self.fd, group), sum(len(b) for b in group)
            if done < want:
                rest = memoryview(b"".join(group))[done:]
                while rest:
                    rest = rest[os.write(self.fd, rest) :]
            self.end += want
        os.fdatasync(self.fd)
        return start

    def read(self, places: list[tuple[int, int, int]]) -> list[tuple[bytes, bytes]]:
        """Token ids and log-probs of each ``(offset, token_len, logprob_len)``, in the given order."""
        out: list[tuple[bytes, bytes]] = [(b"", b"")] * len(places)
        for i in sorted(range(len(places)), key=lambda j: places[j][0]):
            off, nt, nl = places[i]
            if self.read_mode == "preadv":
                tok, lp = bytearray(nt), bytearray(nl)
                if os.preadv(self.fd, [tok, lp], off) != nt + nl:
                    raise OSError(f"short read at {off}")
                out[i] = (bytes(tok), bytes(lp))
            else:
                buf = os.pread(self.fd, nt + nl, off)
                if len(buf) != nt + nl:
                    raise OSError(f"short read at {off}")
                out[i] = (buf[:nt], buf[nt:])
        return out

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)


def _ddl(layout: str) -> list[str]:
    if layout == "file":
        return [
            f"CREATE TABLE t_file (id bigserial PRIMARY KEY, {META}, {FILE_META})",
            "CREATE INDEX ON t_file (question_id)",
        ]
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


async def _insert(
    conn: asyncpg.Connection, layout: str, rows: list[tuple[Any, ...]], pfile: PayloadFile
) -> None:
    if layout == "file":
        off = pfile.append([b for r in rows for b in (r[6], r[7])])
        places = []
        for r in rows:
            places.append(off)
            off += len(r[6]) + len(r[7])
        await conn.execute(
            "INSERT INTO t_file (question_id, scope, reward, entropy, num_tokens, step, payload_offset, "
            "token_len, logprob_len) SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::real[], "
            "$4::real[], $5::int[], $6::int[], $7::bigint[], $8::int[], $9::int[])",
            *[[r[i] for r in rows] for i in range(6)],
            places,
            [len(r[6]) for r in rows],
            [len(r[7]) for r in rows],
        )
        return
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


async def _read(
    conn: asyncpg.Connection, layout: str, qids: list[int], payload: bool, pfile: PayloadFile
) -> int:
    cols = "id, question_id, reward, entropy, num_tokens, step, created_at"
    if layout == "file":
        more = ", payload_offset, token_len, logprob_len" if payload else ""
        rows = await conn.fetch(f"SELECT {cols}{more} FROM t_file WHERE question_id = ANY($1)", qids)
        if payload:
            got = pfile.read([(r["payload_offset"], r["token_len"], r["logprob_len"]) for r in rows])
            return len(got)
        return len(rows)
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
    tmp = tempfile.TemporaryDirectory(prefix="storage_bench_", dir=args.file_dir)
    pfile = PayloadFile(Path(tmp.name) / "payloads.bin", args.file_read)
    rng = np.random.default_rng(0)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for layout in LAYOUTS:
            for stmt in _ddl(layout):
                await conn.execute(stmt)
        for start in range(0, args.rows, 2000):
            chunk = _rows(rng, min(2000, args.rows - start))
            for layout in LAYOUTS:
                await _insert(conn, layout, chunk, pfile)
        await conn.execute("VACUUM ANALYZE")
        for _ in range(args.rounds):
            rows = _rows(rng, 340)
            qids = [int(q) for q in rng.choice(QUESTIONS, 64, replace=False) + 1]
            for layout in LAYOUTS:
                for what in ("insert 340", "read metadata", "read payloads"):
                    t0 = time.perf_counter()
                    if what == "insert 340":
                        await _insert(conn, layout, rows, pfile)
                    else:
                        await _read(conn, layout, qids, what == "read payloads", pfile)
                    times.setdefault((layout, what), []).append((time.perf_counter() - t0) * 1000)
        sizes = {
            layout: await conn.fetchval(
                "SELECT pg_total_relation_size($1::regclass)"
                + (" + pg_total_relation_size('t_separate_payload')" if layout == "separate" else ""),
                f"t_{layout}",
            )
            for layout in LAYOUTS
        }
        sizes["file"] += pfile.size()
        heap = {
            layout: await conn.fetchval("SELECT pg_relation_size($1::regclass)", f"t_{layout}")
            for layout in LAYOUTS
        }
    finally:
        pfile.close()
        tmp.cleanup()
        await conn.close()
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
    print(
        f"{args.rows:,} seeded trajectories, {args.rounds} rounds, medians in ms "
        f"(file layout: {args.file_read} per row; total MB includes the payload file)"
    )
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
    ap.add_argument("--file-dir", default=None, help="where the payload file's temporary directory is made")
    ap.add_argument("--file-read", choices=("pread", "preadv"), default="pread")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
