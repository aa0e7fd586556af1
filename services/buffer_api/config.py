"""Settings of the pool service: environment variables `EXGRPO_*`, optionally a YAML file.

Declared once here, validated at start-up and printed (secrets masked) by `exgrpo serve`.
`docs/configuration.md` lists the same fields.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

Scope = str  # "admin" | "read" | "read:<pool>" | "read:*" | "write:<pool>" | "write:*"

DEFAULT_DATA_DIR = Path("exgrpo-data")

EXAMPLE_SECRET = re.compile(r"replace[-_ ]?(me|with)", re.IGNORECASE)
"""The placeholders of .env.example ("replace-with-...") and deploy/k8s/secret.yaml ("REPLACE-ME-...")."""


#: query parameters of a URL whose values are secrets (password=, sslkey=, access_token=, ...)
_SECRET_PARAM = re.compile(r"pass|secret|token|key|credential", re.IGNORECASE)


def mask_url(url: str) -> str:
    """A URL as it may be printed or logged: the user info (user and password) replaced by `***`,
    and so are the values of query parameters named like secrets. Other text is returned as is."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    if "@" in rest:
        # the last @ ends the user info (an unescaped @ or / in a password must not leak a part)
        rest = "***@" + rest.rsplit("@", 1)[1]
    base, qsep, query = rest.partition("?")
    if qsep:
        params = []
        for param in query.split("&"):
            name, eq, _ = param.partition("=")
            params.append(f"{name}=***" if eq and _SECRET_PARAM.search(name) else param)
        rest = base + "?" + "&".join(params)
    return f"{scheme}://{rest}"


