"""Generation tasks for remote rollout workers: claims, leases, completion, failure, results."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from typing import Any

import httpx

from .factories import (
    B,
    K,
    commit_batch,
    correct_first,
    make_groups,
    ok,
    plan_batch,
    rollout,
    setup_pool,
)
from .harness import Backend, serve


async def _mixed_plan_with_tasks(client: httpx.AsyncClient) -> dict[str, Any]:
    await setup_pool(client, phase="mixed", questions=32)
    first = await plan_batch(client)
    ok(await commit_batch(client, first, make_groups(first, correct_first(lambda q: 2))))
    plan = await plan_batch(client, create_tasks=True)
    assert plan["replay"] and plan["fresh"]
    return plan


async def _claim(
    client: httpx.AsyncClient, worker: str, n: int = 1, lease: float = 60.0
) -> list[dict[str, Any]]:
    body = {"worker": worker, "max_tasks": n, "lease_seconds": lease}
    return ok(await client.post("/v1/pools/p1/runs/r1/tasks/claim", json=body))["data"]


def _rollouts(task: dict[str, Any], correct: int = 1) -> list[dict[str, Any]]:
    q = task["question_id"]
    return [rollout(q, row + 1, 1.0 if row < correct else 0.0) for row in range(task["num_samples"])]


async def _complete(
    client: httpx.AsyncClient, task: dict[str, Any], token: str | None = None
) -> httpx.Response:
    body = {"lease_token": token or task["lease_token"], "rollouts": _rollouts(task)}
    return await client.post(f"/v1/pools/p1/tasks/{task['id']}/complete", json=body)


async def _status(client: httpx.AsyncClient, plan: dict[str, Any]) -> dict[str, Any]:
    return ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}/status"))


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def test_plan_creates_one_task_per_question(client: httpx.AsyncClient) -> None:
    plan = await _mixed_plan_with_tasks(client)
    status = await _status(client, plan)
    assert status["num_tasks"] == status["tasks_pending"] == B and status["status"] == "planned"
    tasks = await _claim(client, "w1", 100)
    assert len(tasks) == B
    samples = {(t["question_id"], t["replayed"]): t["num_samples"] for t in tasks}
    want = {(f["question_id"], False): K for f in plan["fresh"]}
    want |= {(r["question_id"], True): K - 1 for r in plan["replay"]}
    assert samples == want
    for t in tasks:
        assert t["batch_id"] == plan["id"] and t["run"] == "r1" and t["status"] == "leased"
        assert t["attempts"] == 1 and t["lease_token"] and t["lease_expires_at"] and t["prompt"]
    assert (await _status(client, plan))["tasks_leased"] == B
    assert await _claim(client, "w2", 100) == []

    # re-planning cancels the tasks of the abandoned batch
    new = await plan_batch(client, replan=True, create_tasks=True)
    old = await _status(client, plan)
    assert old["status"] == "abandoned" and old["tasks_failed"] == B
    assert (await _status(client, new))["tasks_pending"] == B
    assert (await _complete(client, tasks[0])).status_code == 409


async def test_two_workers_claim_disjoint_tasks(client: httpx.AsyncClient) -> None:
    plan = await _mixed_plan_with_tasks(client)
    first, second = await asyncio.gather(_claim(client, "w1", 5), _claim(client, "w2", 5))
    assert sorted([len(first), len(second)]) == [B - 5, 5]
    ids1, ids2 = {t["id"] for t in first}, {t["id"] for t in second}
    assert not ids1 & ids2 and len(ids1 | ids2) == B
    assert len({t["lease_token"] for t in first + second}) == B
    assert (await _status(client, plan))["tasks_leased"] == B
    assert await _claim(client, "w3", 5) == []


async def test_lease_expiry_and_lost_leases(client: httpx.AsyncClient) -> None:
    await _mixed_plan_with_tasks(client)
    metrics = (await client.get("/metrics")).text
    expiries = _metric(metrics, "exgrpo_task_lease_expiries_total")

    # leases of 0.6 s: the three requests before the wait must come within one on a busy machine
    [slow] = await _claim(client, "slow", 1, lease=0.6)
    # a wrong token is refused while the lease is valid
    wrong = await _complete(client, slow, token="not-the-token")
    assert wrong.status_code == 409 and "lease lost" in wrong.json()["detail"]
    renewed = ok(
        await client.post(
            f"/v1/pools/p1/tasks/{slow['id']}/renew",
            json={"lease_token": slow["lease_token"], "lease_seconds": 0.6},
        )
    )
    assert _time(renewed["lease_expires_at"]) >= _time(slow["lease_expires_at"])
    await asyncio.sleep(0.8)

    [taken] = await _claim(client, "fast", 1)
    assert taken["id"] == slow["id"] and taken["lease_token"] != slow["lease_token"]
    assert taken["attempts"] == 2
    metrics = (await client.get("/metrics")).text
    assert _metric(metrics, "exgrpo_task_lease_expiries_total") == expiries + 1

    # the first worker lost the task: completing, renewing or failing it is a conflict
    late = await _complete(client, slow)
    assert late.status_code == 409 and "lease lost" in late.json()["detail"]
    assert late.headers["content-type"].startswith("application/problem+json")
    renew = await client.post(
        f"/v1/pools/p1/tasks/{slow['id']}/renew", json={"lease_token": slow["lease_token"]}
    )
    assert renew.status_code == 409
    fail = await client.post(
        f"/v1/pools/p1/tasks/{slow['id']}/fail", json={"lease_token": slow["lease_token"], "error": "x"}
    )
    assert fail.status_code == 409

    done = ok(await _complete(client, taken))
    assert done["status"] == "completed" and done["lease_expires_at"] is None
    # a retried completion with the same token answers the same; the loser still gets 409
    assert ok(await _complete(client, taken))["status"] == "completed"
    assert (await _complete(client, slow)).status_code == 409
    assert (
        await client.post(
            "/v1/pools/p1/tasks/999999/complete", json={"lease_token": "x", "rollouts": _rollouts(taken)}
        )
    ).status_code == 404


async def test_completion_is_validated(client: httpx.AsyncClient) -> None:
    await _mixed_plan_with_tasks(client)
    [task] = await _claim(client, "w", 1)
    url = f"/v1/pools/p1/tasks/{task['id']}/complete"
    token = task["lease_token"]
    short = await client.post(url, json={"lease_token": token, "rollouts": _rollouts(task)[:-1]})
    assert short.status_code == 422 and f"asks for {task['num_samples']} samples" in short.json()["detail"]
    no_payload = [{"reward": 0.0}] * task["num_samples"]
    r = await client.post(url, json={"lease_token": token, "rollouts": no_payload})
    assert r.status_code == 422 and "token ids" in r.json()["detail"]
    replayed = [{**x, "replayed": True} for x in _rollouts(task)]
    r = await client.post(url, json={"lease_token": token, "rollouts": replayed})
    assert r.status_code == 422 and "replayed" in r.json()["detail"]
    status = ok(await client.get(f"/v1/pools/p1/batches/{task['batch_id']}/status"))
    assert status["tasks_completed"] == 0 and status["tasks_leased"] == 1


async def test_fail_with_retry_puts_the_task_back(client: httpx.AsyncClient) -> None:
    await _mixed_plan_with_tasks(client)
    [task] = await _claim(client, "w1", 1)
    back = ok(
        await client.post(
            f"/v1/pools/p1/tasks/{task['id']}/fail",
            json={"lease_token": task["lease_token"], "error": "CUDA OOM", "retry": True},
        )
    )
    assert back["status"] == "pending" and back["lease_token"] is None
    [again] = await _claim(client, "w2", 1)
    assert again["id"] == task["id"] and again["attempts"] == 2
    # without retry it stays failed and is not handed out again
    gone = ok(
        await client.post(
            f"/v1/pools/p1/tasks/{again['id']}/fail",
            json={"lease_token": again["lease_token"], "error": "bad prompt", "retry": False},
        )
    )
    assert gone["status"] == "failed"
    rest = await _claim(client, "w3", 100)
    assert task["id"] not in {t["id"] for t in rest} and len(rest) == B - 1
    metrics = (await client.get("/metrics")).text
    assert _metric(metrics, "exgrpo_tasks_failed_total") == 2


async def test_failing_too_often_is_final(client: httpx.AsyncClient) -> None:
    await _mixed_plan_with_tasks(client)
    task_id = None
    for attempt in range(1, 4):
        [t] = await _claim(client, f"w{attempt}", 1)
        assert task_id in (None, t["id"]) and t["attempts"] == attempt
        task_id = t["id"]
        r = ok(
            await client.post(
                f"/v1/pools/p1/tasks/{t['id']}/fail", json={"lease_token": t["lease_token"], "error": "boom"}
            )
        )
    assert r["status"] == "failed"  # task_max_attempts = 3


async def test_results_long_poll_returns_complete_groups(client: httpx.AsyncClient) -> None:
    plan = await _mixed_plan_with_tasks(client)
    url = f"/v1/pools/p1/batches/{plan['id']}/results"
    partial = ok(await client.get(url))
    assert partial == {"batch_id": plan["id"], "complete": False, "groups": []}
    tasks = await _claim(client, "w", 100)

    async def workers() -> None:
        await asyncio.sleep(0.1)
        for t in tasks:
            ok(await _complete(client, t))
            await asyncio.sleep(0.01)

    polled, _ = await asyncio.gather(client.get(url, params={"wait": 10}), workers())
    results = ok(polled)
    assert results["complete"] is True and len(results["groups"]) == B
    by_q = {t["question_id"]: t for t in tasks}
    for g in results["groups"]:
        t = by_q[g["question_id"]]
        assert len(g["rollouts"]) == t["num_samples"]
        assert g["replayed"] is t["replayed"]  # a replayed question's K-1 samples say so
        assert [r["reward"] for r in g["rollouts"]] == [r["reward"] for r in _rollouts(t)]
    status = await _status(client, plan)
    assert status["tasks_completed"] == B and status["result"] is None

    # the trainer adds the replayed rows and commits the batch
    replayed = {r["question_id"]: r for r in plan["replay"]}
    groups = []
    for g in results["groups"]:
        item = replayed.get(g["question_id"])
        if item is not None and g["replayed"]:
            groups.append(
                {
                    "question_id": g["question_id"],
                    "rollouts": [{"reward": 1.0, "replayed": True}, *g["rollouts"]],
                    "replay_trajectory_id": item["candidates"][0]["id"],
                }
            )
        else:
            groups.append({"question_id": g["question_id"], "rollouts": g["rollouts"]})
    result = ok(await commit_batch(client, plan, {"groups": groups}))
    assert result["collected_groups"] == B and result["step"] == 2
    status = await _status(client, plan)
    assert status["status"] == "committed" and status["result"] == result


async def test_the_results_long_poll_gives_its_place_up_while_it_waits(backend: Backend) -> None:
    """With one request worked on at a time (max_active_requests=1), the workers' completions are
    served while the trainer long-polls: a poll that kept its place would see none of them before
    its deadline and answer incomplete."""
    async with serve(backend.settings(max_active_requests=1)) as client:
        plan = await _mixed_plan_with_tasks(client)
        tasks = await _claim(client, "w", 100)

        async def workers() -> None:
            await asyncio.sleep(0.1)
            for t in tasks:
                ok(await _complete(client, t))

        url = f"/v1/pools/p1/batches/{plan['id']}/results"
        polled, _ = await asyncio.gather(client.get(url, params={"wait": 30}), workers())
        results = ok(polled)
        assert results["complete"] is True and len(results["groups"]) == len(tasks)


async def test_results_long_poll_ends_when_a_task_failed_for_good(client: httpx.AsyncClient) -> None:
    plan = await _mixed_plan_with_tasks(client)
    url = f"/v1/pools/p1/batches/{plan['id']}/results"
    tasks = await _claim(client, "w", 100)
    for t in tasks[1:]:
        ok(await _complete(client, t))
    bad = tasks[0]
    body = {"lease_token": bad["lease_token"], "error": "bad prompt", "retry": False}
    ok(await client.post(f"/v1/pools/p1/tasks/{bad['id']}/fail", json=body))
    # nothing is pending or leased: the poll answers at once instead of waiting out its 10 s
    start = asyncio.get_running_loop().time()
    results = ok(await client.get(url, params={"wait": 10}))
    assert asyncio.get_running_loop().time() - start < 5
    assert results["complete"] is False
    assert sorted(g["question_id"] for g in results["groups"]) == sorted(t["question_id"] for t in tasks[1:])
    status = await _status(client, plan)
    assert (status["tasks_completed"], status["tasks_failed"]) == (len(tasks) - 1, 1)


async def test_results_of_a_batch_without_tasks(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    plan = await plan_batch(client)
    r = await client.get(f"/v1/pools/p1/batches/{plan['id']}/results")
    assert r.status_code == 409 and "create_tasks" in r.json()["detail"]
    assert (await _status(client, plan))["num_tasks"] == 0


# ------------------------------------------------------------------ policy versions and sampling
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 256, "min_tokens": 2}


async def _publish(client: httpx.AsyncClient, *versions: int) -> None:
    for v in versions:
        body = {"version": v, "uri": f"file:///ckpt/r1/v{v}", "step": v}
        ok(await client.post("/v1/pools/p1/runs/r1/policy-versions", json=body), 201)


async def _complete_as(
    client: httpx.AsyncClient, task: dict[str, Any], version: int | None
) -> httpx.Response:
    body: dict[str, Any] = {"lease_token": task["lease_token"], "rollouts": _rollouts(task)}
    if version is not None:
        body["policy_version"] = version
    return await client.post(f"/v1/pools/p1/tasks/{task['id']}/complete", json=body)


async def test_tasks_carry_the_planned_version_and_sampling(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24)
    await _publish(client, 0, 1, 2)
    plan = await plan_batch(client, create_tasks=True, policy_version=1, sampling=SAMPLING)
    assert plan["policy_version"] == 1
    tasks = await _claim(client, "w", 100)
    assert len(tasks) == B
    for t in tasks:
        assert (t["policy_version"], t["policy_exact"], t["policy_uri"]) == (1, True, "file:///ckpt/r1/v1")
        assert t["sampling"] == SAMPLING
    # renew and fail answer the same settings
    renewed = ok(
        await client.post(
            f"/v1/pools/p1/tasks/{tasks[0]['id']}/renew", json={"lease_token": tasks[0]["lease_token"]}
        )
    )
    assert renewed["sampling"] == SAMPLING and renewed["policy_uri"] == "file:///ckpt/r1/v1"


async def test_plan_version_rules(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24)
    url = "/v1/pools/p1/runs/r1/batches"
    # nothing published: a named version is refused, the default plans with the run's version
    r = await client.post(url, json={"create_tasks": True, "policy_version": 0})
    assert r.status_code == 409 and "no published policy version 0" in r.json()["detail"]
    await _publish(client, 0, 3)
    r = await client.post(url, json={"create_tasks": True, "policy_version": 2})
    assert r.status_code == 409 and "published: [0, 3]" in r.json()["detail"]
    r = await client.post(url, json={"create_tasks": True, "policy_version": 0, "min_policy_version": 1})
    assert r.status_code == 422 and "min_policy_version 1" in r.json()["detail"]
    # no batch came of the refused plans
    assert (await plan_batch(client, create_tasks=True))["policy_version"] == 3  # the newest by default


async def test_default_plan_of_an_unpublished_run_has_no_uri(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24)
    plan = await plan_batch(client, create_tasks=True)
    [task] = await _claim(client, "w", 1)
    assert plan["policy_version"] == 0 and task["policy_version"] == 0
    assert task["policy_exact"] is True and task["policy_uri"] is None and task["sampling"] is None
    # an older worker does not name a version: accepted, the task's version recorded
    ok(await _complete_as(client, task, None))
    results = ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}/results"))
    assert [g["policy_version"] for g in results["groups"]] == [0]


async def test_exact_task_takes_only_its_version(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24)
    await _publish(client, 0, 1, 2)
    plan = await plan_batch(client, create_tasks=True, policy_version=1)
    first, second = await _claim(client, "w", 2)
    for wrong in (0, 2):
        r = await _complete_as(client, first, wrong)
        assert r.status_code == 409
        assert (
            f"exactly policy version 1, the rollouts were generated with version {wrong}"
            in r.json()["detail"]
        )
    # refused: the task is unchanged (still leased to the worker, nothing stored)
    status = await _status(client, plan)
    assert (status["tasks_leased"], status["tasks_completed"]) == (2, 0)
    done = ok(await _complete_as(client, first, 1))
    assert done["status"] == "completed"
    # a retried completion with the same token answers the same, whatever version it names
    assert ok(await _complete_as(client, first, 1))["status"] == "completed"
    ok(await _complete_as(client, second, None))
    results = ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}/results"))
    assert sorted(g["policy_version"] for g in results["groups"]) == [1, 1]
    metrics = (await client.get("/metrics")).text
    assert _metric(metrics, "exgrpo_task_version_refusals_total") == 2


async def test_asynchronous_task_takes_its_version_or_newer(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24)
    await _publish(client, 0, 1, 2)
    plan = await plan_batch(
        client, create_tasks=True, policy_version=2, min_policy_version=1, sampling=SAMPLING
    )
    assert plan["policy_version"] == 2
    tasks = await _claim(client, "w", 3)
    for t in tasks:
        assert (t["policy_version"], t["policy_exact"], t["policy_uri"]) == (1, False, "file:///ckpt/r1/v1")
    r = await _complete_as(client, tasks[0], 0)
    assert r.status_code == 409 and "policy version 1 or newer" in r.json()["detail"]
    ok(await _complete_as(client, tasks[0], 1))
    ok(await _complete_as(client, tasks[1], 2))
    ok(await _complete_as(client, tasks[2], 7))  # newer than any published: the worker's word
    results = ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}/results"))
    by_q = {g["question_id"]: g["policy_version"] for g in results["groups"]}
    assert [by_q[t["question_id"]] for t in tasks] == [1, 2, 7]
