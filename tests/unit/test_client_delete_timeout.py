"""Deleting a pool or a run is one transaction over everything in it (a pool of 1M questions takes
~27 s on Postgres, ~57 s on SQLite): the client waits for it past its own timeout instead of
giving up and retrying a deletion that then finds the pool gone (404). Against a real HTTP server
that answers after longer than the client's timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from exgrpo_client import Client
from exgrpo_client.errors import ExgrpoError

DELAY_S = 0.6
TIMEOUT_S = 0.2


class _Slow(BaseHTTPRequestHandler):
    """Answers every request after DELAY_S: 204 to a DELETE, a pool's stats to a GET."""

    def _answer(self, status: int, body: bytes = b"") -> None:
        time.sleep(DELAY_S)
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_DELETE(self) -> None:
        assert isinstance(self.server, _Server)
        self.server.deletes += 1
        self._answer(204)

    def do_GET(self) -> None:
        self._answer(200, b"{}")

    def log_message(self, *_: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    deletes = 0

    def handle_error(self, request: object, client_address: object) -> None:
        """The read the client gave up on finds its socket closed: expected, not printed."""


@pytest.fixture
def slow_url() -> Iterator[tuple[str, _Server]]:
    server = _Server(("127.0.0.1", 0), _Slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


def test_a_deletion_is_waited_for_past_the_clients_timeout(slow_url: tuple[str, _Server]) -> None:
    url, server = slow_url
    with Client(url, timeout=TIMEOUT_S, retries=0) as client:
        client.delete_pool("big")
        client.delete_run("big", "r1")
        assert server.deletes == 2
        # the same wait on a read is a timeout: the deletions' longer wait is theirs alone
        with pytest.raises(ExgrpoError):
            client.pool_stats("big")
