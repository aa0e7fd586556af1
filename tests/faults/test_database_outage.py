"""The database going away under the service (a Postgres cluster of the test's own, stopped and
started again): requests answer 503 problem+json with Retry-After, not 500, and the service
answers normally once the database is back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from service.factories import ok, setup_pool
from service.harness import Backend, serve

from .procs import free_port

pytestmark = [pytest.mark.faults, pytest.mark.postgres]


def _pg_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        pytest.fail("pg_ctl not found: install postgresql (scripts/services.sh does)")
    return found[-1].parent


class OwnPostgres:
    """A throwaway cluster on a free port, run as the postgres user (initdb refuses root)."""

    def __init__(self, root: Path) -> None:
        self.bin = _pg_bin()
        self.data = root / "data"
        self.port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        shutil.chown(root, "postgres", "postgres")
        self._as_postgres([str(self.bin / "initdb"), "-A", "trust", "-U", "postgres", "-D", str(self.data)])

    def _as_postgres(self, cmd: list[str]) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run(prefix + cmd, check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.data} -c fsync=off -c listen_addresses=127.0.0.1"
        log = str(self.data.parent / "server.log")  # the server must not hold our output pipes
        self._as_postgres(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", log, "-o", opts, "-w", "start"]
        )

    def stop(self) -> None:
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    # pytest's tmp_path sits under folders only root may enter; the cluster's user must reach it
    root = Path(tempfile.mkdtemp(prefix="exgrpo-pg-"))
    root.chmod(0o755)
    try:
        pg = OwnPostgres(root / "pg")
        pg.start()
        try:
            yield pg
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                pg.stop()  # unless the test left it stopped
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text}"
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["retry-after"] == "1"
    assert "database" in r.json()["detail"]


async def test_database_stopped_answers_503_then_recovers(own_postgres: OwnPostgres) -> None:
    backend = Backend("own-postgres", own_postgres.url, None, "")
    async with serve(backend.settings()) as client:
        await setup_pool(client, questions=8)
        before = ok(await client.get("/v1/pools/p1"))

        own_postgres.stop()
        _unavailable(await client.get("/v1/pools/p1"))
        _unavailable(await client.post("/v1/pools/p1/runs/r1/batches", json={}))
        _unavailable(await client.post("/v1/pools", json={"name": "p2", "config": {"k": 4}}))

        own_postgres.start()
        for _ in range(3):  # the pool drops the connections the restart broke, then reconnects
            r = await client.get("/v1/pools/p1")
            if r.status_code == 200:
                break
            _unavailable(r)
        assert r.status_code == 200 and r.json()["num_questions"] == before["num_questions"]
        assert (await client.get("/v1/pools/p2")).status_code == 404  # the refused write left nothing


async def test_connections_the_server_closed_are_replaced_without_an_error(own_postgres: OwnPostgres) -> None:
    """The server ends every session of the service (a restart, a failover, an idle timeout of a
    proxy): the pooled connections it closed are dropped when the service next takes them, and no
    request fails for it."""
    backend = Backend("own-postgres", own_postgres.url, None, "")
    async with serve(backend.settings()) as client:
        await setup_pool(client, questions=8)
        # several requests at once: the pool holds more than one connection
        await asyncio.gather(*(client.get("/v1/pools/p1") for _ in range(4)))
        admin = await asyncpg.connect(own_postgres.url.replace("+asyncpg", ""))
        try:
            pids = [
                r["pid"]
                for r in await admin.fetch(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
                )
            ]
            ended = await admin.fetchval(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM unnest($1::int[]) AS pid", pids
            )
            # a terminated backend exits when it gets to it: wait until all are gone (a busy
            # machine can take longer than the wait below)
            deadline = time.monotonic() + 30
            while await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)", pids):
                assert time.monotonic() < deadline, "terminated backends still there after 30 s"
                await asyncio.sleep(0.05)
        finally:
            await admin.close()
        assert ended >= 1
        await asyncio.sleep(0.2)  # the servers' close reaches the service's event loop
        answers = await asyncio.gather(*(client.get("/v1/pools/p1") for _ in range(4)))
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        ok(await client.post("/v1/pools/p1/runs/r1/batches", json={}), 201)
