"""The rules of a commit's or an ingest's rollouts, checked once over the whole request: each broken
rule is refused with a 422 whose error names the group and the rollout that breaks it, as JSON and
as a binary frame, and nothing is written. Integral floats count as integers anywhere in the body."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest

from exgrpo_client import frames
from exgrpo_client.schemas import decode_ids, decode_logprobs

from .factories import (
    correct_first,
    make_groups,
    ok,
    plan_batch,
    question_detail,
    rollout,
    run_stats,
    setup_pool,
)

Change = tuple[str, Any]  # a rollout field and its new value (None: the field left out)

#: rule -> (changes to groups[2].rollouts[1], where the error is under it, words of its message)
RULES: dict[str, tuple[list[Change], tuple[str, ...], str]] = {
    "reward": ([("reward", 0.5)], ("reward",), "reward must be 0 or 1"),
    "text": ([("text", "a\x00b")], ("text",), "must not contain NUL"),
    "ids twice": ([("token_ids", [1, 2, 3, 4])], (), "give token_ids or token_ids_b64, not both"),
    "log-probs twice": ([("logprobs", [-0.5] * 4)], (), "give logprobs or logprobs_b64, not both"),
    "ids alone": ([("logprobs_b64", None)], (), "token ids and log-probs come together"),
    "fractional token id": (
        [("token_ids_b64", None), ("logprobs_b64", None), ("token_ids", [1, 2.5]), ("logprobs", [-1.0] * 2)],
        ("token_ids", 1),
        "valid integer",
    ),
}
#: The rules a frame's body can break (its payloads travel in buffers, checked by `frames`).
FRAME_RULES = ("reward", "text")
G, R = 2, 1


def _changed(body: dict[str, Any], changes: list[Change]) -> dict[str, Any]:
    out = copy.deepcopy(body)
    target = out["groups"][G]["rollouts"][R]
    assert target["reward"] == 1.0 and "token_ids_b64" in target  # a correct rollout with a payload
    for key, value in changes:
        if value is None:
            target.pop(key)
        else:
            target[key] = value
    return out


def _frame(body: dict[str, Any]) -> bytes:
    body = copy.deepcopy(body)
    payloads: list[tuple[Any, Any] | None] = []
    for slot in frames.slots(body):
        if "token_ids_b64" in slot:
            payloads.append(
                (decode_ids(slot.pop("token_ids_b64")), decode_logprobs(slot.pop("logprobs_b64")))
            )
        else:
            payloads.append(None)
    return frames.encode(body, payloads)


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any], encoding: str) -> httpx.Response:
    if encoding == "frame":
        return await client.post(url, content=_frame(body), headers={"content-type": frames.MEDIA_TYPE})
    return await client.post(url, json=body)


async def _commit_and_ingest(client: httpx.AsyncClient) -> tuple[dict[str, str], dict[str, Any]]:
    """The urls of an open batch's commit and of the run's ingest, and a body both take."""
    await setup_pool(client, questions=16, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    urls = {
        "commit": f"/v1/pools/p1/batches/{plan['id']}/commit",
        "ingest": "/v1/pools/p1/runs/r1/ingest",
    }
    return urls, body


@pytest.mark.parametrize("encoding", ["json", "frame"])
async def test_each_broken_rule_is_refused_naming_its_rollout(
    client: httpx.AsyncClient, encoding: str
) -> None:
    urls, body = await _commit_and_ingest(client)
    before = await run_stats(client)
    rules = RULES if encoding == "json" else {k: RULES[k] for k in FRAME_RULES}
    for kind, url in urls.items():
        for rule, (changes, under, words) in rules.items():
            case = f"{kind} {encoding} {rule}"
            r = await _send(client, url, _changed(body, changes), encoding)
            assert r.status_code == 422, (case, r.text[:600])
            problem = r.json()
            where = ["body", "groups", G, "rollouts", R, *under]
            assert [e["loc"] for e in problem["errors"]] == [where], (case, problem["errors"])
            assert words in problem["errors"][0]["msg"], (case, problem["errors"])
            assert words in problem["detail"] and "groups.2.rollouts.1" in problem["detail"], case
    assert await run_stats(client) == before
    for url in urls.values():
        ok(await _send(client, url, body, encoding))


async def test_every_rollout_that_breaks_a_rule_is_named(client: httpx.AsyncClient) -> None:
    urls, body = await _commit_and_ingest(client)
    bad = copy.deepcopy(body)
    bad["groups"][0]["rollouts"][3]["reward"] = 2.0
    bad["groups"][5]["rollouts"][0]["logprobs"] = [-0.5] * 4
    r = await client.post(urls["commit"], json=bad)
    assert r.status_code == 422, r.text
    assert [e["loc"] for e in r.json()["errors"]] == [
        ["body", "groups", 0, "rollouts", 3, "reward"],
        ["body", "groups", 5, "rollouts", 0],
    ]


@pytest.mark.parametrize("encoding", ["json", "frame"])
async def test_integral_floats_are_integers_anywhere_in_a_commit(
    client: httpx.AsyncClient, encoding: str
) -> None:
    """A commit whose integers are written 5.0 (ids, question ids, the policy version) stores what
    the same commit with ints stores; 5.5 is refused where it is."""
    urls, body = await _commit_and_ingest(client)
    as_floats = copy.deepcopy(body)
    as_floats["policy_version"] = 0.0
    for g in as_floats["groups"]:
        g["question_id"] = float(g["question_id"])
        if "replay_trajectory_id" in g:
            g["replay_trajectory_id"] = float(g["replay_trajectory_id"])
    qid = body["groups"][G]["question_id"]
    ids = rollout(qid, R, 1.0, b64=False)["token_ids"]
    if encoding == "json":  # the payload as lists, the ids floats (a frame's are binary buffers)
        row = rollout(qid, R, 1.0, b64=False)
        as_floats["groups"][G]["rollouts"][R] = {**row, "token_ids": [float(i) for i in ids]}
    half = copy.deepcopy(as_floats)
    half["groups"][G]["question_id"] = 5.5
    r = await _send(client, urls["commit"], half, encoding)
    assert r.status_code == 422, r.text
    assert [e["loc"] for e in r.json()["errors"]] == [["body", "groups", G, "question_id"]]
    assert ok(await _send(client, urls["commit"], as_floats, encoding))["stored_trajectories"] > 0
    stored = (await question_detail(client, qid, payload=True))["trajectories"]
    assert any(list(decode_ids(t["token_ids_b64"])) == ids for t in stored), stored
