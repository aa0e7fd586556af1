"""Commit and ingest frames mutated at random, on both backends: never a 5xx, and a refused frame
writes nothing.

Each case takes a valid frame (`to_frame` of a valid body) and breaks it one way: a value anywhere
in it (the frame's own fields, the body's, a group's, a rollout's) replaced by one of another type
or range, a map key or a list item dropped or doubled, a key added, a payload buffer cut, grown or
given a value its rule refuses, or the frame's bytes cut, flipped or followed by others. The
service must answer every case with a 2xx (a mutation that still makes a valid request, say a
reward 1 made 0) or a 4xx problem whose run stats and batch are as they were before it; after all
the cases the plan a commit case aimed at still takes its valid body. The cases come from a seeded
generator, so a failure names the case that reproduces it. `EXGRPO_FRAME_FUZZ_CASES` sets how many
per endpoint and backend (120 by default).
"""

from __future__ import annotations

import copy
import math
import os
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import numpy as np

from .factories import correct_first, make_groups, ok, plan_batch, run_stats, setup_pool
from .test_frames import FRAME, to_frame

CASES = int(os.environ.get("EXGRPO_FRAME_FUZZ_CASES", "120"))

#: values put in place of another: other types, the edges of msgpack's integers, odd floats, long
#: and empty strings and containers
ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    3,
    2**31,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    0.5,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x" * 300,
    "\u00e9\u2603",
    b"",
    b"\x00\xff\x10",
    [],
    [1, 2, 3],
    {},
    {"reward": 1},
]

Path = tuple[str | int, ...]


def _paths(node: Any, at: Path = ()) -> list[Path]:
    """Every place in a decoded frame: map values by key, list items by index."""
    out: list[Path] = [at] if at else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _get(root: Any, path: Path) -> Any:
    node = root
    for step in path:
        node = node[step]
    return node


def _parent(root: Any, path: Path) -> Any:
    return _get(root, path[:-1])


def _containers(root: Any) -> list[Path]:
    """The places that hold a map or a list (the root's map included, as `()`)."""
    return [()] + [p for p in _paths(root) if isinstance(_get(root, p), dict | list)]


def mutate(parts: dict[str, Any], rng: random.Random) -> tuple[bytes, str]:
    """One broken frame made from a valid one's decoded `parts`, and what was done to it."""
    parts = copy.deepcopy(parts)
    kind = rng.choice(("value", "value", "value", "drop", "double", "extra", "buffer", "poke", "bytes"))
    if kind == "value":
        path = rng.choice(_paths(parts))
        value = rng.choice(ODD_VALUES)
        _parent(parts, path)[path[-1]] = copy.deepcopy(value)
        return msgpack.packb(parts), f"{'/'.join(map(str, path))} = {value!r:.40}"
    if kind in ("drop", "double"):
        path = rng.choice([p for p in _containers(parts) if len(_get(parts, p))])
        node = _get(parts, path)
        key = rng.choice(list(node) if isinstance(node, dict) else range(len(node)))
        if kind == "drop":
            del node[key]
        elif isinstance(node, list):
            node.insert(key, copy.deepcopy(node[key]))
        else:  # a map's key twice is not msgpack's to say: the key's value doubled instead
            node[key] = [copy.deepcopy(node[key])] * 2
        return msgpack.packb(parts), f"{kind} {'/'.join(map(str, (*path, key)))}"
    if kind == "extra":
        maps = [p for p in _containers(parts) if isinstance(_get(parts, p), dict)]
        path = rng.choice(maps)
        _get(parts, path)["unexpected"] = rng.choice(ODD_VALUES)
        return msgpack.packb(parts), f"extra key in {'/'.join(map(str, path)) or 'frame'}"
    if kind == "buffer":
        name = rng.choice(("lengths", "token_ids", "logprobs"))
        buf = parts[name]
        change = rng.choice((-1, -3, -4, -8, 1, 4, 8))
        parts[name] = buf[:change] if change < 0 else buf + bytes(rng.randrange(256) for _ in range(change))
        return msgpack.packb(parts), f"{name} {change:+d} bytes"
    if kind == "poke":
        name, dtype = rng.choice((("token_ids", "<i4"), ("logprobs", "<f4"), ("lengths", "<i4")))
        arr = np.frombuffer(parts[name], dtype).copy()
        if not len(arr):
            return msgpack.packb(parts), f"{name} empty, unchanged"
        i = rng.randrange(len(arr))
        odd = (-1, -(2**31), 2**31 - 1, 0) if dtype == "<i4" else (math.nan, math.inf, -math.inf, 0.5, 1e30)
        arr[i] = rng.choice(odd)
        parts[name] = arr.tobytes()
        return msgpack.packb(parts), f"{name}[{i}] = {arr[i]!r}"
    raw = bytearray(msgpack.packb(parts))
    how = rng.choice(("cut", "flip", "append"))
    if how == "cut":
        at = rng.randrange(len(raw))
        return bytes(raw[:at]), f"cut at byte {at} of {len(raw)}"
    if how == "flip":
        spots = sorted(rng.randrange(len(raw)) for _ in range(rng.randint(1, 4)))
        for at in spots:
            raw[at] ^= 1 << rng.randrange(8)
        return bytes(raw), f"bits flipped at {spots}"
    return bytes(raw) + bytes(rng.randrange(256) for _ in range(5)), "5 bytes appended"


