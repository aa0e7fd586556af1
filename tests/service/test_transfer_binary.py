"""The binary form of a pool export (`Accept: application/x-msgpack`): the same records as NDJSON,
trajectories in frames whose payloads are the stored bytes; import of either form, all or nothing."""

from __future__ import annotations

import io
import json
import struct
from typing import Any

import httpx
import msgpack
import pytest

from exgrpo_client import exports, frames
from exgrpo_client import schemas as s

from .factories import ok, run_stats, setup_pool
from .test_transfer import _hist, _pool_view, _train

BINARY = {"accept": frames.MEDIA_TYPE}
AS_BINARY = {"content-type": frames.MEDIA_TYPE}


async def _trained_pool(client: httpx.AsyncClient) -> dict[str, Any]:
    await setup_pool(client, runs=("r1", "r2"), questions=20, description="binary")
    ok(await client.patch("/v1/pools/p1/runs/r1", json={"phase": "mixed"}))
    await _train(client, 3, "r1")
    await _train(client, 2, "r2")
    ok(
        await client.post("/v1/pools/p1/runs/r1/policy-versions", json={"version": 2, "uri": "file:///c/2"}),
        201,
    )
    view = await _pool_view(client, "p1")
    assert view["stats"]["num_trajectories"] > 0
    return view


def _records(raw: bytes) -> list[bytes]:
    """The records of a binary export, each as its bytes (without the length prefix)."""
    reader = exports.Reader()
    out = list(reader.feed(raw))
    reader.close()
    return out


def _payloads(records: Any) -> list[tuple[str, str]]:
    return sorted((r.token_ids_b64, r.logprobs_b64) for r in records if r.type == "trajectory")


def _stream(records: list[bytes]) -> bytes:
    return exports.MAGIC + b"".join(struct.pack("<I", len(r)) + r for r in records)


