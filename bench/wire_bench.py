"""Binary frames for the pool's payload-heavy bodies, measured against each other and JSON + base64.

Two bodies of the pool benchmark's shape: a commit (128 groups x 8 rollouts, correct rollouts
with 512-1536 tokens) and a plan answer (64 fresh + 64 replayed questions with ~5 stored
trajectories of ~1k tokens each). Each is encoded and decoded, to the point where every rollout's
token ids and log-probs are numpy arrays, three ways:

* ``json+b64``: today's wire (json.dumps / json.loads, base64 of the packed arrays);
* ``msgpack``: the body without payloads as msgpack, plus three raw little-endian buffers (the
  payload lengths, all token ids, all log-probs);
* ``arrow``: an Arrow IPC stream of one record batch with a row per rollout (list<int32> ids,
  list<float32> log-probs, the scalar fields as columns) and the rest of the body as JSON in the
  schema's metadata.

    .venv/bin/python bench/wire_bench.py [--repeat 30]

It prints median milliseconds and sizes; see docs/benchmarks.md ("Binary frames").
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa

ROLLOUT_COLUMNS = ("reward", "entropy", "replayed", "finish_reason")


def _payload(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(512, 1537))
    return rng.integers(0, 151_000, n).astype("<i4"), (-rng.exponential(0.6, n)).astype("<f4")


def commit_body(
    rng: np.random.Generator,
) -> tuple[dict[str, Any], list[tuple[np.ndarray, np.ndarray] | None]]:
    groups, payloads = [], []
    for q in range(128):
        c = int(rng.integers(0, 9))
        rollouts = []
        for i in range(8):
            rollouts.append(
                {"reward": float(i < c), "entropy": 0.5, "replayed": False, "finish_reason": "stop"}
            )
            payloads.append(_payload(rng) if i < c else None)
        groups.append({"question_id": q + 1, "rollouts": rollouts})
    return {"groups": groups, "metrics": {"train/loss": 0.1}}, payloads


def plan_answer(
    rng: np.random.Generator,
) -> tuple[dict[str, Any], list[tuple[np.ndarray, np.ndarray] | None]]:
    def item(q: int) -> dict[str, Any]:
        return {
            "question_id": q,
            "prompt": [{"role": "user", "content": "x" * int(rng.integers(150, 700))}],
            "ground_truth": "42",
            "data_source": "math",
            "num_samples": 8,
        }

    payloads = []
    replay = []
    for q in range(64):
        cands = []
        for j in range(1 + int(rng.poisson(4))):
            cands.append(
                {
                    "id": q * 100 + j,
                    "question_id": q,
                    "source_run": "r1",
                    "policy_version": 3,
                    "step": 10,
                    "reward": 1.0,
                    "entropy": 0.4,
                    "num_tokens": 1000,
                    "created_at": "2026-01-01T00:00:00Z",
                }
            )
            payloads.append(_payload(rng))
        replay.append({**item(q), "bucket": 3, "probability": 0.01, "candidates": cands})
    body = {"id": "b", "run": "r1", "pool": "p", "step": 5, "fresh": [item(1000 + q) for q in range(64)]}
    return {**body, "replay": replay}, payloads


def _slots(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "groups" in body:
        return [r for g in body["groups"] for r in g["rollouts"]]
    return [c for it in body["replay"] for c in it["candidates"]]


# ---------------------------------------------------------------------------------- json + b64
def json_encode(body: dict[str, Any], payloads: list[Any]) -> bytes:
    for slot, p in zip(_slots(body), payloads, strict=True):
        slot.pop("token_ids_b64", None)
        slot.pop("logprobs_b64", None)
        if p is not None:
            slot["token_ids_b64"] = base64.b64encode(p[0].tobytes()).decode()
            slot["logprobs_b64"] = base64.b64encode(p[1].tobytes()).decode()
    out = json.dumps(body).encode()
    for slot in _slots(body):
        slot.pop("token_ids_b64", None)
        slot.pop("logprobs_b64", None)
    return out


def json_decode(raw: bytes) -> list[Any]:
    body = json.loads(raw)
    out: list[Any] = []
    for slot in _slots(body):
        if "token_ids_b64" in slot:
            ids = np.frombuffer(base64.b64decode(slot["token_ids_b64"], validate=True), "<i4")
            lps = np.frombuffer(base64.b64decode(slot["logprobs_b64"], validate=True), "<f4")
            out.append((ids, lps))
        else:
            out.append(None)
    return out


# --------------------------------------------------------------------------------- msgpack
def msgpack_encode(body: dict[str, Any], payloads: list[Any]) -> bytes:
    lengths = np.array([-1 if p is None else p[0].size for p in payloads], "<i4")
    present = [p for p in payloads if p is not None]
    ids = b"".join(p[0].tobytes() for p in present)
    lps = b"".join(p[1].tobytes() for p in present)
    frame = {"body": body, "lengths": lengths.tobytes(), "token_ids": ids, "logprobs": lps}
    return msgpack.packb(frame)


def msgpack_decode(raw: bytes) -> list[Any]:
    frame = msgpack.unpackb(raw)
    body = frame["body"]
    lengths = np.frombuffer(frame["lengths"], "<i4")
    ids = np.frombuffer(frame["token_ids"], "<i4")
    lps = np.frombuffer(frame["logprobs"], "<f4")
    # the whole request's checks at once
    assert int(lengths[lengths > 0].sum()) == ids.size == lps.size
    assert bool((ids >= 0).all()) and bool(np.isfinite(lps).all()) and bool((lps <= 1e-3).all())
    ends = np.cumsum(np.maximum(lengths, 0))
    starts = ends - np.maximum(lengths, 0)
    slots = _slots(body)
    assert len(slots) == lengths.size
    spans = zip(lengths.tolist(), starts, ends, strict=True)
    return [None if n < 0 else (ids[a:b], lps[a:b]) for n, a, b in spans]


# ----------------------------------------------------------------------------------- arrow
def arrow_encode(body: dict[str, Any], payloads: list[Any]) -> bytes:
    slots = _slots(body)
    rest = json.loads(json.dumps(body))
    for slot in _slots(rest):
        slot.clear()
    lengths = np.array([0 if p is None else p[0].size for p in payloads], "<i4")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i4")
    present = [p for p in payloads if p is not None]
    ids = np.concatenate([p[0] for p in present]) if present else np.empty(0, "<i4")
    lps = np.concatenate([p[1] for p in present]) if present else np.empty(0, "<f4")
    mask = pa.array([p is None for p in payloads])
    cols = {
        "token_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids), mask=mask),
        "logprobs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(lps), mask=mask),
    }
    keys = [k for k in slots[0] if k not in ("token_ids_b64", "logprobs_b64")]
    for k in keys:
        cols[k] = pa.array([sl.get(k) for sl in slots])
    batch = pa.record_batch(cols)
    schema = batch.schema.with_metadata({"body": json.dumps(rest)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(batch.replace_schema_metadata(schema.metadata))
    return bytes(sink.getvalue())


def arrow_decode(raw: bytes) -> list[Any]:
    reader = pa.ipc.open_stream(raw)
    table = reader.read_all()
    body = json.loads(table.schema.metadata[b"body"])
    rows = table.drop_columns(["token_ids", "logprobs"]).to_pylist()
    for slot, row in zip(_slots(body), rows, strict=True):
        slot.update(row)
    tok = table.column("token_ids").combine_chunks()
    lp = table.column("logprobs").combine_chunks()
    ids = tok.values.to_numpy(zero_copy_only=True)
    lps = lp.values.to_numpy(zero_copy_only=True)
    assert bool((ids >= 0).all()) and bool(np.isfinite(lps).all()) and bool((lps <= 1e-3).all())
    offsets = tok.offsets.to_numpy()
    valid = tok.is_valid().to_numpy(zero_copy_only=False)
    return [
        (ids[a:b], lps[a:b]) if v else None
        for a, b, v in zip(offsets[:-1].tolist(), offsets[1:].tolist(), valid.tolist(), strict=True)
    ]


CODECS: dict[str, tuple[Callable[..., bytes], Callable[[bytes], list[Any]]]] = {
    "json+b64": (json_encode, json_decode),
    "msgpack": (msgpack_encode, msgpack_decode),
    "arrow": (arrow_encode, arrow_decode),
}


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| body | encoding | size MB | encode ms | decode ms | encode+decode ms |")
    print("|---|---|---:|---:|---:|---:|")
    for name, make in (("commit", commit_body), ("plan answer", plan_answer)):
        body, payloads = make(rng)
        for codec, (enc, dec) in CODECS.items():
            raw = enc(body, payloads)
            got = dec(raw)
            for a, b in zip(got, payloads, strict=True):
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
            e = _median_ms(lambda enc=enc, body=body, payloads=payloads: enc(body, payloads), args.repeat)
            d = _median_ms(lambda dec=dec, raw=raw: dec(raw), args.repeat)
            print(f"| {name} | {codec} | {len(raw) / 1e6:.2f} | {e:.2f} | {d:.2f} | {e + d:.2f} |")


if __name__ == "__main__":
    main()
