"""The OpenAPI document describes both forms of a pool export and of an import: NDJSON, and the
binary record stream (`application/x-msgpack`, docs/api.md "Binary export") that `Accept` asks for
and that an import takes as it is."""

from __future__ import annotations

from typing import Any

from exgrpo_client import frames
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

NDJSON = "application/x-ndjson"


def _spec() -> dict[str, Any]:
    return create_app(Settings(allow_anonymous=True, database_url="sqlite+aiosqlite://")).openapi()


def _check_forms(content: dict[str, Any]) -> None:
    assert list(content) == [NDJSON, frames.MEDIA_TYPE]
    assert content[NDJSON]["schema"] == {"type": "string"}
    assert content[frames.MEDIA_TYPE]["schema"] == {"type": "string", "format": "binary"}
    for media in content.values():
        assert media["description"]
    assert "Binary export" in content[frames.MEDIA_TYPE]["description"]


def test_export_declares_both_answers_and_how_accept_picks_one() -> None:
    answer = _spec()["paths"]["/v1/pools/{pool}/export"]["get"]["responses"]["200"]
    _check_forms(answer["content"])
    assert "Accept" in answer["description"]
    assert f"Accept: {frames.MEDIA_TYPE}" in answer["content"][frames.MEDIA_TYPE]["description"]


def test_import_declares_both_bodies() -> None:
    body = _spec()["paths"]["/v1/pools/import"]["post"]["requestBody"]
    assert body["required"] is True
    assert body["description"]
    _check_forms(body["content"])