async def _fuzz(
    client: httpx.AsyncClient,
    send: Callable[[bytes], Any],
    valid_parts: Callable[[], Any],
    seed: int,
    after_refusal: Callable[[], Any],
) -> Counter[int]:
    """`CASES` mutated frames sent with `send`; `valid_parts()` gives the decoded parts of a frame
    that is valid now (it may plan a batch); `after_refusal()` what must be as it was after a
    refused frame (besides the run's stats). Returns the statuses seen."""
    rng = random.Random(seed)
    statuses: Counter[int] = Counter()
    parts = await valid_parts()
    for case in range(CASES):
        raw, what = mutate(parts, rng)
        before = (await run_stats(client), await after_refusal())
        r = await send(raw)
        where = f"case {case} of seed {seed} ({what}): {r.status_code} {r.text[:300]}"
        statuses[r.status_code] += 1
        assert r.status_code < 500, where
        if r.status_code >= 400:
            assert r.headers["content-type"].startswith("application/problem+json"), where
            assert r.json()["detail"], where
            assert (await run_stats(client), await after_refusal()) == before, where
        else:
            assert 200 <= r.status_code < 300, where
            parts = await valid_parts()  # what it aimed at may be used up (a committed batch)
    return statuses


async def test_mutated_commit_frames_get_4xx_and_write_nothing(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=64, phase="mixed")
    # a few steps first, so that plans replay stored trajectories (slots without payloads)
    for _ in range(3):
        plan = await plan_batch(client)
        body = make_groups(plan, correct_first(lambda q: 1 + q % 3))
        ok(await client.post(f"/v1/pools/p1/batches/{plan['id']}/commit", json=body))
    current: dict[str, Any] = {}

    async def valid_parts() -> Any:
        current["plan"] = await plan_batch(client)
        current["body"] = make_groups(current["plan"], correct_first(lambda q: 1 + q % 3))
        return msgpack.unpackb(to_frame(current["body"]))

    async def send(raw: bytes) -> httpx.Response:
        url = f"/v1/pools/p1/batches/{current['plan']['id']}/commit"
        return await client.post(url, content=raw, headers=FRAME)

    async def batch() -> Any:
        return ok(await client.get(f"/v1/pools/p1/batches/{current['plan']['id']}"))["status"]

    statuses = await _fuzz(client, send, valid_parts, seed=12, after_refusal=batch)
    assert sum(n for s, n in statuses.items() if s >= 400) >= CASES // 2, statuses
    assert {400, 422} <= set(statuses), statuses
    # the batch the last cases aimed at is still open and takes its valid body
    assert await batch() == "planned"
    url = f"/v1/pools/p1/batches/{current['plan']['id']}/commit"
    ok(await client.post(url, content=to_frame(current["body"]), headers=FRAME))
    assert await batch() == "committed"


async def test_mutated_ingest_frames_get_4xx_and_write_nothing(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=64, phase="mixed")
    plan = {"k": 4, "fresh": [{"question_id": q} for q in range(1, 17)], "replay": []}
    body = {"groups": make_groups(plan, correct_first(lambda q: q % 4))["groups"]}
    valid = msgpack.unpackb(to_frame(body))

    async def valid_parts() -> Any:
        return valid

    async def send(raw: bytes) -> httpx.Response:
        return await client.post("/v1/pools/p1/runs/r1/ingest", content=raw, headers=FRAME)

    async def pool_questions() -> Any:
        return ok(await client.get("/v1/pools/p1/questions", params={"limit": 64}))["data"]

    statuses = await _fuzz(client, send, valid_parts, seed=34, after_refusal=pool_questions)
    assert sum(n for s, n in statuses.items() if s >= 400) >= CASES // 2, statuses
    assert {400, 422} <= set(statuses), statuses
