"""A commit's `Idempotency-Key` record keeps a digest of what the commit asks for, made from the
batch's commit digest (`convert.commit_digest`: groups, payloads and policy version, whatever the
encoding) and the rest of the body, so the payload's megabytes are hashed once per commit, not
twice (once for the batch, once for the key's record), and a retry in the other encoding is the
same request. Records written before (the hash of the body's bytes) still replay."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
import pytest

from exgrpo_client import frames
from exgrpo_pool.api import deps
from exgrpo_pool.service import convert

from .factories import correct_first, make_groups, plan_batch, setup_pool
from .harness import Backend, db_rows, serve
from .test_frames import to_frame

FRAME = {"content-type": frames.MEDIA_TYPE}


def _long(qid: int, row: int) -> list[int]:
    return [qid, row] + [7] * 2000


async def _planned(client: httpx.AsyncClient, tokens: Any = None) -> tuple[str, dict[str, Any]]:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    groups = make_groups(plan, correct_first(lambda q: 2), *([tokens] if tokens else []))
    return f"/v1/pools/p1/batches/{plan['id']}/commit", groups


def _replayed(r: httpx.Response) -> bool:
    return r.status_code == 200 and r.headers.get("idempotent-replayed") == "true"


async def test_a_commit_retried_in_the_other_encoding_is_the_same_request(backend: Backend) -> None:
    async with serve(backend.settings()) as client:
        path, body = await _planned(client)
        first = await client.post(path, content=to_frame(body), headers={**FRAME, "Idempotency-Key": "k1"})
        assert first.status_code == 200 and not _replayed(first)
        again = await client.post(path, json=body, headers={"Idempotency-Key": "k1"})
        assert _replayed(again) and again.json() == first.json()


async def test_a_commit_key_sent_again_with_another_body_is_refused(backend: Backend) -> None:
    async with serve(backend.settings()) as client:
        path, body = await _planned(client)
        assert (await client.post(path, json=body, headers={"Idempotency-Key": "k1"})).status_code == 200
        for other in (
            {**body, "metrics": {"loss": 0.5}},  # not part of the batch's digest, part of the request
            {**body, "with_stats": True},
            {**body, "groups": body["groups"][::-1]},
        ):
            clash = await client.post(path, json=other, headers={"Idempotency-Key": "k1"})
            assert clash.status_code == 422 and "different request" in clash.json()["detail"], other


async def test_a_commit_key_recorded_with_the_bodys_bytes_still_replays(backend: Backend) -> None:
    """A record written before (the SHA-256 of the route and the body as sent) is still the same
    request when the same bytes come again, and only then."""
    async with serve(backend.settings()) as client:
        path, body = await _planned(client)
        raw = json.dumps(body).encode()
        headers = {"Idempotency-Key": "old", "content-type": "application/json"}
        first = await client.post(path, content=raw, headers=headers)
        assert first.status_code == 200
        old = hashlib.sha256(f"POST {path}\n".encode() + raw).hexdigest()
        await db_rows(
            backend.database_url, f"UPDATE idempotency_key SET request_hash = '{old}' RETURNING key"
        )
        again = await client.post(path, content=raw, headers=headers)
        assert _replayed(again) and again.json() == first.json()
        other = {**body, "metrics": {"x": 1.0}}
        assert (await client.post(path, json=other, headers={"Idempotency-Key": "old"})).status_code == 422


async def test_a_keyed_commit_hashes_its_payload_once(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes passed to SHA-256 by the idempotency record and the commit digest together: the
    body's payload once (with the small JSON parts), not twice."""
    hashed: list[int] = []

    class Counted:
        def __init__(self, data: bytes = b"") -> None:
            self._h = hashlib.sha256()
            self.update(data)

        def update(self, data: bytes) -> None:
            hashed.append(len(data))
            self._h.update(data)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    class Hashlib:
        sha256 = Counted

    async with serve(backend.settings()) as client:
        path, body = await _planned(client, _long)
        raw = to_frame(body)
        monkeypatch.setattr(deps, "hashlib", Hashlib)
        monkeypatch.setattr(convert, "hashlib", Hashlib)
        r = await client.post(path, content=raw, headers={**FRAME, "Idempotency-Key": "k1"})
        assert r.status_code == 200
    payload = sum(len(s) for s in _payload_bytes(raw))
    assert payload > 100_000 and payload <= sum(hashed) < 1.2 * payload, (hashed, payload, len(raw))


def _payload_bytes(frame: bytes) -> list[bytes]:
    _, payloads = frames.decode(frame)
    return [payloads.token_ids.tobytes(), payloads.logprobs.tobytes()]
