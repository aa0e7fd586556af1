"""The staleness limit on replay (`max_replay_age`): a stored trajectory collected more than that
many steps before the run's current step is no replay candidate, in a plan or a selection; a
question left without a candidate is not replayed (its slot goes to a fresh question). Nothing is
deleted, and without the limit every stored trajectory is a candidate, as before."""

from __future__ import annotations

from typing import Any

import httpx

from .factories import B, K, commit_batch, create_pool, create_run, group, import_questions, make_groups, ok
from .factories import plan_batch as plan

NOW = 5
"""The run's step when it replays (five committed steps)."""


def _other_tokens(qid: int, row: int) -> list[int]:
    return [qid, 100 + row, 13]


async def _setup(client: httpx.AsyncClient, pool: dict[str, Any], run: dict[str, Any]) -> dict[str, int]:
    """A mixed run at step NOW whose pool holds, by question: `old` one trajectory of step 1 (4 steps
    behind), `edge` one of step 2 (3 behind), `both` one of step 1 and two of step 4."""
    await create_pool(client, "p1", **pool)
    await import_questions(client, "p1", 24)
    await create_run(client, "p1", "r1", phase="mixed", **run)
    for _ in range(NOW):  # nothing solved: nothing collected, nothing retired
        p = await plan(client)
        ok(await commit_batch(client, p, make_groups(p, lambda q, row: 0.0)))
    qids = [q["id"] for q in ok(await client.get("/v1/pools/p1/questions", params={"limit": 3}))["data"]]
    names = dict(zip(("old", "edge", "both"), qids, strict=True))

    async def ingest(step: int, *groups: dict[str, Any]) -> None:
        ok(await client.post("/v1/pools/p1/runs/r1/ingest", json={"groups": list(groups), "step": step}))

    await ingest(1, group(names["old"], [1, 0, 0, 0]), group(names["both"], [1, 0, 0, 0]))
    await ingest(2, group(names["edge"], [1, 0, 0, 0]))
    await ingest(4, group(names["both"], [1, 1, 0, 0], _other_tokens))
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["step"] == NOW
    return names


def _candidates(replay: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Replayed question -> the steps of its candidates."""
    return {r["question_id"]: sorted(c["step"] for c in r["candidates"]) for r in replay}


async def _select(client: httpx.AsyncClient) -> dict[int, list[int]]:
    body = {"n": 10, "seed": 3, "candidates": "all"}
    return _candidates(ok(await client.post("/v1/pools/p1/runs/r1/select", json=body))["replay"])


async def _trajectory_steps(client: httpx.AsyncClient, qid: int) -> list[int]:
    detail = ok(await client.get(f"/v1/pools/p1/questions/{qid}"))
    return sorted(t["step"] for t in detail["trajectories"])


async def _check_limited(client: httpx.AsyncClient, q: dict[str, int]) -> None:
    expected = {q["edge"]: [2], q["both"]: [4, 4]}
    assert await _select(client) == expected
    step = await plan(client, candidates="all")
    assert step["phase"] == "mixed" and _candidates(step["replay"]) == expected
    # the old question's slot went to a fresh question: the batch is still B questions
    assert len(step["fresh"]) == B - 2
    # nothing was deleted: the old trajectories stay stored
    assert await _trajectory_steps(client, q["old"]) == [1]
    assert await _trajectory_steps(client, q["both"]) == [1, 4, 4]


async def test_a_trajectory_older_than_the_pool_limit_is_never_a_candidate(client: httpx.AsyncClient) -> None:
    q = await _setup(client, {"max_replay_age": 3}, {})
    await _check_limited(client, q)


async def test_the_run_override_sets_the_limit(client: httpx.AsyncClient) -> None:
    q = await _setup(client, {}, {"max_replay_age": 3})
    await _check_limited(client, q)


async def test_without_a_limit_every_stored_trajectory_is_a_candidate(client: httpx.AsyncClient) -> None:
    q = await _setup(client, {}, {})
    expected = {q["old"]: [1], q["edge"]: [2], q["both"]: [1, 4, 4]}
    assert await _select(client) == expected
    step = await plan(client, candidates="all")
    assert _candidates(step["replay"]) == expected and len(step["fresh"]) == B - 3


async def test_the_limit_holds_when_candidates_are_not_sent_whole(client: httpx.AsyncClient) -> None:
    """Ids only and lowest stored entropy read the candidates' steps for the limit (without it,
    ids only read no step at all)."""
    q = await _setup(client, {"max_replay_age": 3}, {})
    for mode, sent in (
        ("none", {q["edge"]: [], q["both"]: []}),
        ("lowest_stored_entropy", {q["edge"]: [2], q["both"]: [4]}),
    ):
        body = {"n": 10, "seed": 3, "candidates": mode}
        assert _candidates(ok(await client.post("/v1/pools/p1/runs/r1/select", json=body))["replay"]) == sent
        assert _candidates((await plan(client, candidates=mode, replan=True))["replay"]) == sent


async def test_the_limit_is_checked_where_it_is_set(client: httpx.AsyncClient) -> None:
    await create_pool(client, "p1")
    for bad in (0, -1, 1.5, "3"):
        r = await client.post("/v1/pools", json={"name": "bad", "config": {"k": K, "max_replay_age": bad}})
        assert r.status_code == 422, (bad, r.text)
        r = await client.post("/v1/pools/p1/runs", json={"name": "r", "overrides": {"max_replay_age": bad}})
        assert r.status_code == 422, (bad, r.text)
    pool = ok(await client.patch("/v1/pools/p1", json={"config": {"max_replay_age": 8}}))
    assert pool["config"]["max_replay_age"] == 8
