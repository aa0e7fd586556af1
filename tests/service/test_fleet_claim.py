"""The pool-wide claim of a worker fleet shared by runs: one run per answer, chosen fairly (fewest
live leases, then the oldest waiting task), one policy version and sampling per answer, only the
pool's runs (or the ones asked for), disjoint answers under concurrent claims."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

from .factories import (
    B,
    K,
    commit_batch,
    create_pool,
    create_run,
    import_questions,
    make_groups,
    ok,
    plan_batch,
    rollout,
    setup_pool,
)
from .harness import READ_TOKEN, WRITE_OTHER_TOKEN, WRITE_P1_TOKEN, bearer

CLAIM = "/v1/pools/p1/tasks/claim"


async def _claim(
    client: httpx.AsyncClient, n: int, *, runs: list[str] | None = None, worker: str = "w", pool: str = "p1"
) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"worker": worker, "max_tasks": n, "lease_seconds": 60.0}
    if runs is not None:
        body["runs"] = runs
    return ok(await client.post(f"/v1/pools/{pool}/tasks/claim", json=body))["data"]


async def _complete(client: httpx.AsyncClient, task: dict[str, Any]) -> None:
    q = task["question_id"]
    rollouts = [rollout(q, row + 1, 1.0) for row in range(task["num_samples"])]
    body = {"lease_token": task["lease_token"], "rollouts": rollouts}
    ok(await client.post(f"/v1/pools/p1/tasks/{task['id']}/complete", json=body))


def _runs_of(answer: list[dict[str, Any]]) -> set[str]:
    return {t["run"] for t in answer}


async def _three_runs(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """Runs r1, r2, r3 of pool p1, each with one planned batch of B tasks (r1's are the oldest)."""
    await setup_pool(client, questions=24, runs=("r1", "r2", "r3"))
    return {r: await plan_batch(client, run=r, create_tasks=True) for r in ("r1", "r2", "r3")}


async def test_one_run_per_answer_chosen_fairly(client: httpx.AsyncClient) -> None:
    await _three_runs(client)
    # nothing leased anywhere: the oldest waiting task decides (r1 planned first), then the runs
    # without leases come first
    first = await _claim(client, 3)
    second = await _claim(client, 3)
    third = await _claim(client, 3)
    assert [_runs_of(a) for a in (first, second, third)] == [{"r1"}, {"r2"}, {"r3"}]
    assert all(len(a) == 3 for a in (first, second, third))
    # equal leases (3 each): the oldest waiting task again, which is r1's
    again = await _claim(client, 2)
    assert _runs_of(again) == {"r1"}
    # r2 finishes its work: it now has the fewest leased tasks
    for t in second:
        await _complete(client, t)
    fourth = await _claim(client, 100)
    assert _runs_of(fourth) == {"r2"} and len(fourth) == B - 3
    # r3 has 3 leased, r1 5: r3 next, with all its remaining tasks
    fifth = await _claim(client, 100)
    assert _runs_of(fifth) == {"r3"} and len(fifth) == B - 3
    last = await _claim(client, 100)
    assert _runs_of(last) == {"r1"} and len(last) == B - 5
    assert await _claim(client, 100) == []
    claimed = first + second + third + again + fourth + fifth + last
    assert len({t["id"] for t in claimed}) == len(claimed) == 3 * B

    metrics = (await client.get("/metrics")).text
    found = re.search(r'^exgrpo_tasks_claimed_total\{claim="pool",pool="p1",run="r2"\} (\S+)$', metrics, re.M)
    assert found is not None and float(found.group(1)) == B


async def test_claim_serves_only_the_runs_asked_for(client: httpx.AsyncClient) -> None:
    plans = await _three_runs(client)
    # another pool's tasks are never handed out by p1's claim
    await create_pool(client, "p2")
    await import_questions(client, "p2", 24)
    await create_run(client, "p2", "r1")
    await plan_batch(client, "p2", "r1", create_tasks=True)

    got = [await _claim(client, 3, runs=["r3", "r2"]) for _ in range(4)]
    assert [_runs_of(a) for a in got] == [{"r2"}, {"r3"}, {"r2"}, {"r3"}]
    assert {t["batch_id"] for a in got for t in a} == {plans["r2"]["id"], plans["r3"]["id"]}
    rest = []
    while answer := await _claim(client, 5):
        rest += answer
    assert _runs_of(rest) == {"r1", "r2", "r3"} and len(rest) == 3 * B - 12
    assert len(await _claim(client, 100, pool="p2")) == B

    unknown = await client.post(CLAIM, json={"worker": "w", "runs": ["r2", "nope", "zz"]})
    assert unknown.status_code == 404 and "['nope', 'zz']" in unknown.json()["detail"]
    drained = await client.post(CLAIM, json={"worker": "w", "runs": ["r1"]})
    assert drained.status_code == 200 and drained.json()["count"] == 0
    missing_pool = await client.post("/v1/pools/nope/tasks/claim", json={"worker": "w"})
    assert missing_pool.status_code == 404
    bad = await client.post(CLAIM, json={"worker": "w", "runs": ["not a name!"]})
    assert bad.status_code == 422


async def test_an_answer_holds_one_policy_version_and_sampling(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24)
    for v in (0, 1):
        body = {"version": v, "uri": f"file:///ckpt/v{v}", "step": v}
        ok(await client.post("/v1/pools/p1/runs/r1/policy-versions", json=body), 201)
    hot = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "min_tokens": 0}
    first = await plan_batch(client, create_tasks=True, policy_version=0, sampling=hot)
    # the trainer generated this step itself: the batch is committed with its tasks still queued
    ok(await commit_batch(client, first, make_groups(first, lambda q, row: 0.0)))
    cold = {**hot, "temperature": 0.5}
    second = await plan_batch(client, create_tasks=True, policy_version=1, sampling=cold)

    older = await _claim(client, 100)
    assert {(t["batch_id"], t["policy_version"], t["policy_uri"]) for t in older} == {
        (first["id"], 0, "file:///ckpt/v0")
    }
    assert all(t["sampling"] == hot for t in older) and len(older) == B
    newer = await _claim(client, 100)
    assert {(t["batch_id"], t["policy_version"], t["policy_uri"]) for t in newer} == {
        (second["id"], 1, "file:///ckpt/v1")
    }
    assert all(t["sampling"] == cold and t["policy_exact"] for t in newer) and len(newer) == B


async def test_concurrent_claims_are_disjoint(client: httpx.AsyncClient) -> None:
    await _three_runs(client)
    answers = list(await asyncio.gather(*(_claim(client, 4, worker=f"w{i}") for i in range(8))))
    while answer := await _claim(client, 4):  # whatever concurrent claims left over
        answers.append(answer)
    ids = [t["id"] for a in answers for t in a]
    assert len(ids) == len(set(ids)) == 3 * B
    assert all(len(_runs_of(a)) <= 1 for a in answers)
    assert len({t["lease_token"] for a in answers for t in a}) == 3 * B


async def test_claim_needs_write_access_to_the_pool(client: httpx.AsyncClient) -> None:
    await _three_runs(client)
    body = {"worker": "w", "max_tasks": 1}
    assert (await client.post(CLAIM, json=body, headers=bearer(READ_TOKEN))).status_code == 403
    assert (await client.post(CLAIM, json=body, headers=bearer(WRITE_OTHER_TOKEN))).status_code == 403
    answer = ok(await client.post(CLAIM, json=body, headers=bearer(WRITE_P1_TOKEN)))
    assert answer["count"] == 1 and answer["data"][0]["num_samples"] == K