class TokenGrant(BaseModel):
    """A bearer token and what it may do."""

    token: str = Field(min_length=16)
    """The secret itself (at least 16 characters)."""
    name: str = "client"
    """Who holds it; appears in logs, never the token."""
    scopes: list[Scope] = Field(default_factory=lambda: ["read"])
    """`admin` (everything), `read` (every pool), `read:<pool>`, `write:<pool>` (reads it too) or
    `read:*` / `write:*` (every pool)."""

    @field_validator("scopes")
    @classmethod
    def _known_scopes(cls, v: list[str]) -> list[str]:
        for s in v:
            kind, sep, pool = s.partition(":")
            if s in ("admin", "read") or (sep and kind in ("read", "write") and pool):
                continue
            raise ValueError(
                f"unknown scope {s!r}: use admin, read, read:<pool>, read:*, write:<pool> or write:*"
            )
        return v


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the file named by EXGRPO_CONFIG_FILE (lower priority than environment variables)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("EXGRPO_CONFIG_FILE")
        if not path:
            return {}
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"EXGRPO_CONFIG_FILE {path}: expected a mapping at the top level")
        return data


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="EXGRPO_", env_nested_delimiter="__", env_ignore_empty=True, extra="ignore"
    )

    database_url: str = f"sqlite+aiosqlite:///{DEFAULT_DATA_DIR / 'pool.db'}"
    """SQLAlchemy async URL. `postgresql+asyncpg://...` for Postgres; a SQLite file by default."""
    redis_url: str | None = None
    """`redis://host:6379/0` puts the sampling index in Redis; unset keeps it in process (one
    service process only)."""
    redis_prefix: str = "exgrpo"
    """Prefix of every Redis key, so several deployments can share one Redis."""
    redis_timeout_s: float = Field(1.0, gt=0, le=60)
    """Longest wait for Redis to connect or answer; a request that needs an unreachable Redis is
    answered 503 after about twice this (one retry)."""
    host: str = "127.0.0.1"
    """Address to bind. The default only accepts connections from this machine."""
    port: int = Field(8700, ge=0, le=65535)
    """TCP port (0 picks a free one, for embedded use)."""
    tokens: list[TokenGrant] = Field(default_factory=list)
    """Bearer tokens with scopes (JSON list in EXGRPO_TOKENS)."""
    allow_anonymous: bool = False
    """Serve requests without a token. Anonymous callers get every scope on a loopback bind and
    only `read` otherwise."""
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest accepted request body (pool import streams have their own limit)."""
    max_import_bytes: int = Field(16 * 1024**3, ge=1024)
    """Largest accepted pool import stream."""
    auto_migrate: bool = True
    """Apply database migrations on start (`exgrpo db upgrade` does it by hand)."""
    task_max_attempts: int = Field(3, ge=1)
    """A generation task that failed this many times stays failed."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the service."""
    log_format: Literal["json", "plain"] = "json"
    """Log lines as JSON objects or plain text (exgrpo_client.logs; `exgrpo serve --log-format`)."""
    db_pool_size: int = Field(10, ge=1)
    """Connections kept open to Postgres (per service process)."""
    sqlite_cache_mb: int = Field(64, ge=0)
    """SQLite's page cache per database connection, in MiB (0: SQLite's default, 2 MB). Taken as
    pages are read; a service process opens a connection per request it works on at once."""
    sqlite_driver: Literal["thread", "inline"] = "inline"
    """How the service calls a SQLite file: `inline` (`sqlite3` called from the event loop; a
    statement that finds the file locked waits on the loop, not inside SQLite) or `thread`
    (aiosqlite: each connection's calls run in its own thread, four hand-offs per statement).
    Postgres ignores it. With `workers` > 1 a statement that finds the file locked by another
    process waits on the loop too."""
    max_active_requests: int = Field(8, ge=0)
    """Requests a service process handles at once (0: no limit); the rest wait in arrival order.
    All of a process's requests share one event loop, and a write holds the database's write lock
    across its statements: with many requests in flight, each of its statements waits behind all
    of them (the 50-client benchmark on SQLite: commits waited ~10 s)."""
    ingest_group_max: int = Field(8, ge=1, le=256)
    """Postgres: ingests into one run that arrive while the run's previous ingest is being written
    are written together, up to this many in one transaction (each in a savepoint of its own: one
    that fails is undone alone). They would wait for the run's row lock in turn anyway; together
    they take it, a connection and a commit once. 1: each ingest in its own transaction. SQLite
    writes one transaction at a time regardless."""
    workers: int = Field(1, ge=1, le=64)
    """Service processes of `exgrpo serve`, sharing one listening socket. More than one needs
    `redis_url`: the in-process sampling index cannot be shared between processes."""
    allow_example_secrets: bool = False
    """Accept the placeholder tokens and database password of .env.example and
    deploy/k8s/secret.yaml (a throwaway demo only); by default the service refuses to start with them."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls), file_secret_settings

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.database_url.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError(
                "EXGRPO_DATABASE_URL must start with sqlite+aiosqlite:// or postgresql+asyncpg://, "
                f"got {self.database_url.split('://')[0]}://..."
            )
        if not self.tokens and not self.allow_anonymous:
            raise ValueError(
                "no way in: set EXGRPO_TOKENS (bearer tokens with scopes) or EXGRPO_ALLOW_ANONYMOUS=true"
            )
        if self.workers > 1 and not self.redis_url:
            raise ValueError(
                f"workers={self.workers} needs redis_url (EXGRPO_REDIS_URL): the in-process sampling "
                "index cannot be shared between processes; set a Redis URL or serve with one worker"
            )
        if not self.allow_example_secrets:
            placeholders = [f"the token of {t.name!r}" for t in self.tokens if EXAMPLE_SECRET.search(t.token)]
            if EXAMPLE_SECRET.search(self.database_url.split("@", 1)[0]):
                placeholders.append("the database password")
            if placeholders:
                raise ValueError(
                    f"{', '.join(placeholders)} still hold the example placeholder: replace them with "
                    "random secrets (.env, the Kubernetes Secret), or set EXGRPO_ALLOW_EXAMPLE_SECRETS=true "
                    "for a throwaway demo"
                )
        return self

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def loopback(self) -> bool:
        return _is_loopback(self.host)

    def public_dict(self) -> dict[str, Any]:
        """What is printed at start-up: everything but secrets."""
        d = self.model_dump()
        d["tokens"] = [{"name": t.name, "scopes": t.scopes} for t in self.tokens]
        return {k: mask_url(v) if isinstance(v, str) else v for k, v in d.items()}


@functools.lru_cache(maxsize=64)
def _is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (asked by every anonymous request: parsing the
    address each time cost ~3 us)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
