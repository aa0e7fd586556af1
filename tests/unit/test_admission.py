"""Admission: at most `limit` requests worked on at once, the rest queued in arrival order; a
place is given back when the answer starts and while a request `idle`s; health checks never wait."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge
from starlette.types import Message, Receive, Scope, Send

from exgrpo_pool.admission import Admission, idle

Handler = Callable[[str], Awaitable[None]]


def _gauge() -> Gauge:
    return Gauge("waiting", "requests waiting", registry=CollectorRegistry())


def _waiting(g: Gauge) -> float:
    return g._value.get()  # type: ignore[attr-defined,no-any-return]


def _app(handler: Handler, *, body_after: asyncio.Event | None = None) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await handler(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if body_after is not None and scope["path"] == "/slow-reader":
            await body_after.wait()
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def _call(app: Any, path: str) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": []}
    await app(scope, receive, send)
    return sent


async def _within(*calls: Awaitable[Any]) -> list[Any]:
    # a place never given back shows as requests that never finish
    return await asyncio.wait_for(asyncio.gather(*calls), timeout=10)


async def test_at_most_limit_requests_run_at_once_and_the_rest_wait_in_order() -> None:
    running, most = 0, 0
    started: list[str] = []
    go = asyncio.Event()

    async def handler(path: str) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        started.append(path)
        await go.wait()
        running -= 1

    gauge = _gauge()
    app = Admission(_app(handler), limit=2, waiting=gauge)
    calls = [asyncio.create_task(_call(app, f"/r{i}")) for i in range(6)]
    for _ in range(50):
        await asyncio.sleep(0)
    assert started == ["/r0", "/r1"] and _waiting(gauge) == 4
    go.set()
    answers = await _within(*calls)
    assert most == 2 and _waiting(gauge) == 0
    assert started == [f"/r{i}" for i in range(6)]  # in arrival order
    assert all(a[-1]["body"] == b"ok" for a in answers)


async def test_a_place_is_given_back_when_the_answer_starts() -> None:
    """A reader slow to take its answer (or a streamed export) does not keep the next request out."""
    released = asyncio.Event()
    done: list[str] = []

    async def handler(path: str) -> None:
        done.append(path)
        if path == "/next":
            released.set()  # the slow reader's body is sent only after this request ran

    app = Admission(_app(handler, body_after=released), limit=1, waiting=_gauge())
    slow, nxt = await _within(_call(app, "/slow-reader"), _call(app, "/next"))
    assert done == ["/slow-reader", "/next"]
    assert slow[-1]["body"] == b"ok" and nxt[-1]["body"] == b"ok"


async def test_a_request_that_idles_lets_others_run_and_then_takes_its_place_back() -> None:
    """The batch results long-poll: while it waits, the workers' completions are served."""
    completed = asyncio.Event()
    inside: list[str] = []

    async def handler(path: str) -> None:
        if path == "/poll":
            while not completed.is_set():
                await idle(0.01)
            inside.append("poll resumed")
        else:
            inside.append("complete")
            completed.set()

    app = Admission(_app(handler), limit=1, waiting=_gauge())
    poll = asyncio.create_task(_call(app, "/poll"))
    await asyncio.sleep(0.02)  # the poll holds the only place, then idles
    await _within(poll, _call(app, "/complete"))
    assert inside == ["complete", "poll resumed"]


async def test_health_checks_and_metrics_never_wait() -> None:
    hold = asyncio.Event()

    async def handler(path: str) -> None:
        if path == "/work":
            await hold.wait()

    app = Admission(_app(handler), limit=1, waiting=_gauge())
    busy = asyncio.create_task(_call(app, "/work"))
    await asyncio.sleep(0.01)
    health, metrics = await _within(_call(app, "/healthz"), _call(app, "/metrics"))
    assert health[0]["status"] == metrics[0]["status"] == 200
    hold.set()
    await _within(busy)


async def test_a_request_that_fails_gives_its_place_back() -> None:
    async def handler(path: str) -> None:
        if path == "/boom":
            raise RuntimeError("boom")

    app = Admission(_app(handler), limit=1, waiting=_gauge())
    with pytest.raises(RuntimeError):
        await _call(app, "/boom")
    answer = await _within(_call(app, "/after"))
    assert answer[0][-1]["body"] == b"ok"


def test_idle_outside_a_request_just_sleeps() -> None:
    asyncio.run(idle(0))
