"""A serving process leaves its start-up objects out of later garbage collections."""

from __future__ import annotations

import gc
from pathlib import Path

import httpx
from asgi_lifespan import LifespanManager

from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings


def _settings(tmp_path: Path) -> Settings:
    return Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/pool.db", log_level="WARNING"
    )


async def test_a_serving_app_freezes_what_start_up_left(tmp_path: Path) -> None:
    gc.unfreeze()
    try:
        app = create_app(_settings(tmp_path), freeze_heap=True)
        assert gc.get_freeze_count() == 0
        async with LifespanManager(app) as manager:
            # the modules, routes, schemas and the app itself: tens of thousands of objects
            assert gc.get_freeze_count() > 10_000
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://pool.test") as c:
                assert (await c.get("/healthz")).status_code == 200
                # what requests make afterwards is collected as before (frozen objects that lose
                # their last reference are still freed, so the count may only go down)
                frozen = gc.get_freeze_count()
                assert (await c.post("/v1/pools", json={"name": "p"})).status_code == 201
                assert gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


async def test_an_app_in_another_program_freezes_nothing(tmp_path: Path) -> None:
    gc.unfreeze()
    async with LifespanManager(create_app(_settings(tmp_path))):
        assert gc.get_freeze_count() == 0
