"""Fault hooks for the fault tests: off unless the environment variable EXGRPO_FAULT_HOOKS is `1`.

With it, a request that carries the header `X-Exgrpo-Fault: kill-after-commit` makes the service
process kill itself (SIGKILL, no shutdown) right after that request's database transaction has
committed, before anything else happens: the index is not updated, nothing is answered. It puts a
crash exactly where a lost answer hurts most, which random `kill -9` hits only by chance (the
fault suite does both). Never set the variable in a deployment.
"""

from __future__ import annotations

import os
import signal
from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

ENV = "EXGRPO_FAULT_HOOKS"
HEADER = b"x-exgrpo-fault"
KILL_AFTER_COMMIT = "kill-after-commit"

_kill_after_commit: ContextVar[bool] = ContextVar("exgrpo_kill_after_commit", default=False)


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def committed() -> None:
    """Called by the database layer after a request's outermost transaction has committed."""
    if _kill_after_commit.get():
        os.kill(os.getpid(), signal.SIGKILL)


class FaultHooks:
    """ASGI middleware that arms the hooks a request asks for (installed only when enabled)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(HEADER) == KILL_AFTER_COMMIT.encode():
            token = _kill_after_commit.set(True)
            try:
                await self.app(scope, receive, send)
            finally:
                _kill_after_commit.reset(token)
            return
        await self.app(scope, receive, send)
