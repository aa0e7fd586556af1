"""Work a request hands to a thread while its event loop goes on with the request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """`fn()` started in the running loop's default executor, for work that lets go of the GIL
    (hashing megabytes, say) and is needed only later in the request. A request that fails before
    it awaits the result leaves the call to finish on its own; its outcome is then retrieved and
    dropped."""
    return settled(asyncio.get_running_loop().run_in_executor(None, fn))


def settled(fut: asyncio.Future[T]) -> asyncio.Future[T]:
    """`fut`, whose failure, if nothing awaits it (its request failed first), is retrieved and
    dropped instead of logged as never retrieved."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut
