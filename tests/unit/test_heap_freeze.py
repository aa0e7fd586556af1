"""A serving process leaves its start-up objects out of later garbage collections."""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

from exgrpo_pool.app import YOUNG_OBJECTS_PER_PASS, collect_young_less_often, create_app
from exgrpo_pool.config import Settings


def _settings(tmp_path: Path) -> Settings:
    return Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/pool.db", log_level="WARNING"
    )


async def test_a_serving_app_freezes_what_start_up_left(tmp_path: Path) -> None:
    gc.unfreeze()
    thresholds = gc.get_threshold()
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
        gc.set_threshold(*thresholds)


async def test_an_app_in_another_program_freezes_nothing(tmp_path: Path) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    async with LifespanManager(create_app(_settings(tmp_path))):
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before  # nor changes when the collector runs


async def test_a_serving_app_collects_young_objects_less_often(tmp_path: Path) -> None:
    """A commit's ~10k objects are freed before the collector's youngest pass sees them; the
    older generations' thresholds stay."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        async with LifespanManager(create_app(_settings(tmp_path), freeze_heap=True)):
            assert gc.get_threshold() == (YOUNG_OBJECTS_PER_PASS, 10, 10)
            assert YOUNG_OBJECTS_PER_PASS >= 50_000
            gc.set_threshold(200_000, 5, 5)
            collect_young_less_often()  # never lowers it
            assert gc.get_threshold() == (200_000, 5, 5)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


# A serving process keeps the memory its requests free for the next ones. glibc gives a freed
# buffer of more than its (adaptive) bound back to the system, and the next request that needs one
# is handed fresh pages, each a page fault; a 256-group ingest on Postgres took ~2,700 of them
# and ~4 ms of system time before `keep_freed_memory`.
_CYCLES = """
import resource
def cycle():
    bufs = [b"\\x01" * (20 << 20) for _ in range(3)]
    del bufs
cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

_SERVING = """
import asyncio, sys
from asgi_lifespan import LifespanManager
from exgrpo_pool.app import YOUNG_OBJECTS_PER_PASS, collect_young_less_often, create_app
from exgrpo_pool.config import Settings
settings = Settings(allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{sys.argv[1]}/pool.db",
                    log_level="WARNING")
async def serve() -> None:
    async with LifespanManager(create_app(settings, freeze_heap=True)):
        pass
asyncio.run(serve())
"""


def _faults_of_a_warm_cycle(prelude: str, *args: str) -> int:
    """Page faults of allocating and freeing three 20 MB buffers, after two such cycles."""
    done = subprocess.run(
        [sys.executable, "-c", prelude + _CYCLES, *args], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator's bounds are glibc's")
def test_a_serving_process_reuses_the_memory_requests_free(tmp_path: Path) -> None:
    # 15,360 pages are touched per cycle: a plain process faults on most of them every time
    assert _faults_of_a_warm_cycle("") > 5_000
    assert _faults_of_a_warm_cycle(_SERVING, str(tmp_path)) < 500


def test_an_app_in_another_program_leaves_the_allocator_alone(tmp_path: Path) -> None:
    prelude = _SERVING.replace("freeze_heap=True", "freeze_heap=False")
    assert _faults_of_a_warm_cycle(prelude, str(tmp_path)) > 5_000
