"""`exgrpo serve --workers N`: N service processes on one listening socket, real processes.

* On Postgres + Redis (a fresh database, migrated by `exgrpo serve` itself): the parent has two
  worker processes, both accept connections (seen from the operating system: which process holds
  the server end of each client connection), `/metrics` asked of either worker counts the requests
  of both, the migrations ran once, and SIGTERM to the parent or Ctrl-C (SIGINT to the process
  group, as a terminal sends it) leaves no process behind.
* A worker that dies stops the service: the others are stopped, the parent names the dead worker
  and exits non-zero.
* Without Redis, N > 1 is refused before anything starts: the in-process sampling index cannot be
  shared between processes.

Linux only: the processes and their sockets are read from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from faults.procs import free_port
from service.harness import REDIS_URL, delete_prefix, fresh_pg_database

from exgrpo_pool.store.db import MIGRATIONS_DIR

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

EXGRPO = Path(sys.executable).with_name("exgrpo")
HEALTHZ_COUNT = re.compile(
    r'^exgrpo_http_request_seconds_count\{method="GET",route="/healthz",status="200"\} (\S+)$', re.M
)


# ------------------------------------------------------------------------------ processes
def children(pid: int) -> set[int]:
    """The processes whose parent is `pid`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # the command name is in parentheses and may hold spaces: the fields follow the last ')'
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def server_side_owner(pids: set[int], server_port: int, client_port: int) -> int | None:
    """Which of `pids` holds the server end of the loopback TCP connection from `client_port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                if int(local.rsplit(":", 1)[1], 16) == server_port and (
                    int(remote.rsplit(":", 1)[1], 16) == client_port
                ):
                    inodes.add(f"socket:[{inode}]")
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return pid
    return None


@dataclass
class Service:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, workers: int) -> set[int]:
        """Until every worker has started and /readyz answers 200; answers the workers' pids."""
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"the service exited: {self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"the service did not get ready: {self.text()[-3000:]}"
            pids = children(self.proc.pid)
            if len(pids) >= workers and self.text().count("pool service ready") >= workers:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                        return pids
            time.sleep(0.2)

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the service did not stop: {self.text()[-3000:]}")


