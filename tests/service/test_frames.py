"""Binary frames (`application/x-msgpack`) beside JSON: commit, ingest, plan, batch and select give
the same answers and store the same trajectories in both encodings; a frame that cannot be read
or breaks a payload rule is refused with a clear 4xx and writes nothing."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import asyncpg
import httpx
import msgpack
import numpy as np
import pytest

from exgrpo_client import frames
from exgrpo_client.schemas import unpack_ids, unpack_logprobs

from .factories import (
    commit_batch,
    correct_first,
    make_groups,
    ok,
    plan_batch,
    question_detail,
    run_stats,
    setup_pool,
)
from .harness import Backend

FRAME = {"content-type": frames.MEDIA_TYPE}
ACCEPT = {"accept": frames.MEDIA_TYPE}


def to_frame(body: dict[str, Any]) -> bytes:
    """A JSON body (payloads as base64 or lists) as a frame."""
    body = copy.deepcopy(body)
    payloads: list[tuple[Any, Any] | None] = []
    for slot in frames.slots(body):
        if "token_ids_b64" in slot:
            ids = np.array(unpack_ids(slot.pop("token_ids_b64")), dtype="<i4")
            lps = np.array(unpack_logprobs(slot.pop("logprobs_b64")), dtype="<f4")
            payloads.append((ids, lps))
        elif "token_ids" in slot:
            payloads.append((np.array(slot.pop("token_ids"), "<i4"), np.array(slot.pop("logprobs"), "<f4")))
        else:
            payloads.append(None)
    return frames.encode(body, payloads)


def plain(r: httpx.Response) -> dict[str, Any]:
    """An answer, JSON or frame, with every payload as lists (for comparing the two)."""
    if r.headers["content-type"].startswith(frames.MEDIA_TYPE):
        body, payloads = frames.decode(r.content)
        for slot, p in zip(frames.slots(body), payloads.arrays(), strict=True):
            slot.pop("token_ids_b64", None)
            slot.pop("logprobs_b64", None)
            if p is not None:
                slot["token_ids"], slot["logprobs"] = p[0].tolist(), p[1].tolist()
        return body
    body = r.json()
    for slot in frames.slots(body):
        b64 = slot.pop("token_ids_b64", None), slot.pop("logprobs_b64", None)
        if b64[0] is not None:
            slot["token_ids"], slot["logprobs"] = unpack_ids(b64[0]), unpack_logprobs(b64[1] or "")
    return body


async def test_commit_as_a_frame_stores_what_json_stores(client: httpx.AsyncClient) -> None:
    for pool in ("p1", "p2"):
        await setup_pool(client, pool, questions=16, phase="mixed")
    answers = {}
    for pool, frame in (("p1", False), ("p2", True)):
        for step in range(3):
            plan = await plan_batch(client, pool)
            # rewards and tokens by the question's place in its pool (p2's ids follow p1's)
            body = make_groups(
                plan,
                correct_first(lambda q: 1 + (q - 1) % 16 % 3),
                tokens=lambda q, row: [(q - 1) % 16, row + 1, 7, 11 * (row + 1)],
            )
            if frame:
                r = await client.post(
                    f"/v1/pools/{pool}/batches/{plan['id']}/commit",
                    content=to_frame(body),
                    headers={**FRAME, "Idempotency-Key": f"k{step}"},
                )
            else:
                r = await commit_batch(client, plan, body, **{"Idempotency-Key": f"k{step}"})
            answers[(pool, step)] = {k: v for k, v in ok(r).items() if k != "batch_id"}
    for step in range(3):
        assert answers[("p1", step)] == answers[("p2", step)]
        assert answers[("p1", step)]["stored_trajectories"] > 0
    assert (await run_stats(client, "p1")) | {"pool": ""} == (await run_stats(client, "p2")) | {"pool": ""}
    # question ids of p2 follow those of p1 in import order: the same questions hold the same data
    first_p2 = min(q["id"] for q in ok(await client.get("/v1/pools/p2/questions"))["data"])
    for qid in range(1, 17):
        a = await question_detail(client, qid, "p1", payload=True)
        b = await question_detail(client, first_p2 + qid - 1, "p2", payload=True)
        strip = ("id", "question_id", "created_at")
        ta = [{k: v for k, v in t.items() if k not in strip} for t in a["trajectories"]]
        tb = [{k: v for k, v in t.items() if k not in strip} for t in b["trajectories"]]
        assert ta == tb


async def test_a_frame_commit_sent_again_with_its_key_answers_the_first_answer(
    client: httpx.AsyncClient,
) -> None:
    await setup_pool(client, questions=16, phase="mixed")
    plan = await plan_batch(client)
    raw = to_frame(make_groups(plan, correct_first(lambda q: 2)))
    url = f"/v1/pools/p1/batches/{plan['id']}/commit"
    first = await client.post(url, content=raw, headers={**FRAME, "Idempotency-Key": "same"})
    again = await client.post(url, content=raw, headers={**FRAME, "Idempotency-Key": "same"})
    assert ok(first) == ok(again) and again.headers.get("idempotent-replayed") == "true"
    # without a key the batch's own record answers: the same groups are the same commit
    assert ok(await client.post(url, content=raw, headers=FRAME))["step"] == 1
    # other payloads are another commit
    other = make_groups(plan, correct_first(lambda q: 2), tokens=lambda q, row: [q, row, 99])
    r = await client.post(url, content=to_frame(other), headers=FRAME)
    assert r.status_code == 409, r.text


async def test_a_commit_sent_again_in_the_other_encoding_is_the_same_commit(
    client: httpx.AsyncClient,
) -> None:
    """A trainer that lost a commit's answer may send it again as JSON after a frame (or the
    reverse): the same groups and payloads are the same commit, answered with its result."""
    await setup_pool(client, questions=16, phase="mixed")
    for step, first_as_frame in ((1, True), (2, False)):
        plan = await plan_batch(client)
        body = make_groups(plan, correct_first(lambda q: 2), tokens=lambda q, row: [q, row + 1, 5])
        url = f"/v1/pools/p1/batches/{plan['id']}/commit"
        as_frame = {"content": to_frame(body), "headers": FRAME}
        as_json: dict[str, Any] = {"json": body}
        first, again = (as_frame, as_json) if first_as_frame else (as_json, as_frame)
        answer = ok(await client.post(url, **first))
        assert answer["step"] == step
        assert ok(await client.post(url, **again)) == answer
        # other payloads are another commit, in either encoding
        other = make_groups(plan, correct_first(lambda q: 2), tokens=lambda q, row: [q, row + 1, 6])
        assert (await client.post(url, json=other)).status_code == 409
        assert (await client.post(url, content=to_frame(other), headers=FRAME)).status_code == 409


async def test_plan_batch_and_select_answer_the_same_as_frames(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24, phase="mixed")
    for _ in range(3):
        plan = await plan_batch(client)
        ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
    r = await client.post("/v1/pools/p1/runs/r1/batches", json={}, headers=ACCEPT)
    assert r.status_code == 201 and r.headers["content-type"] == frames.MEDIA_TYPE
    framed = plain(r)
    assert framed["replay"] and all(c["token_ids"] for i in framed["replay"] for c in i["candidates"])
    as_json = plain(await client.get(f"/v1/pools/p1/batches/{framed['id']}"))
    assert framed == as_json
    assert plain(await client.get(f"/v1/pools/p1/batches/{framed['id']}", headers=ACCEPT)) == as_json
    for mode in ("all", "lowest_stored_entropy", "none"):
        body = {"n": 6, "seed": 5, "candidates": mode}
        a = await client.post("/v1/pools/p1/runs/r1/select", json=body)
        b = await client.post("/v1/pools/p1/runs/r1/select", json=body, headers=ACCEPT)
        assert b.headers["content-type"] == frames.MEDIA_TYPE
        assert plain(a) == plain(b) and plain(a)["replay"]
    # the SDK's reading of a frame: the same models, payloads as arrays
    from exgrpo_client import decode_trajectory, schemas

    model = frames.decode_model(r.content, schemas.BatchPlan)
    reference = schemas.BatchPlan.model_validate_json(
        (await client.get(f"/v1/pools/p1/batches/{framed['id']}")).content
    )
    for a_item, b_item in zip(model.replay, reference.replay, strict=True):
        for ca, cb in zip(a_item.candidates, b_item.candidates, strict=True):
            assert ca.id == cb.id
            for x, y in zip(decode_trajectory(ca), decode_trajectory(cb), strict=True):
                assert np.array_equal(x, y)


async def test_ingest_as_a_frame(client: httpx.AsyncClient) -> None:
    for pool in ("p1", "p2"):
        await setup_pool(client, pool, questions=8, phase="mixed")
    body = {
        "groups": make_groups(
            {"k": 4, "fresh": [{"question_id": q} for q in range(1, 9)], "replay": []},
            correct_first(lambda q: q % 4),
        )["groups"]
    }
    a = ok(await client.post("/v1/pools/p1/runs/r1/ingest", json=body))
    shifted = copy.deepcopy(body)
    for g in shifted["groups"]:
        g["question_id"] += 8
    b = ok(await client.post("/v1/pools/p2/runs/r1/ingest", content=to_frame(shifted), headers=FRAME))
    assert a == b and a["stored_trajectories"] > 0


def _frame_parts(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = msgpack.unpackb(to_frame(body))
    return out


@pytest.mark.parametrize(
    ("case", "status", "words"),
    [
        ("not msgpack", 400, "not a msgpack frame"),
        ("wrong version", 400, "version 1"),
        ("odd buffer", 400, "whole number"),
        ("lengths short", 400, "payload slots"),
        ("tokens missing", 422, "add up to"),
        ("negative id", 422, "groups[0].rollouts[0]"),
        ("nan log-prob", 422, "finite"),
        ("positive log-prob", 422, "<= 0"),
        ("payload twice", 422, "no token_ids_b64"),
        ("bad body", 422, "reward"),
    ],
)
async def test_a_bad_frame_is_refused_and_writes_nothing(
    client: httpx.AsyncClient, case: str, status: int, words: str
) -> None:
    await setup_pool(client, questions=16, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    parts = _frame_parts(body)
    ids = np.frombuffer(parts["token_ids"], "<i4").copy()
    lps = np.frombuffer(parts["logprobs"], "<f4").copy()
    raw: bytes
    if case == "not msgpack":
        raw = b"\xc1 this is not msgpack"
    elif case == "wrong version":
        raw = msgpack.packb({**parts, "v": 7})
    elif case == "odd buffer":
        raw = msgpack.packb({**parts, "token_ids": parts["token_ids"][:-1]})
    elif case == "lengths short":
        raw = msgpack.packb({**parts, "lengths": parts["lengths"][:-4]})
    elif case == "tokens missing":
        raw = msgpack.packb({**parts, "token_ids": ids[:-1].tobytes()})
    elif case == "negative id":
        ids[0] = -5
        raw = msgpack.packb({**parts, "token_ids": ids.tobytes()})
    elif case in ("nan log-prob", "positive log-prob"):
        lps[-1] = np.nan if case == "nan log-prob" else 0.5
        raw = msgpack.packb({**parts, "logprobs": lps.tobytes()})
    elif case == "payload twice":
        parts["body"]["groups"][0]["rollouts"][0]["token_ids_b64"] = "AAAAAA=="
        raw = msgpack.packb(parts)
    else:
        parts["body"]["groups"][0]["rollouts"][0]["reward"] = 0.5
        raw = msgpack.packb(parts)
    before = await run_stats(client)
    r = await client.post(f"/v1/pools/p1/batches/{plan['id']}/commit", content=raw, headers=FRAME)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert words in r.json()["detail"], r.json()["detail"]
    assert await run_stats(client) == before
    assert ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}"))["status"] == "planned"


@pytest.mark.parametrize("backend", ["postgres-redis"], indirect=True)
async def test_payloads_are_checked_before_the_run_is_locked(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    """An ingest or a commit decodes and checks its payloads before it waits for its run's row
    lock: a bad payload is refused while another transaction holds the run."""
    await setup_pool(client, questions=8, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    body["groups"][1]["rollouts"][0]["logprobs"] = [0.5] * 4
    body["groups"][1]["rollouts"][0].pop("logprobs_b64")
    parts = msgpack.unpackb(to_frame(make_groups(plan, correct_first(lambda q: 2))))
    lps = np.frombuffer(parts["logprobs"], "<f4").copy()
    lps[3] = 0.5  # a frame that is fine but for one log-prob
    frame = msgpack.packb({**parts, "logprobs": lps.tobytes()})
    commit = f"/v1/pools/p1/batches/{plan['id']}/commit"
    conn = await asyncpg.connect(backend.database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        async with conn.transaction():
            await conn.execute("SELECT id FROM run WHERE name = 'r1' FOR UPDATE")
            for sent in (
                client.post("/v1/pools/p1/runs/r1/ingest", json=body, headers={"Idempotency-Key": "i1"}),
                client.post(commit, json=body),
                client.post(commit, content=frame, headers=FRAME),
            ):
                # a request that waited for the lock would hang here until the transaction ends
                r = await asyncio.wait_for(sent, timeout=60)
                assert r.status_code == 422 and "log-probs must be <= 0" in r.text, r.text
    finally:
        await conn.close()
    assert ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}"))["status"] == "planned"
