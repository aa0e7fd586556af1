"""The access log line of `Observability` names the request's path as Starlette's URL of the
request gives it (escaped where a path could be read as a query or a fragment)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.datastructures import URL

from exgrpo_pool.app import Observability
from exgrpo_pool.metrics import Metrics

PATHS = [
    "/v1/pools/p/runs/r/batches",
    "/v1/pools/a?b/runs",
    "/a#b",
    "/a\\b",
    "/caf\u00e9/%2F",
    "//twice",
    "/",
]


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("path", PATHS)
async def test_the_logged_path_is_the_urls_path(path: str, caplog: pytest.LogCaptureFixture) -> None:
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"x=1",
        "headers": [(b"host", b"pool.example:8080")],
        "server": ("127.0.0.1", 8080),
        "scheme": "http",
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO, logger="exgrpo.access"):
        await Observability(_answer, Metrics())(scope, receive, send)
    (line,) = [r for r in caplog.records if r.name == "exgrpo.access"]
    fields = line.__dict__["fields"]
    assert fields["path"] == URL(scope=scope).path
    assert fields["status"] == 200 and sent[0]["status"] == 200
