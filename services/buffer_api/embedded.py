"""The pool service inside another program: uvicorn in a background thread on a loopback port.

Used by the one-box main job (`exgrpo run`) and by tests that need a real HTTP service.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from exgrpo_pool.config import Settings


@dataclass(frozen=True)
class Embedded:
    url: str
    database_url: str


@contextlib.contextmanager
def serve_in_thread(settings: Settings, *, start_timeout_s: float = 60.0) -> Iterator[Embedded]:
    """Run the app until the block ends. Port 0 in `settings` picks a free port."""
    import uvicorn

    from exgrpo_pool.app import create_app

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level="warning",
        access_log=False,
        ws="none",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="exgrpo-pool-service", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the embedded pool service did not start (see its log above)")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Embedded(url=f"http://{settings.host}:{port}", database_url=settings.database_url)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
