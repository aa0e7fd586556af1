"""The pool service refuses the placeholder secrets of .env.example and deploy/k8s/secret.yaml
unless EXGRPO_ALLOW_EXAMPLE_SECRETS=true (a throwaway demo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from exgrpo_pool.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def _env_example() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env.example").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def _grants(tokens: dict[str, str]) -> list[dict[str, object]]:
    return [{"token": t, "name": name, "scopes": ["admin"]} for name, t in tokens.items()]


def test_the_env_example_placeholders_are_refused() -> None:
    env = _env_example()
    tokens = {k: v for k, v in env.items() if k.endswith("_TOKEN")}
    assert len(tokens) == 4
    with pytest.raises(ValidationError, match="EXGRPO_ALLOW_EXAMPLE_SECRETS"):
        Settings(tokens=_grants(tokens))
    url = f"postgresql+asyncpg://exgrpo:{env['POSTGRES_PASSWORD']}@postgres:5432/exgrpo"
    real = {"ops": "a-real-random-token-0123456789"}
    with pytest.raises(ValidationError, match="the database password"):
        Settings(database_url=url, tokens=_grants(real))


def test_the_kubernetes_secret_placeholders_are_refused() -> None:
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "secret.yaml").read_text(encoding="utf-8"))
    data = next(d for d in docs if d and d.get("kind") == "Secret")["stringData"]
    tokens = {k: v for k, v in data.items() if k.endswith("_TOKEN")}
    with pytest.raises(ValidationError, match="still hold the example placeholder"):
        Settings(tokens=_grants(tokens))
    with pytest.raises(ValidationError, match="the database password"):
        Settings(database_url=data["EXGRPO_DATABASE_URL"], allow_anonymous=True)


def test_the_demo_flag_accepts_them_and_real_secrets_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    placeholder = {"ops": "replace-with-a-long-random-admin-token"}
    monkeypatch.setenv("EXGRPO_TOKENS", json.dumps(_grants(placeholder)))
    monkeypatch.setenv("EXGRPO_ALLOW_EXAMPLE_SECRETS", "true")
    assert Settings().tokens[0].token == placeholder["ops"]
    monkeypatch.delenv("EXGRPO_ALLOW_EXAMPLE_SECRETS")
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.setenv("EXGRPO_TOKENS", json.dumps(_grants({"ops": "Xq3-real-random-token-9f2k"})))
    url = "postgresql+asyncpg://exgrpo:Zr8s-real-password@db:5432/exgrpo"
    assert Settings(database_url=url).database_url == url
