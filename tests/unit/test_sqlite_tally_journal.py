"""SQLite: the tallies' triggers (migration 0010) must not make a commit's writes copy their pages
into a statement journal. A trigger statement that may abort halfway needs one, and SQLite writes
it to a temporary file past 64 KiB: the original of every page the statement changes, payload
overflow pages included. Migration 0011 gives the trigger statements OR IGNORE (none of them can
fail a constraint), and the statements of a commit write nothing until the COMMIT."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from alembic import command

from exgrpo_pool.store import db as dbmod

TRAJECTORIES = 200
TOKENS = 1024


def _written() -> int:
    """Bytes this process has passed to write() so far (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    dbmod._sqlite_pragmas(dbmod.SQLITE_CACHE_MB)(conn, None)  # the service's settings
    return conn


def _seed(conn: sqlite3.Connection) -> None:
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
        "INSERT INTO question (id, pool_id, content_hash, prompt, ground_truth, data_source, metadata, "
        "created_at) VALUES (?, 1, ?, '[]', '1', '', '{}', '2026-01-01')",
        [(i, i.to_bytes(8, "little")) for i in range(1, TRAJECTORIES + 1)],
    )
    conn.executemany(
        "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, last_step, "
        "updated_at) VALUES (1, ?, 1, 2, 3, 0, 0, '2026-01-01')",
        [(i,) for i in range(1, TRAJECTORIES + 1)],
    )
    conn.execute("COMMIT")


def _store(conn: sqlite3.Connection, step: int) -> None:
    rng = np.random.default_rng(step)
    conn.executemany(
        "INSERT INTO trajectory (question_id, pool_id, scope, source_run_id, step, token_ids, logprobs, "
        "num_tokens, reward, entropy, dedup_key, policy_version, created_at) "
        "VALUES (?, 1, 1, 1, ?, ?, ?, ?, 1.0, 0.5, ?, 0, '2026-01-01')",
        [
            (
                q,
                step,
                rng.integers(0, 150_000, TOKENS, dtype=np.int32).tobytes(),
                rng.random(TOKENS, dtype=np.float32).tobytes(),
                TOKENS,
                rng.bytes(16),
            )
            for q in range(1, TRAJECTORIES + 1)
        ],
    )


#: what a commit at a capacity limit does to the counted tables, statement by statement
WRITES: dict[str, Callable[[sqlite3.Connection], object]] = {
    "evict": lambda c: c.execute("DELETE FROM trajectory WHERE step = 1"),
    "store": lambda c: _store(c, 2),
    "move states": lambda c: c.execute("UPDATE run_question SET bucket = 4 WHERE scope = 1"),
}


def _written_before_commit(path: Path, write: Callable[[sqlite3.Connection], object]) -> int:
    conn = _connect(path)
    try:
        conn.execute("BEGIN")
        before = _written()
        write(conn)
        written = _written() - before
        conn.execute("ROLLBACK")
        return written
    finally:
        conn.close()


def _pool(tmp_path: Path) -> tuple[Path, str]:
    """A pool at the head with TRAJECTORIES stored trajectories of step 1, checkpointed."""
    path = tmp_path / "pool.db"
    url = f"sqlite+aiosqlite:///{path}"
    dbmod.upgrade(url)
    conn = _connect(path)
    _seed(conn)
    conn.execute("BEGIN")
    _store(conn, 1)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return path, url


@pytest.mark.parametrize("what", list(WRITES))
def test_a_commits_statements_write_nothing_before_the_commit(tmp_path: Path, what: str) -> None:
    path, _ = _pool(tmp_path)
    assert _written_before_commit(path, WRITES[what]) < 64 * 1024


def test_migration_0010s_triggers_journaled_an_evictions_pages(tmp_path: Path) -> None:
    """The check above can fail: under 0010's triggers an eviction's statement wrote the pages of
    the trajectories it removed to a statement journal before the commit."""
    path, url = _pool(tmp_path)
    command.downgrade(dbmod.alembic_config(url), "0010")
    assert _written_before_commit(path, WRITES["evict"]) > TRAJECTORIES * TOKENS * 4
