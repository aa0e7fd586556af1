"""Retries: which failures are retried, and that a retried write keeps its idempotency key.

A connection that fails, or a response lost after the service applied a write, cannot be caused
on demand with a real server, so `httpx.MockTransport` plays the network: it fails the chosen
attempts and hands the others to the real app.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from exgrpo_client import (
    AsyncClient,
    BadRequest,
    Client,
    NotFound,
    RateLimited,
    ServerError,
    TransportError,
)
from exgrpo_client._base import RetryPolicy
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

POOL_JSON = {
    "id": 1,
    "name": "p1",
    "description": "",
    "config": {"k": 8},
    "num_questions": 0,
    "num_trajectories": 0,
    "num_runs": 0,
    "created_at": "2026-01-01T00:00:00Z",
    "updated_at": "2026-01-01T00:00:00Z",
}


class Network:
    """Plays the network: `script` says, attempt by attempt, what happens to a request."""

    def __init__(self, script: list[Callable[[httpx.Request], httpx.Response]]) -> None:
        self.script = script
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.script[min(len(self.requests), len(self.script)) - 1]
        return step(request)


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def status(code: int, **headers: str) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        body = {"title": "t", "status": code, "detail": f"status {code}", "request_id": "r"}
        return httpx.Response(code, json=body, headers=headers)

    return answer


def pool_ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=POOL_JSON)


def _client(network: Network, retries: int = 3) -> Client:
    return Client("http://pool.test", transport=httpx.MockTransport(network), retries=retries, backoff=0)


# ---------------------------------------------------------------------------- sync, mocked only
def test_transient_statuses_are_retried() -> None:
    network = Network([status(503), status(502), status(429, **{"retry-after": "0"}), pool_ok])
    with _client(network) as client:
        assert client.get_pool("p1").name == "p1"
    assert len(network.requests) == 4
    assert len({r.headers["x-request-id"] for r in network.requests}) == 1  # one call, one request id


@pytest.mark.parametrize(
    ("code", "error"),
    [(404, NotFound), (422, BadRequest), (500, ServerError)],
    ids=["404", "422", "500"],
)
def test_other_errors_are_not_retried(code: int, error: type[Exception]) -> None:
    network = Network([status(code), pool_ok])
    with _client(network) as client, pytest.raises(error, match=f"status {code}"):
        client.get_pool("p1")
    assert len(network.requests) == 1


def test_retries_run_out() -> None:
    network = Network([status(429)])
    with _client(network, retries=2) as client, pytest.raises(RateLimited):
        client.get_pool("p1")
    assert len(network.requests) == 3

    refused = Network([refuse])
    with _client(refused, retries=2) as client, pytest.raises(TransportError, match=r"failed \(3 times\)"):
        client.list_pools()
    assert len(refused.requests) == 3

    once = Network([refuse])
    with _client(once, retries=0) as client, pytest.raises(TransportError, match="failed \\(once\\)"):
        client.list_pools()
    assert len(once.requests) == 1


def test_each_write_gets_its_own_key_and_reads_none() -> None:
    network = Network([pool_ok])
    with _client(network) as client:
        client.create_pool("p1")
        client.create_pool("p1")
        client.get_pool("p1")
    keys = [r.headers.get("idempotency-key") for r in network.requests]
    assert keys[0] and keys[1] and keys[0] != keys[1] and keys[2] is None


def test_readiness_503_is_an_answer() -> None:
    body = {"status": "unavailable", "checks": {"database": "error: OperationalError", "index": "ok"}}
    network = Network([lambda r: httpx.Response(503, json=body)])
    with _client(network) as client:
        ready = client.ready()
    assert not ready.ok and ready.checks["database"].startswith("error")
    assert len(network.requests) == 1


def test_a_pool_upload_is_resent_only_when_it_never_arrived(tmp_path: Path) -> None:
    export = tmp_path / "p.ndjson"
    export.write_bytes(b'{"type":"header"}\n' * 3)
    answer = {"pool": "p", "questions": 0, "runs": 0, "states": 0, "trajectories": 0, "duplicates": 0}
    bodies: list[bytes] = []

    def accept(request: httpx.Request) -> httpx.Response:
        bodies.append(request.read())
        return httpx.Response(201, json=answer)

    network = Network([refuse, status(503), accept])
    with _client(network) as client:
        assert client.import_pool(export).pool == "p"
    assert len(network.requests) == 3 and bodies == [export.read_bytes()]
    assert network.requests[-1].headers["content-type"] == "application/x-ndjson"

    gateway = Network([status(504), accept])
    with _client(gateway) as client, pytest.raises(ServerError):
        client.import_pool(export)  # it may have been imported: not sent again
    assert len(gateway.requests) == 1

    unseekable = Network([refuse, accept])

    class Pipe(io.BytesIO):
        def seekable(self) -> bool:
            return False

    with _client(unseekable) as client, pytest.raises(TransportError):
        client.import_pool(Pipe(export.read_bytes()))
    assert len(unseekable.requests) == 1


# ------------------------------------------------------------------------ sync, real server
def test_sync_write_retried_after_a_refused_connection(live_server: Any, pool_name: str) -> None:
    real = httpx.HTTPTransport()

    def forward(request: httpx.Request) -> httpx.Response:
        response = real.handle_request(request)
        response.read()
        return response

    network = Network([refuse, forward])
    with Client(live_server.url, transport=httpx.MockTransport(network), backoff=0) as client:
        assert client.create_pool(pool_name).name == pool_name
    first, second = network.requests
    assert first.headers["idempotency-key"] == second.headers["idempotency-key"]
    with Client(live_server.url) as client:
        assert client.get_pool(pool_name).num_questions == 0
    real.close()


# ------------------------------------------------------------------------- async, real app
@pytest.fixture
async def asgi(tmp_path: Path) -> AsyncIterator[httpx.ASGITransport]:
    settings = Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/pool.db", log_level="WARNING"
    )
    async with LifespanManager(create_app(settings)) as manager:
        yield httpx.ASGITransport(app=manager.app)


async def test_async_write_retried_with_the_same_key(asgi: httpx.ASGITransport) -> None:
    keys: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["idempotency-key"])
        if len(keys) == 1:
            raise httpx.ConnectError("connection refused", request=request)
        return await asgi.handle_async_request(request)

    async with AsyncClient("http://pool.test", transport=httpx.MockTransport(handler), backoff=0) as client:
        pool = await client.create_pool("p1", {"k": 4})
    assert pool.name == "p1" and len(keys) == 2 and keys[0] == keys[1]


async def test_lost_response_is_replayed_not_applied_twice(asgi: httpx.ASGITransport) -> None:
    """The service applied the write, the answer was lost; the retry gets the first answer."""
    answers: list[httpx.Response] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        response = await asgi.handle_async_request(request)
        await response.aread()
        answers.append(response)
        if request.method == "POST" and len(answers) == 1:
            raise httpx.ReadError("connection reset by peer", request=request)
        return response

    async with AsyncClient("http://pool.test", transport=httpx.MockTransport(handler), backoff=0) as client:
        pool = await client.create_pool("p1", {"k": 4})
        assert pool.name == "p1"
        assert [r.status_code for r in answers] == [201, 201]
        assert answers[1].headers.get("idempotent-replayed") == "true"
        assert (await client.list_pools()).count == 1


async def test_async_retries_run_out(asgi: httpx.ASGITransport) -> None:
    attempts = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        return httpx.Response(503, json={"title": "Unavailable", "status": 503, "detail": "overloaded"})

    async with AsyncClient(
        "http://pool.test", transport=httpx.MockTransport(handler), retries=2, backoff=0
    ) as client:
        with pytest.raises(ServerError, match="overloaded"):
            await client.health()
    assert attempts == 3


# ------------------------------------------------------------------------ streams that break
HEADER_LINE = (
    b'{"type":"header","kind":"exgrpo-pool-export","format_version":1,'
    b'"pool":{"name":"p"},"num_questions":0,"num_trajectories":0,"num_runs":0}\n'
)


class BrokenStream(httpx.SyncByteStream):
    """An export whose connection drops after the header line."""

    def __iter__(self) -> Any:
        yield HEADER_LINE[:20]
        yield HEADER_LINE[20:]
        raise httpx.ReadError("connection reset by peer")


def test_a_broken_export_leaves_no_file(tmp_path: Path) -> None:
    network = Network([lambda r: httpx.Response(200, stream=BrokenStream())])
    with _client(network) as client, pytest.raises(TransportError, match="ReadError"):
        client.export_pool("p", tmp_path / "p.ndjson")
    assert list(tmp_path.iterdir()) == []

    missing = Network([status(404)])
    with _client(missing) as client, pytest.raises(NotFound, match="status 404"):
        client.export_pool("p", tmp_path / "p.ndjson")
    assert list(tmp_path.iterdir()) == []

    def fail(done: int, total: int | None) -> None:
        raise KeyboardInterrupt

    interrupted = Network([lambda r: httpx.Response(200, content=HEADER_LINE)])
    with _client(interrupted) as client, pytest.raises(KeyboardInterrupt):
        client.export_pool("p", tmp_path / "p.ndjson", progress=fail)
    assert list(tmp_path.iterdir()) == []


async def test_async_upload_resent_after_a_refused_connection() -> None:
    bodies: list[bytes] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(await request.aread())
        if len(bodies) == 1:
            raise httpx.ConnectError("connection refused", request=request)
        answer = {"pool": "p", "questions": 1, "runs": 0, "states": 0, "trajectories": 0, "duplicates": 0}
        return httpx.Response(201, json=answer)

    async with AsyncClient("http://pool.test", transport=httpx.MockTransport(handler), backoff=0) as client:
        assert (await client.import_pool(io.BytesIO(b"line\n" * 4))).questions == 1
        with pytest.raises(ValueError, match="no questions"):
            await client.import_questions("p", [])
    assert bodies[-1] == b"line\n" * 4 and len(bodies) == 2


async def test_async_transport_error_after_the_retries() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=request)

    async with AsyncClient(
        "http://pool.test", transport=httpx.MockTransport(handler), retries=1, backoff=0
    ) as c:
        with pytest.raises(TransportError, match=r"failed \(2 times\): ConnectTimeout"):
            await c.list_pools()
        with pytest.raises(TransportError, match="ConnectTimeout"):
            await c.import_pool(io.BytesIO(b"x\n"))


def test_no_timeout_and_a_non_object_answer() -> None:
    network = Network([lambda r: httpx.Response(200, json=[1, 2])])
    with Client("http://pool.test", transport=httpx.MockTransport(network), timeout=None) as client:
        with pytest.raises(ValueError, match="no questions"):
            client.import_questions("p", [])
        with pytest.raises(Exception, match="expected a JSON object"):
            client.rebuild_index()
    assert network.requests[0].extensions["timeout"] == {
        "connect": None,
        "read": None,
        "write": None,
        "pool": None,
    }


# -------------------------------------------------------------------------- the time budget
def test_budget_replaces_the_count_of_retries() -> None:
    counted = RetryPolicy(retries=2, backoff=1.0, max_delay=4.0)
    assert counted.next_delay(1, elapsed=1e6) is not None and counted.next_delay(2, elapsed=0.0) is None
    budget = RetryPolicy(retries=2, backoff=1.0, max_delay=4.0, budget_s=10.0)
    # far more retries than `retries`, the back-off capped at max_delay
    assert 2.0 <= (budget.next_delay(50, elapsed=0.0) or 0) <= 4.0
    # the last wait ends at the budget's end; past it, no retry
    assert budget.next_delay(3, elapsed=9.5) == pytest.approx(0.5)
    assert budget.next_delay(0, elapsed=10.0) is None
    assert RetryPolicy(backoff=0.5, budget_s=0.0).next_delay(0, elapsed=0.0) is None
    with pytest.raises(ValueError, match="budget_s"):
        RetryPolicy(budget_s=-1.0)


def test_budget_retries_transient_statuses_until_it_is_spent() -> None:
    network = Network([status(503)])
    start = time.monotonic()
    with (
        Client(
            "http://pool.test",
            transport=httpx.MockTransport(network),
            retries=1,
            backoff=0.01,
            retry_budget_s=0.5,
        ) as client,
        pytest.raises(ServerError),
    ):
        client.get_pool("p1")
    assert time.monotonic() - start >= 0.5
    assert len(network.requests) > 2  # more than `retries` allows: the budget decides
    # errors that are not transient are still final at once
    final = Network([status(422), pool_ok])
    with (
        Client(
            "http://pool.test", transport=httpx.MockTransport(final), backoff=0.01, retry_budget_s=30
        ) as client,
        pytest.raises(BadRequest),
    ):
        client.get_pool("p1")
    assert len(final.requests) == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_refused_call_fails_when_the_budget_is_spent() -> None:
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with (
        Client(url, retries=1, backoff=0.01, retry_budget_s=0.3) as client,
        pytest.raises(TransportError) as failed,
    ):
        client.list_pools()
    tries = re.search(r"failed \((\d+) times\)", str(failed.value))
    assert tries is not None and int(tries.group(1)) > 2


def test_sync_calls_ride_through_a_service_that_is_down(
    tmp_path: Path, start_live_server: Callable[..., contextlib.AbstractContextManager[Any]], pool_name: str
) -> None:
    """The service is down when the call starts (connections refused) and comes up a moment
    later: the call, which `retries` alone would have given up, succeeds within its budget."""
    port = _free_port()
    got: dict[str, Any] = {}

    def call() -> None:
        with Client(f"http://127.0.0.1:{port}", retries=0, backoff=0.05, retry_budget_s=120) as client:
            try:
                got["pool"] = client.create_pool(pool_name)
            except Exception as e:  # handed to the test below
                got["error"] = e

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)
    assert caller.is_alive() and not got  # still retrying against a closed port
    with start_live_server(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", port=port) as server:
        caller.join(120)
        assert not caller.is_alive() and "error" not in got, got
        assert got["pool"].name == pool_name
        with Client(server.url) as client:
            assert [p.name for p in client.list_pools().data] == [pool_name]


async def test_async_calls_ride_through_a_service_that_is_down(
    tmp_path: Path, start_live_server: Callable[..., contextlib.AbstractContextManager[Any]], pool_name: str
) -> None:
    port = _free_port()
    up = threading.Event()
    done = threading.Event()

    def service() -> None:
        up.wait()
        with start_live_server(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", port=port):
            done.wait(120)

    server = threading.Thread(target=service)
    server.start()
    try:
        async with AsyncClient(
            f"http://127.0.0.1:{port}", retries=0, backoff=0.05, retry_budget_s=120
        ) as client:
            call = asyncio.ensure_future(client.create_pool(pool_name))
            await asyncio.sleep(1.0)
            assert not call.done()  # still retrying against a closed port
            up.set()
            pool = await asyncio.wait_for(call, 120)
            assert pool.name == pool_name
            assert (await client.get_pool(pool_name)).name == pool_name
    finally:
        up.set()
        done.set()
        server.join(30)