async def test_binary_round_trip(client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    original = await _trained_pool(client)
    ndjson = await client.get("/v1/pools/p1/export")
    assert ndjson.headers["content-type"].startswith("application/x-ndjson")
    binary = await client.get("/v1/pools/p1/export", headers=BINARY)
    assert binary.status_code == 200 and binary.headers["content-type"] == frames.MEDIA_TYPE
    assert binary.headers["content-disposition"] == 'attachment; filename="p1.exgrpo"'
    assert binary.content.startswith(exports.MAGIC) and len(binary.content) < len(ndjson.content)

    # the same records as the NDJSON export, line for line
    records = list(exports.read(io.BytesIO(binary.content)))
    assert b"".join(s.export_line(r) for r in records) == ndjson.content
    # trajectories come in frames, their payloads the stored bytes (no base64)
    raws = _records(binary.content)
    items = [exports.parse(r) for r in raws]
    assert isinstance(items[0], s.ExportHeader) and isinstance(items[-1], exports.End)
    assert any(isinstance(x, exports.TrajectoryFrame) for x in items)
    assert msgpack.unpackb(raws[-1]) == {"type": "end", "records": len(raws) - 1}
    lines = [json.loads(x) for x in ndjson.content.splitlines()]
    stored = [
        (s.decode_b64(x["token_ids_b64"]), s.decode_b64(x["logprobs_b64"]))
        for x in lines
        if x["type"] == "trajectory"
    ]
    framed = []
    for item in items:
        if isinstance(item, exports.TrajectoryFrame):
            assert all(t.token_ids_b64 == t.logprobs_b64 == "" for t in item.trajectories)
            framed += item.payloads.chunks()
    assert framed == stored

    imported = ok(
        await client.post(
            "/v1/pools/import", params={"name": "bin"}, content=binary.content, headers=AS_BINARY
        ),
        201,
    )
    ndjson_counts = ok(
        await client.post("/v1/pools/import", params={"name": "txt"}, content=ndjson.content), 201
    )
    assert {**imported, "pool": "txt"} == ndjson_counts
    assert imported["trajectories"] == original["stats"]["num_trajectories"] and imported["duplicates"] == 0
    # byte-identical payloads and everything else: the view holds each trajectory's base64 payload
    assert await _pool_view(client, "bin") == original == await _pool_view(client, "txt")
    again = await client.get("/v1/pools/bin/export", headers=BINARY)
    assert _payloads(exports.read(io.BytesIO(again.content))) == _payloads(records)

    # without the Content-Type: the first byte tells the forms apart
    sniffed = ok(
        await client.post("/v1/pools/import", params={"name": "sniffed"}, content=binary.content), 201
    )
    assert sniffed["trajectories"] == imported["trajectories"]

    # one trajectory a frame: still one stream, counted by its end record
    monkeypatch.setattr(exports, "FRAME_BYTES", 1)
    small = (await client.get("/v1/pools/p1/export", headers=BINARY)).content
    frame_count = sum(isinstance(exports.parse(r), exports.TrajectoryFrame) for r in _records(small))
    assert frame_count == original["stats"]["num_trajectories"]
    ok(await client.post("/v1/pools/import", params={"name": "small"}, content=small, headers=AS_BINARY), 201)
    assert await _pool_view(client, "small") == original


async def test_plain_accept_gets_ndjson(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    for accept in ("application/json", "application/x-ndjson", "*/*"):
        r = await client.get("/v1/pools/p1/export", headers={"accept": accept})
        assert r.headers["content-type"].startswith("application/x-ndjson"), accept
        assert json.loads(r.content.splitlines()[0])["type"] == "header"


def _frame(records: list[bytes]) -> int:
    return next(i for i, r in enumerate(records) if isinstance(exports.parse(r), exports.TrajectoryFrame))


def _patched_frame(raw: bytes, **changes: Any) -> bytes:
    frame = msgpack.unpackb(raw)
    frame.update(changes)
    return msgpack.packb(frame, use_bin_type=True)


def _with_entry(raw: bytes, **fields: Any) -> bytes:
    frame = msgpack.unpackb(raw)
    frame["body"]["trajectories"][0].update(fields)
    return msgpack.packb(frame, use_bin_type=True)


async def test_broken_binary_import_changes_nothing(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    await _train(client, 2)
    good = (await client.get("/v1/pools/p1/export", headers=BINARY)).content
    records = _records(good)
    fi = _frame(records)
    frame = msgpack.unpackb(records[fi])
    before = ok(await client.get("/v1/pools"))

    def replace(i: int, raw: bytes) -> bytes:
        return _stream([*records[:i], raw, *records[i + 1 :]])

    positive = bytearray(frame["logprobs"])
    positive[0:4] = struct.pack("<f", 0.5)
    cases: dict[str, tuple[bytes, str]] = {
        "cut inside a frame": (good[: len(good) - len(records[-1]) - 100], "ends inside record"),
        "cut inside a length": (good[: len(_stream(records[:2])) + 2], "ends inside record 3"),
        "cut between records": (_stream(records[:-1]), "without the end record"),
        "a frame missing": (_stream([*records[:fi], *records[fi + 1 :]]), "the end record counts"),
        "after the end": (_stream([*records, records[1]]), "after the end record"),
        "bad magic": (b"\x89EXGRPX\n" + good[8:], "does not begin with"),
        "ndjson sent as binary": (b'{"type":"header"}\n', "no binary pool export"),
        "empty": (b"", "no binary pool export"),
        "huge length": (exports.MAGIC + struct.pack("<I", 2**31), "more than the limit"),
        "not msgpack": (replace(1, b"\xc1" * 10), "import record 2: not a msgpack map"),
        "corrupt frame bytes": (replace(fi, records[fi][: len(records[fi]) // 2]), f"import record {fi + 1}"),
        "unknown record": (replace(1, msgpack.packb({"type": "mystery"})), "import record 2"),
        "no header": (_stream(records[1:]), "header"),
        "positive log-prob": (
            replace(fi, _patched_frame(records[fi], logprobs=bytes(positive))),
            "trajectories[0]: log-probs must be <= 0",
        ),
        "lengths do not add up": (
            replace(fi, _patched_frame(records[fi], token_ids=frame["token_ids"][:-4])),
            "the lengths add up to",
        ),
        "a length of -1": (
            replace(fi, _patched_frame(records[fi], lengths=struct.pack("<i", -1) + frame["lengths"][4:])),
            "every trajectory has a payload",
        ),
        "payload in the body": (
            replace(fi, _with_entry(records[fi], token_ids_b64="AAAA")),
            "trajectories[0]",
        ),
        "bad trajectory field": (replace(fi, _with_entry(records[fi], step="3")), "trajectories[0]: step"),
        "unknown question": (
            replace(fi, _with_entry(records[fi], question=10**9)),
            "has no earlier question",
        ),
        "frame as a plain record": (replace(fi, msgpack.packb({"type": "trajectories"})), "in a frame"),
    }
    for name, (body, message) in cases.items():
        for headers in (AS_BINARY, {}):
            if name in ("ndjson sent as binary", "empty") and not headers:
                continue  # without the Content-Type these are NDJSON imports (their own errors)
            r = await client.post(
                "/v1/pools/import", params={"name": "p1-broken"}, content=body, headers=headers
            )
            assert r.status_code == 422, (name, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith("application/problem+json")
            assert message in r.json()["detail"], (name, r.json()["detail"])
            assert (await client.get("/v1/pools/p1-broken")).status_code == 404, name
            assert ok(await client.get("/v1/pools")) == before, name
    # the same stream, whole, imports
    ok(
        await client.post("/v1/pools/import", params={"name": "p1-broken"}, content=good, headers=AS_BINARY),
        201,
    )


async def test_binary_import_streams_in_small_chunks(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    await _train(client, 2)
    good = (await client.get("/v1/pools/p1/export", headers=BINARY)).content

    async def chunks() -> Any:
        for i in range(0, len(good), 7):
            yield good[i : i + 7]

    imported = ok(await client.post("/v1/pools/import", params={"name": "chunked"}, content=chunks()), 201)
    assert imported["trajectories"] == ok(await client.get("/v1/pools/p1"))["num_trajectories"]


def _binary_of(ndjson: bytes) -> bytes:
    """The binary form of an NDJSON export, written with the format's own encoders."""
    out = [exports.MAGIC]
    records = 0
    for line in ndjson.splitlines():
        record = s.parse_export_record(line)
        if isinstance(record, s.ExportTrajectory):
            entry = record.model_dump(mode="json", exclude={"type", "token_ids_b64", "logprobs_b64"})
            payload = (s.decode_b64(record.token_ids_b64), s.decode_b64(record.logprobs_b64))
            out.append(exports.trajectory_frame([entry], [payload]))
        else:
            out.append(exports.model_record(record))
        records += 1
    return b"".join([*out, exports.end_record(records)])


async def test_repeated_content_imports_alike_in_both_forms(client: httpx.AsyncClient) -> None:
    """An export written elsewhere may hold a question twice (two ids, one content), each with its
    state in one scope, and a trajectory twice: both collapse, in either form, on every backend."""
    await setup_pool(client, phase="mixed")
    await _train(client, 2)
    lines = (await client.get("/v1/pools/p1/export")).content.splitlines()
    parsed = [json.loads(x) for x in lines]
    question = next(
        x
        for x in parsed
        if x["type"] == "question"
        and any(st["type"] == "state" and st["question"] == x["id"] for st in parsed)
    )
    state = next(x for x in parsed if x["type"] == "state" and x["question"] == question["id"])
    trajectory = next(x for x in lines if b'"trajectory"' in x)
    twin = {**question, "id": 10**6}
    twin_state = {**state, "question": 10**6, "last_k": 0, "bucket": None, "retired": False}
    at = parsed.index(state)
    extra = [*lines[:at], json.dumps(twin).encode(), *lines[at:], json.dumps(twin_state).encode(), trajectory]
    # a question record after a state is fine: the importer maps ids as records come
    ndjson = b"\n".join(extra)
    answers = []
    for name, body in (("text", ndjson), ("binary", _binary_of(ndjson))):
        answers.append(ok(await client.post("/v1/pools/import", params={"name": name}, content=body), 201))
    text, binary = answers
    assert {**binary, "pool": "text"} == text and text["duplicates"] == 1
    assert text["trajectories"] == ok(await client.get("/v1/pools/p1"))["num_trajectories"]
    assert await _pool_view(client, "binary") == await _pool_view(client, "text")
    # the twin's state came after the question's own: it updates it as a commit would (the bucket stays)
    assert _hist(await run_stats(client, "text")) == _hist(await run_stats(client, "p1"))
