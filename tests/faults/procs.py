"""Real processes for the fault suite: the pool service as `exgrpo serve` in a child process (so
it can be killed with SIGKILL), throwaway Redis servers, and the size of a run.

Size: EXGRPO_FAULT_TRIALS unset runs the short version that the normal test command includes;
EXGRPO_FAULT_TRIALS=N runs N kill trials per backend and scales the other tests with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from service.harness import TOKENS, Backend

EXGRPO = Path(sys.executable).parent / "exgrpo"
FAULT_TRIALS = int(os.environ.get("EXGRPO_FAULT_TRIALS", "0") or 0)
#: the request header that triggers a fault hook (EXGRPO_FAULT_HOOKS=1 only)
FAULT_HEADER = "X-Exgrpo-Fault"


def trials(short: int) -> int:
    """How many trials a test runs: `short` by default, EXGRPO_FAULT_TRIALS in the long version."""
    return FAULT_TRIALS or short


def scaled(short: int, long: int) -> int:
    """A size (clients, seconds, requests) for the default run and for the long version."""
    return long if FAULT_TRIALS else short


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# ------------------------------------------------------------------------------------ Redis
class RedisServer:
    """A Redis server of our own on a free port, nothing kept on disk: `kill()` loses everything
    it held and `start()` again brings it back empty on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (the fault suite starts its own Redis servers)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            wait_until(up, 20, f"redis-server on port {self.port}")
        finally:
            client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server dies as well
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered (a hung server, a network split)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


# -------------------------------------------------------------------------------- the service
def service_env(backend: Backend, **settings: Any) -> dict[str, str]:
    """The environment of an `exgrpo serve` child on `backend` (EXGRPO_* of this process left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_")}
    values: dict[str, Any] = {
        "database_url": backend.database_url,
        "redis_url": backend.redis_url,
        "redis_prefix": backend.redis_prefix,
        "tokens": [t.model_dump() for t in TOKENS],
        "allow_anonymous": False,
        "log_level": "WARNING",
        "host": "127.0.0.1",
        **settings,
    }
    for key, value in values.items():
        if value is None:
            continue
        env[f"EXGRPO_{key.upper()}"] = _env_value(value)
    return env


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


class ServiceProcess:
    """`exgrpo serve` as a child process on a fixed port, restartable after a SIGKILL. Its output
    goes to `log` (appended over restarts)."""

    def __init__(self, env: dict[str, str], log: Path, *, fault_hooks: bool = False) -> None:
        self.port = free_port()
        self.env = {**env, "EXGRPO_PORT": str(self.port)}
        if fault_hooks:
            self.env["EXGRPO_FAULT_HOOKS"] = "1"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90) -> ServiceProcess:
        assert EXGRPO.is_file(), "the console script `exgrpo` is installed with the package"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(EXGRPO), "serve"], env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.starts += 1

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"exgrpo serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, timeout, f"exgrpo serve on port {self.port}", interval=0.1)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL: no shutdown, no flush, exactly what a crashed node does."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
        self.wait_dead()

    def wait_dead(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
