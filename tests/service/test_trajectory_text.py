"""Stored trajectories readable as text: a rollout may carry its response text; the pool stores it
with the collected trajectory and shows it in the question's detail (the dashboard reads it there)
and in exports, but plans stay without it (the trainer works on token ids)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from .factories import commit_batch, group, ok, plan_batch, question_detail, setup_pool


def _text(qid: int, row: int) -> str:
    return f"<think>{qid} + 0 = {qid}</think> \\boxed{{{qid}}} (row {row}, ü, 中)"


def _groups_with_text(plan: dict[str, Any]) -> dict[str, Any]:
    """Rows 0 and 1 correct (collected: 2 of K=4), each rollout with its text."""
    groups = []
    for item in plan["fresh"]:
        g = group(item["question_id"], [1.0, 1.0, 0.0, 0.0])
        for row, r in enumerate(g["rollouts"]):
            r["text"] = _text(item["question_id"], row)
        groups.append(g)
    return {"groups": groups}


async def test_text_is_stored_shown_exported_and_left_out_of_plans(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    ok(await commit_batch(client, plan, _groups_with_text(plan)))

    qid = plan["fresh"][0]["question_id"]
    detail = await question_detail(client, qid)
    assert [t["text"] for t in detail["trajectories"]] == [_text(qid, 0), _text(qid, 1)]

    # a replay plan carries candidates without their text
    replay = await plan_batch(client)
    assert replay["replay"], "the stored questions are replayed"
    assert all(c.get("text") is None for item in replay["replay"] for c in item["candidates"])

    # exports carry it, and an import keeps it
    exported = await client.get("/v1/pools/p1/export")
    records = [json.loads(line) for line in exported.content.splitlines()]
    texts = sorted(r["text"] for r in records if r["type"] == "trajectory")
    assert texts == sorted(_text(f["question_id"], row) for f in plan["fresh"] for row in (0, 1))
    ok(await client.post("/v1/pools/import", params={"name": "p1-copy"}, content=exported.content), 201)
    copy = ok(await client.get("/v1/pools/p1-copy/questions", params={"limit": 1000}))["data"]
    same = next(q for q in copy if q["external_id"] == detail["external_id"])
    copied = await question_detail(client, same["id"], "p1-copy")
    assert [t["text"] for t in copied["trajectories"]] == [_text(qid, 0), _text(qid, 1)]


async def test_rollouts_without_text_and_bad_text(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    body = _groups_with_text(plan)
    body["groups"][0]["rollouts"][0]["text"] = "bad \x00 text"
    refused = await commit_batch(client, plan, body)
    assert refused.status_code == 422 and "text" in refused.text and "NUL" in refused.text
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["step"] == 0, "nothing written"

    # text is optional: rollouts without it are stored with none
    bare = {"groups": [group(f["question_id"], [1.0, 1.0, 0.0, 0.0]) for f in plan["fresh"]]}
    ok(await commit_batch(client, plan, bare))
    detail = await question_detail(client, plan["fresh"][0]["question_id"])
    assert len(detail["trajectories"]) == 2 and all(t["text"] is None for t in detail["trajectories"])
