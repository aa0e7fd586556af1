"""A failure nobody planned for (here a table of the database gone, caused for real) is answered
like every other error: problem+json 500 with the request id, in the access log, counted by
`exgrpo_http_request_seconds` (what the 5xx alert reads), and the keep-alive connection stays open."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import httpx
import pytest
from service.harness import Backend

pytestmark = pytest.mark.faults

METRICS_ROUTE = "/v1/pools/{pool}/runs/{run}/metrics"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _captured(name: str) -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _sql(backend: Backend, statement: str) -> None:
    """Run one statement on the service's database from outside the service."""
    if backend.uses_redis:

        async def run() -> None:
            url = backend.database_url.replace("postgresql+asyncpg://", "postgresql://")
            conn = await asyncpg.connect(url, timeout=10)
            try:
                await conn.execute(statement)
            finally:
                await conn.close()

        asyncio.run(run())
        return
    import sqlite3

    with contextlib.closing(sqlite3.connect(backend.database_url.split("///", 1)[1])) as conn:
        conn.execute(statement)
        conn.commit()


def _http(sock: socket.socket, path: str) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on an open connection, and its whole answer."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: pool.test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection instead of answering GET {path}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed in the middle of an answer"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _observations(metrics_text: str, route: str, status: str) -> float:
    prefix = "exgrpo_http_request_seconds_count{"
    for line in metrics_text.splitlines():
        if line.startswith(prefix) and f'route="{route}"' in line and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_unhandled_error_is_logged_counted_and_keeps_the_connection(
    backend: Backend, start_live_server: Callable[..., Any]
) -> None:
    settings = {"redis_url": backend.redis_url, "redis_prefix": backend.redis_prefix, "log_level": "INFO"}
    with start_live_server(backend.database_url, **settings) as server:
        http = httpx.Client(base_url=server.url, timeout=30)
        assert http.post("/v1/pools", json={"name": "p1"}).status_code == 201
        assert http.post("/v1/pools/p1/runs", json={"name": "r1"}).status_code == 201
        assert http.get("/v1/pools/p1/runs/r1/metrics").status_code == 200
        _sql(backend, "ALTER TABLE run_metric RENAME TO run_metric_gone")
        try:
            with _captured("exgrpo.access") as access, _captured("exgrpo.pool") as errors:
                host, port = server.url.removeprefix("http://").split(":")
                with socket.create_connection((host, int(port)), timeout=30) as sock:
                    status, headers, body = _http(sock, "/v1/pools/p1/runs/r1/metrics")
                    # the same connection answers the next request
                    after, _, health = _http(sock, "/healthz")
        finally:
            _sql(backend, "ALTER TABLE run_metric_gone RENAME TO run_metric")

        assert status == 500
        assert headers["content-type"] == "application/problem+json"
        assert headers.get("connection", "").lower() != "close"
        problem = json.loads(body)
        assert problem["status"] == 500 and problem["request_id"] == headers["x-request-id"]
        assert after == 200 and json.loads(health) == {"status": "ok"}

        lines = [getattr(r, "fields", {}) for r in access.records]
        assert {"route": METRICS_ROUTE, "status": 500, "request_id": problem["request_id"]}.items() <= next(
            f.items() for f in lines if f.get("status") == 500
        )
        failed = [r for r in errors.records if r.levelno >= logging.ERROR]
        assert failed and failed[0].exc_info is not None
        assert getattr(failed[0], "fields", {})["request_id"] == problem["request_id"]

        metrics = http.get("/metrics").text
        assert _observations(metrics, METRICS_ROUTE, "500") == 1
        assert _observations(metrics, METRICS_ROUTE, "200") == 1
        # and the route works again once its table is back
        assert http.get("/v1/pools/p1/runs/r1/metrics").status_code == 200
        http.close()
