"""`exgrpo serve` prints its settings at start-up: no secret of any URL setting may appear in what
it prints, nor in what it logs when it then fails to reach the servers those URLs name."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from exgrpo_pool.config import Settings, mask_url

EXGRPO = Path(sys.executable).parent / "exgrpo"


def _closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_mask_url_hides_user_info_and_secret_query_values() -> None:
    assert mask_url("postgresql+asyncpg://u:secret@db:5432/x") == "postgresql+asyncpg://***@db:5432/x"
    assert mask_url("redis://:pw@redis:6379/0") == "redis://***@redis:6379/0"
    assert mask_url("redis://default:p@ss/w@rd@redis:6379/0") == "redis://***@redis:6379/0"
    assert mask_url("rediss://redis:6380/0?password=s3&ssl_cert_reqs=none") == (
        "rediss://redis:6380/0?password=***&ssl_cert_reqs=none"
    )
    assert mask_url("postgresql+asyncpg://db/x?user=u&sslkey=k.pem&access_token=t") == (
        "postgresql+asyncpg://db/x?user=u&sslkey=***&access_token=***"
    )
    assert mask_url("sqlite+aiosqlite:///p.db") == "sqlite+aiosqlite:///p.db"


def test_public_settings_mask_every_url() -> None:
    settings = Settings(
        database_url="postgresql+asyncpg://pool:db-secret-1@db:5432/exgrpo",
        redis_url="redis://:redis-secret-2@redis:6379/0?password=redis-secret-3",
        allow_anonymous=True,
    )
    text = json.dumps(settings.public_dict())
    for secret in ("db-secret-1", "redis-secret-2", "redis-secret-3"):
        assert secret not in text
    assert settings.public_dict()["redis_url"] == "redis://***@redis:6379/0?password=***"


def test_serve_prints_and_logs_no_secret(tmp_path: Path) -> None:
    secrets = ("db-secret-4", "redis-secret-5", "redis-secret-6")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_")}
    env |= {
        "EXGRPO_DATABASE_URL": f"postgresql+asyncpg://pool:{secrets[0]}@127.0.0.1:{_closed_port()}/exgrpo",
        "EXGRPO_REDIS_URL": f"redis://:{secrets[1]}@127.0.0.1:{_closed_port()}/0?password={secrets[2]}",
        "EXGRPO_ALLOW_ANONYMOUS": "true",
        "EXGRPO_PORT": "0",
    }
    command = [str(EXGRPO), "serve", "--json"]
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=10)
    assert proc.returncode != 0, "the database is unreachable: serve must fail to start"
    printed = json.loads(stdout.decode().splitlines()[0])
    assert printed["database_url"].startswith("postgresql+asyncpg://***@127.0.0.1:")
    assert printed["redis_url"].startswith("redis://***@127.0.0.1:")
    assert printed["redis_url"].endswith("/0?password=***")
    everything = stdout.decode() + stderr.decode()
    assert [s for s in secrets if s in everything] == []