@contextlib.contextmanager
def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Service]:
    """`exgrpo serve --anonymous <args>` on a free loopback port, in a session of its own (so
    that a test can send SIGINT to its process group, as Ctrl-C does); killed with every process
    it left if the test did not stop it."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_")}
    base |= {"EXGRPO_LOG_FORMAT": "plain", **(env or {})}
    command = [str(EXGRPO), "serve", "--anonymous", "--host", "127.0.0.1", "--port", str(port), *args]
    log = tmp_path / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=base, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield Service(proc, port, log)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"exgrpo-workers-{secrets.token_hex(6)}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    try:
        delete_prefix(client, prefix)
    finally:
        client.close()


@contextlib.contextmanager
def two_workers_on_postgres(tmp_path: Path, redis_prefix: str) -> Iterator[Service]:
    """`exgrpo serve --workers 2` on a fresh Postgres database and Redis."""
    with (
        fresh_pg_database("exgrpo_workers") as database_url,
        serve(
            tmp_path,
            "--workers",
            "2",
            "--database-url",
            database_url,
            "--redis-url",
            REDIS_URL,
            env={"EXGRPO_REDIS_PREFIX": redis_prefix},
        ) as service,
    ):
        yield service


# ------------------------------------------------------------------------------ the tests
POOL = {"name": "p", "description": "", "config": {"k": 4, "batch_size": 2}}


def question(text: str) -> dict[str, object]:
    return {"prompt": [{"role": "user", "content": text}], "ground_truth": "1"}


def healthz_count(conn: http.client.HTTPConnection) -> float:
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    body = response.read().decode()
    assert response.status == 200, body
    match = HEALTHZ_COUNT.search(body)
    assert match, body[:3000]
    return float(match.group(1))


def connections_per_worker(service: Service, workers: set[int]) -> dict[int, http.client.HTTPConnection]:
    """Open connections (each answered once) until every worker holds one; the rest are closed."""
    held: dict[int, http.client.HTTPConnection] = {}
    for _ in range(200):
        conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        assert conn.sock is not None
        owner = server_side_owner(workers, service.port, conn.sock.getsockname()[1])
        assert owner in workers, f"connection held by {owner}, not by a worker of {workers}"
        if owner in held:
            conn.close()
        else:
            held[owner] = conn
        if len(held) == len(workers):
            return held
    pytest.fail(f"200 connections, all accepted by {sorted(held)} of the workers {sorted(workers)}")


def test_two_workers_on_postgres_and_redis(tmp_path: Path, redis_prefix: str) -> None:
    with two_workers_on_postgres(tmp_path, redis_prefix) as service:
        workers = service.wait_ready(2)
        assert len(workers) == 2, workers
        held = connections_per_worker(service, workers)
        # every connection above made one /healthz request; then each worker answers some more
        extra = {pid: 3 + i for i, pid in enumerate(sorted(held))}
        for pid, conn in held.items():
            for _ in range(extra[pid]):
                conn.request("GET", "/healthz")
                response = conn.getresponse()
                response.read()
                assert response.status == 200
        # /metrics of either worker: the sum over both (the metrics requests are another route)
        counts = {pid: healthz_count(conn) for pid, conn in held.items()}
        assert counts[min(held)] == counts[max(held)], counts
        first_requests = counts[min(held)] - sum(extra.values())
        assert first_requests >= 2, counts  # at least the first request of each held connection
        for conn in held.values():
            conn.close()

        # a write through the service, then the database is at the latest revision, migrated once
        created = httpx.post(f"{service.url}/v1/pools", json=POOL, timeout=30)
        assert created.status_code == 201, created.text
        migrations = len(list((MIGRATIONS_DIR / "versions").glob("[0-9]*.py")))
        assert service.text().count("Running upgrade") == migrations, service.text()[-3000:]

        # SIGTERM to the parent stops every worker, and the parent exits
        service.proc.send_signal(signal.SIGTERM)
        assert service.wait_exit() == 0, service.text()[-3000:]
        assert not [pid for pid in workers if alive(pid)], service.text()[-3000:]


def test_ctrl_c_stops_every_worker(tmp_path: Path, redis_prefix: str) -> None:
    with two_workers_on_postgres(tmp_path, redis_prefix) as service:
        workers = service.wait_ready(2)
        os.killpg(service.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert service.wait_exit() == 0, service.text()[-3000:]
        assert not [pid for pid in workers if alive(pid)], service.text()[-3000:]
        assert "Traceback" not in service.text(), service.text()[-3000:]


def test_a_dead_worker_stops_the_service(tmp_path: Path, redis_prefix: str) -> None:
    with two_workers_on_postgres(tmp_path, redis_prefix) as service:
        workers = service.wait_ready(2)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        assert service.wait_exit() != 0, service.text()[-3000:]
        assert not [pid for pid in workers if alive(pid)], service.text()[-3000:]
        assert re.search(rf"worker {victim} .*SIGKILL", service.text()), service.text()[-3000:]


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_several_workers_need_redis(tmp_path: Path, how: str) -> None:
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    args, env = ("--workers", "2"), {}
    if how == "environment":
        args, env = (), {"EXGRPO_WORKERS": "3"}
    with serve(tmp_path, "--database-url", database_url, *args, env=env) as service:
        assert service.wait_exit(timeout=60) != 0
        text = service.text()
    assert "redis_url" in text and "in-process sampling index" in text, text[-3000:]
    assert not (tmp_path / "pool.db").exists(), "refused before anything started"


def test_sqlite_with_redis_serves_with_two_workers(tmp_path: Path, redis_prefix: str) -> None:
    """SQLite may be shared by the workers when the index is in Redis: writes through both
    workers at once all land (each write transaction takes SQLite's write lock when it begins)."""
    database_url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
    args = ("--workers", "2", "--database-url", database_url, "--redis-url", REDIS_URL)
    with serve(tmp_path, *args, env={"EXGRPO_REDIS_PREFIX": redis_prefix}) as service:
        service.wait_ready(2)
        created = httpx.post(f"{service.url}/v1/pools", json=POOL, timeout=30)
        assert created.status_code == 201, created.text

        async def imports() -> list[httpx.Response]:
            limits = httpx.Limits(max_keepalive_connections=0)  # a new connection, any worker
            async with httpx.AsyncClient(base_url=service.url, timeout=60, limits=limits) as client:
                return await asyncio.gather(
                    *(
                        client.post(
                            "/v1/pools/p/questions",
                            json={"questions": [question(f"q{i}-{j}") for j in range(5)]},
                        )
                        for i in range(20)
                    )
                )

        answers = asyncio.run(imports())
        assert [r.status_code for r in answers if r.status_code >= 300] == [], answers[0].text
        stats = httpx.get(f"{service.url}/v1/pools/p", timeout=30)
        assert stats.status_code == 200, stats.text
        assert stats.json()["num_questions"] == 100, stats.text
        service.proc.send_signal(signal.SIGTERM)
        assert service.wait_exit() == 0, service.text()[-3000:]
