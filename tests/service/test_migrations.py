"""Migrations: the schema they build is the models' schema, the scope migration moves existing
data where the sharing modes now keep it, and the data migrations keep what they move (SQLite and
Postgres)."""

from __future__ import annotations

import json
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, inspect, text

from exgrpo_client import schemas as s
from exgrpo_pool.store import db as dbmod
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import Base

from .conftest import PG_HOST, PG_PORT, PG_USER, _in_thread, _pg_admin

T = TypeVar("T")


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=[pytest.mark.postgres]),
    ]
)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (no tables yet)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
        return
    name = f"exgrpo_mig_{secrets.token_hex(6)}"
    _in_thread(lambda: _pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        _in_thread(lambda: _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _sql(url: str, statements: list[tuple[str, dict[str, Any]]]) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        engine = dbmod.make_engine(url)
        out: list[list[Any]] = []
        try:
            async with engine.begin() as conn:
                for stmt, params in statements:
                    result = await conn.execute(text(stmt), params)
                    out.append([tuple(r) for r in result] if result.returns_rows else [])
        finally:
            await engine.dispose()
        return out

    return _in_thread(go)


def _inspected(url: str, look: Callable[[Connection], T]) -> T:
    """What `look` finds on a connection to the database."""

    async def go() -> T:
        engine = dbmod.make_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(look)
        finally:
            await engine.dispose()

    return _in_thread(go)


def _schema_diff(url: str) -> list[Any]:
    def compare(conn: Connection) -> list[Any]:
        return list(compare_metadata(MigrationContext.configure(conn), Base.metadata))

    return _inspected(url, compare)


def test_migrated_schema_is_the_models_schema(empty_url: str) -> None:
    dbmod.upgrade(empty_url)
    assert _schema_diff(empty_url) == []


def test_scope_migration_moves_pooled_states_and_per_run_trajectories(empty_url: str) -> None:
    dbmod.upgrade(empty_url, "0003")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    rows: list[tuple[str, dict[str, Any]]] = []
    for pid, sharing in ((1, "per_run"), (2, "pooled"), (3, "pooled")):
        rows.append(
            (
                "INSERT INTO pool (id, name, description, config, created_at, updated_at) "
                "VALUES (:id, :name, '', :config, :now, :now)",
                {
                    "id": pid,
                    "name": f"p{pid}",
                    "config": json.dumps({"k": 4, "sharing": sharing}),
                    "now": now,
                },
            )
        )
        rows.append(
            (
                "INSERT INTO question (id, pool_id, content_hash, prompt, ground_truth, data_source, "
                "metadata, created_at) VALUES (:id, :id, :h, '[]', '1', '', '{}', :now)",
                {"id": pid, "h": bytes([pid]) * 16, "now": now},
            )
        )
        rows.append(
            (
                "INSERT INTO run (id, pool_id, name, seed, phase, step, policy_version, epoch, cursor, "
                "overrides, created_at, updated_at) "
                "VALUES (:id, :id, 'r', 0, 'mixed', 0, 0, -1, 0, '{}', :now, :now)",
                {"id": pid, "now": now},
            )
        )
        scope = 0 if sharing == "pooled" else pid
        rows.append(
            (
                "INSERT INTO run_question (scope, question_id, pool_id, last_k, bucket, retired, last_step, "
                "updated_at) VALUES (:s, :q, :p, 1, 1, false, 1, :now)",
                {"s": scope, "q": pid, "p": pid, "now": now},
            )
        )
        for tid, source in ((10 * pid, pid), (10 * pid + 1, None)):
            rows.append(
                (
                    "INSERT INTO trajectory (id, question_id, pool_id, source_run_id, policy_version, step, "
                    "token_ids, logprobs, num_tokens, reward, dedup_key, created_at) "
                    "VALUES (:id, :q, :p, :src, 0, 0, :ids, :lps, 1, 1.0, :key, :now)",
                    {
                        "id": tid,
                        "q": pid,
                        "p": pid,
                        "src": source,
                        "ids": b"\x01\x00\x00\x00",
                        "lps": b"\x00\x00\x00\x00",
                        "key": bytes([tid]) * 32,
                        "now": now,
                    },
                )
            )
    _sql(empty_url, rows)
    dbmod.upgrade(empty_url)
    states, trajs = _sql(
        empty_url,
        [
            ("SELECT pool_id, scope FROM run_question ORDER BY pool_id", {}),
            ("SELECT id, scope FROM trajectory ORDER BY id", {}),
        ],
    )
    # every pooled pool has its own shared scope (-pool id), no longer the one scope 0
    assert states == [(1, 1), (2, -2), (3, -3)]
    # per_run: a trajectory belongs to the run that collected it; the rest to the pool's scope
    assert trajs == [(10, 1), (11, -1), (20, -2), (21, -2), (30, -3), (31, -3)]
    assert _schema_diff(empty_url) == []
    # and back: shared scopes are 0 again
    command.downgrade(dbmod.alembic_config(empty_url), "0003")
    (states,) = _sql(empty_url, [("SELECT pool_id, scope FROM run_question ORDER BY pool_id", {})])
    assert states == [(1, 1), (2, 0), (3, 0)]


def test_bucket_shape_migration_clamps_stored_configs(empty_url: str) -> None:
    dbmod.upgrade(empty_url, "0005")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    configs = {
        1: {"k": 4, "sigma": 1e-200, "mu": 1e308},  # accepted before the bounds, unusable since
        2: {"k": 4, "sigma": 2.0, "mu": -3e9},
        3: {"k": 8, "sigma": 0.5, "mu": None},  # inside the bounds: untouched
    }
    _sql(
        empty_url,
        [
            (
                "INSERT INTO pool (id, name, description, config, created_at, updated_at) "
                "VALUES (:id, :name, '', :config, :now, :now)",
                {"id": pid, "name": f"p{pid}", "config": json.dumps(cfg), "now": now},
            )
            for pid, cfg in configs.items()
        ],
    )
    dbmod.upgrade(empty_url)
    (rows,) = _sql(empty_url, [("SELECT id, config FROM pool ORDER BY id", {})])
    stored = {pid: cfg if isinstance(cfg, dict) else json.loads(cfg) for pid, cfg in rows}
    assert stored[1] == {"k": 4, "sigma": 1e-6, "mu": 1e6}
    assert stored[2] == {"k": 4, "sigma": 2.0, "mu": -1e6}
    assert stored[3] == configs[3]
    # and the clamped configs load as pool configs again
    for cfg in stored.values():
        s.PoolConfig.model_validate(cfg, strict=False)


def test_task_settings_migration_keeps_queued_tasks_exact(empty_url: str) -> None:
    dbmod.upgrade(empty_url, "0006")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    _sql(
        empty_url,
        [
            (
                "INSERT INTO pool (id, name, description, config, created_at, updated_at) "
                "VALUES (1, 'p1', '', '{}', :now, :now)",
                {"now": now},
            ),
            (
                "INSERT INTO question (id, pool_id, content_hash, prompt, ground_truth, data_source, "
                "metadata, created_at) VALUES (1, 1, :h, '[]', '1', '', '{}', :now)",
                {"h": b"\x01" * 16, "now": now},
            ),
            (
                "INSERT INTO run (id, pool_id, name, seed, phase, step, policy_version, epoch, cursor, "
                "overrides, created_at, updated_at) "
                "VALUES (1, 1, 'r', 0, 'on_policy', 0, 3, -1, 0, '{}', :now, :now)",
                {"now": now},
            ),
            (
                "INSERT INTO batch (id, run_id, step, status, phase, policy_version, plan, created_at) "
                "VALUES ('b1', 1, 1, 'planned', 'on_policy', 3, '{}', :now)",
                {"now": now},
            ),
            (
                "INSERT INTO task (id, batch_id, run_id, question_id, num_samples, replayed, policy_version, "
                "status, attempts, created_at, updated_at) "
                "VALUES (1, 'b1', 1, 1, 4, false, 3, 'pending', 0, :now, :now)",
                {"now": now},
            ),
        ],
    )
    dbmod.upgrade(empty_url)
    (rows,) = _sql(
        empty_url, [("SELECT policy_version, policy_exact, sampling, generated_version FROM task", {})]
    )
    # a task queued before the settings existed is an exact task of its version, sampled as the
    # worker likes, with no reported version yet
    assert [(v, bool(exact), sampling, gen) for v, exact, sampling, gen in rows] == [(3, True, None, None)]
    assert _schema_diff(empty_url) == []
    command.downgrade(dbmod.alembic_config(empty_url), "0006")
    (rows,) = _sql(empty_url, [("SELECT id, policy_version FROM task", {})])
    assert rows == [(1, 3)]


def _unindexed_foreign_keys(url: str) -> list[str]:
    """Each foreign key whose referencing columns lead no index of their table: deleting one
    referenced row (a cascade, or the check that nothing refers to it) then reads the whole
    referencing table, and deleting a pool of n questions reads it n times."""

    def find(conn: Connection) -> list[str]:
        insp = inspect(conn)
        missing = []
        for table in insp.get_table_names():
            leads = [tuple(i["column_names"]) for i in insp.get_indexes(table)]
            leads += [tuple(u["column_names"]) for u in insp.get_unique_constraints(table)]
            leads.append(tuple(insp.get_pk_constraint(table)["constrained_columns"]))
            for fk in insp.get_foreign_keys(table):
                cols = tuple(fk["constrained_columns"])
                if not any(lead[: len(cols)] == cols for lead in leads):
                    missing.append(f"{table}({', '.join(cols)}) -> {fk['referred_table']}")
        return sorted(missing)

    return _inspected(url, find)


#: referencing columns without an index of their own, and why that reads nothing per row
UNINDEXED = {
    # a pool is deleted in one statement; its cascade reads the states once, not once per row
    "run_question(pool_id) -> pool",
}


def test_every_foreign_key_leads_an_index(empty_url: str) -> None:
    """Migration 0012: deleting a pool of 1M questions on Postgres read its 200,000 states once
    per question (run_question's key starts with the scope), for more than 15 minutes."""
    dbmod.upgrade(empty_url)
    assert set(_unindexed_foreign_keys(empty_url)) == UNINDEXED


def test_trajectory_period_migration_keeps_the_counts_both_ways(empty_url: str) -> None:
    """Migration 0014 recounts the trajectory tally on Postgres with periods (a recent trajectory in
    its ten seconds, one two hours old folded into period 0) and leaves SQLite's rows in period 0;
    0015 stores the recent trajectories' periods with them and recounts SQLite's tally with
    periods too; both come back to what was before; the counts stand every way."""
    dbmod.upgrade(empty_url, "0013")
    now = datetime.now(UTC)
    recent = [now - timedelta(seconds=7 * k) for k in range(6)]
    made = [(at, 1) for at in recent] + [(now - timedelta(hours=2), 1)] * 4 + [(now, None)] * 2
    rows: list[tuple[str, dict[str, Any]]] = [
        (
            "INSERT INTO pool (id, name, description, config, created_at, updated_at) "
            "VALUES (1, 'p', '', '{}', :now, :now)",
            {"now": now},
        ),
        (
            "INSERT INTO question (id, pool_id, content_hash, prompt, ground_truth, data_source, metadata, "
            "created_at) VALUES (1, 1, :h, '[]', '1', '', '{}', :now)",
            {"h": b"q" * 16, "now": now},
        ),
        (
            "INSERT INTO run (id, pool_id, name, seed, phase, step, policy_version, epoch, cursor, "
            "overrides, created_at, updated_at) "
            "VALUES (1, 1, 'r', 0, 'mixed', 0, 0, -1, 0, '{}', :now, :now)",
            {"now": now},
        ),
        # the tally as the service's inserts left it at 0013: one row per (pool, source run)
        ("INSERT INTO trajectory_tally (pool_id, run_id, n, tokens) VALUES (1, 1, 10, 30), (1, 0, 2, 6)", {}),
    ]
    for i, (at, source) in enumerate(made):
        rows.append(
            (
                "INSERT INTO trajectory (question_id, pool_id, scope, source_run_id, policy_version, step, "
                "token_ids, logprobs, num_tokens, reward, dedup_key, created_at) "
                "VALUES (1, 1, -1, :src, 0, 0, :ids, :lps, 3, 1.0, :key, :at)",
                {"src": source, "ids": bytes(12), "lps": bytes(12), "key": bytes([i]) * 32, "at": at},
            )
        )
    _sql(empty_url, rows)
    postgres = empty_url.startswith("postgresql")
    by_period = "SELECT run_id, period, sum(n), sum(tokens) FROM trajectory_tally GROUP BY 1, 2 ORDER BY 1, 2"
    periods = sorted(Counter(repo.tally_period(at) for at in recent).items())
    with_periods = [(0, repo.tally_period(now), 2, 6), (1, 0, 4, 12), *((1, p, n, 3 * n) for p, n in periods)]
    for _ in range(2):
        dbmod.upgrade(empty_url)
        (cells,) = _sql(empty_url, [(by_period, {})])
        assert cells == with_periods
        assert _schema_diff(empty_url) == []
        command.downgrade(dbmod.alembic_config(empty_url), "0014")
        (cells,) = _sql(empty_url, [(by_period, {})])
        assert cells == (with_periods if postgres else [(0, 0, 2, 6), (1, 0, 10, 30)])
        command.downgrade(dbmod.alembic_config(empty_url), "0013")
        (cells,) = _sql(
            empty_url, [("SELECT run_id, count(*), sum(n), sum(tokens) FROM trajectory_tally GROUP BY 1", {})]
        )
        assert sorted(cells) == [(0, 1, 2, 6), (1, 1, 10, 30)]
