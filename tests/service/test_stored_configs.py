"""A pool's config and a run's overrides, read by every request of the pool or the run, are read as
their stored JSON text and validated once per distinct text in the process: every row of the same
text shares one frozen model, and a change (a PATCH) is a new text, so the next read sees it."""

from __future__ import annotations

import pydantic
import pytest

from exgrpo_client import schemas as s
from exgrpo_pool.service.convert import pool_config, rules_for, run_overrides
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import PoolRow, RunRow

from .factories import ok, setup_pool
from .harness import Backend, serve_app


async def _rows(app: object, run: str = "r1") -> tuple[PoolRow, RunRow]:
    ctx = app.state.ctx  # type: ignore[attr-defined]
    async with ctx.db.read() as session:
        found = await repo.run_rows(session, "p1", run)
    assert found is not None
    return found[0], found[1]


async def test_a_stored_config_is_validated_once_and_a_change_is_read(backend: Backend) -> None:
    async with serve_app(backend.settings()) as (app, client):
        await setup_pool(client, "p1", questions=4, runs=("r1", "r2"))
        (pool_a, run_a), (pool_b, run_b) = await _rows(app), await _rows(app)
        assert isinstance(pool_a.config, str) and isinstance(run_a.overrides, str)
        config = pool_config(pool_a)
        assert isinstance(config, s.PoolConfig)
        assert config.model_dump() == s.PoolConfig.model_validate_json(pool_a.config).model_dump()
        # one model for the rows of the same text, which no one can change under the others
        assert pool_config(pool_b) is config
        assert run_overrides(run_b) is run_overrides(run_a)
        with pytest.raises(pydantic.ValidationError):
            config.batch_size = 3
        with pytest.raises(pydantic.ValidationError):
            run_overrides(run_a).batch_size = 3
        assert config.batch_size == pool_config(pool_b).batch_size != 3
        assert config.model_copy(update={"batch_size": 3}).batch_size == 3
        # the same answers as the models validated from the text each time
        assert rules_for(pool_a, run_a) == rules_for(pool_b, run_b)

        ok(await client.patch("/v1/pools/p1", json={"config": {"batch_size": 24, "experience_ratio": 0.25}}))
        r = await client.patch("/v1/pools/p1/runs/r2", json={"overrides": {"batch_size": 6}})
        ok(r)
        pool_c, run_c = await _rows(app, "r2")
        assert pool_config(pool_c) is not config
        assert (pool_config(pool_c).batch_size, pool_config(pool_c).experience_ratio) == (24, 0.25)
        assert run_overrides(run_c).batch_size == 6 and run_overrides(run_c) is not run_overrides(run_b)
        assert rules_for(pool_c, run_c).batch_size == 6 and rules_for(pool_c).batch_size == 24
        # the run and pool answers show them
        assert ok(await client.get("/v1/pools/p1"))["config"]["batch_size"] == 24
        assert ok(await client.get("/v1/pools/p1/runs/r2"))["overrides"]["batch_size"] == 6
        assert ok(await client.get("/v1/pools/p1/runs/r1"))["overrides"]["batch_size"] is None
