"""How many requests one service process works on at once.

Every request of a process shares one event loop. A request resumes, after each database
statement or Redis call, behind every other request that is ready to run; a write holds the
database's write lock (SQLite) or its rows' locks (Postgres) across its statements, so with dozens
of requests in flight its hold, and the queue of writers behind it, grow with them. In the
50-client benchmark on SQLite, commits and ingests waited ~10 s behind readers. `Admission` lets
`limit` requests run and queues the rest in arrival order; what a request waits in that queue
counts in its latency (the middleware sits inside the access log's timing).

A request holds its place until its answer starts: a streamed answer (an export) or a slow reader
does not keep others out. A request that waits on something other than its own work (the batch
results long-poll) gives its place up while it waits: `idle`.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass

from prometheus_client import Gauge
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Paths never queued: health checks must answer under load, and a pool import streams its body
#: for as long as the upload takes.
_OPEN_PATHS = ("/healthz", "/metrics")
_OPEN_SUFFIXES = ("/pools/import",)


@dataclass
class _Place:
    """A request's place among the `limit`: held or given up (while it `idle`s, or once its
    answer has started)."""

    slots: asyncio.Semaphore
    held: bool = False

    async def take(self) -> None:
        await self.slots.acquire()
        self.held = True

    def give_up(self) -> None:
        if self.held:
            self.held = False
            self.slots.release()


_place: contextvars.ContextVar[_Place | None] = contextvars.ContextVar("exgrpo_admission", default=None)


class Admission:
    """At most `limit` requests worked on at once; the others wait their turn in arrival order
    (the gauge counts them)."""

    def __init__(self, app: ASGIApp, limit: int, waiting: Gauge) -> None:
        self.app, self.limit, self.waiting = app, limit, waiting
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in _OPEN_PATHS or path.endswith(_OPEN_SUFFIXES):
            await self.app(scope, receive, send)
            return
        if self._slots is None:  # made in the server's event loop
            self._slots = asyncio.Semaphore(self.limit)
        place = _Place(self._slots)
        if self._slots.locked():
            self.waiting.inc()
            try:
                await place.take()
            finally:
                self.waiting.dec()
        else:  # a free place is taken without giving the loop up: nobody could see it counted
            await place.take()

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start":
                place.give_up()
            await send(message)

        token = _place.set(place)
        try:
            await self.app(scope, receive, answering)
        finally:
            _place.reset(token)
            place.give_up()


async def idle(seconds: float) -> None:
    """Sleep without holding the request's place (others run meanwhile); take it back after."""
    place = _place.get()
    if place is None or not place.held:
        await asyncio.sleep(seconds)
        return
    place.give_up()
    await asyncio.sleep(seconds)  # cancelled here: nothing held, nothing to give back
    await place.take()
