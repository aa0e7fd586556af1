"""Contract details of the API: PATCH merges a pool's config, replay groups are explained, rewards
are 0 or 1, a replayed question's probability is the question's, idempotency keys are scoped to
their pool and endpoint, and a pool-scoped token reads only its pools."""

from __future__ import annotations

import math
from typing import Any

import httpx

from exgrpo_pool.config import TokenGrant

from .factories import create_pool, group, make_groups, ok, plan_batch, setup_pool
from .harness import TOKENS, Backend, serve


async def _qids(client: httpx.AsyncClient, pool: str = "p1", n: int = 100) -> list[int]:
    return [q["id"] for q in ok(await client.get(f"/v1/pools/{pool}/questions", params={"limit": n}))["data"]]


async def test_patch_merges_the_pool_config(client: httpx.AsyncClient) -> None:
    await create_pool(client, "p1", k=4, batch_size=8, sharing="pooled", sigma=1.5)
    patched = ok(await client.patch("/v1/pools/p1", json={"config": {"sigma": 2.0}}))
    cfg = patched["config"]
    assert (cfg["k"], cfg["batch_size"], cfg["sharing"], cfg["sigma"]) == (4, 8, "pooled", 2.0)
    # a key set to null goes back to its default; unnamed keys stay
    ok(await client.patch("/v1/pools/p1", json={"config": {"mu": 1.5}}))
    cfg = ok(await client.patch("/v1/pools/p1", json={"config": {"mu": None, "batch_size": 16}}))["config"]
    assert (cfg["mu"], cfg["batch_size"], cfg["sigma"]) == (None, 16, 2.0)
    # k and sharing still cannot change; the merged config is validated as a whole
    changed = await client.patch("/v1/pools/p1", json={"config": {"k": 8}})
    assert changed.status_code == 409 and "cannot change" in changed.json()["detail"]
    bounds = await client.patch("/v1/pools/p1", json={"config": {"lbound": 3}})
    assert bounds.status_code == 422 and "lbound" in bounds.json()["detail"]
    unknown = await client.patch("/v1/pools/p1", json={"config": {"sigmaa": 1.0}})
    assert unknown.status_code == 422
    assert ok(await client.get("/v1/pools/p1"))["config"] == cfg


async def _mixed_plan_with_replay(client: httpx.AsyncClient) -> dict[str, Any]:
    await setup_pool(client, phase="mixed")
    qids = await _qids(client)
    ok(
        await client.post(
            "/v1/pools/p1/runs/r1/ingest", json={"groups": [group(q, [1, 0, 0, 0]) for q in qids[:6]]}
        )
    )
    plan = await plan_batch(client)
    assert plan["replay"]
    return plan


async def test_a_replay_group_without_its_replayed_row_is_explained(client: httpx.AsyncClient) -> None:
    plan = await _mixed_plan_with_replay(client)
    body = make_groups(plan, lambda q, row: 0.0)
    replayed = plan["replay"][0]["question_id"]
    for g in body["groups"]:
        if g["question_id"] == replayed and g.get("replay_trajectory_id") is not None:
            g["rollouts"][0] = {**g["rollouts"][1]}  # a generated row where the stored one belongs
            g.pop("replay_trajectory_id")
    r = await client.post(f"/v1/pools/p1/batches/{plan['id']}/commit", json=body)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert f"question {replayed} is replayed in this batch" in detail and "replayed=true" in detail
    assert "unexpected" not in detail

    # and the other way round: a fresh question's group marked as a replay
    body = make_groups(plan, lambda q, row: 0.0)
    fresh = plan["fresh"][0]["question_id"]
    first = next(g for g in body["groups"] if g["question_id"] == fresh)
    first["rollouts"][0] = {"reward": 0.0, "replayed": True}
    r = await client.post(f"/v1/pools/p1/batches/{plan['id']}/commit", json=body)
    assert r.status_code == 422 and f"question {fresh} is fresh in this batch" in r.json()["detail"]


async def test_rewards_are_0_or_1(client: httpx.AsyncClient) -> None:
    plan = await _mixed_plan_with_replay(client)
    body = make_groups(plan, lambda q, row: 0.0)
    body["groups"][0]["rollouts"][1]["reward"] = 0.5
    r = await client.post(f"/v1/pools/p1/batches/{plan['id']}/commit", json=body)
    assert r.status_code == 422 and "reward" in r.json()["detail"] and "0 or 1" in r.json()["detail"]
    q = plan["fresh"][0]["question_id"]
    for reward in (-1.0, 2.0, 0.999):
        bad = group(q, [1, 0, 0, 0])
        bad["rollouts"][1]["reward"] = reward
        r = await client.post("/v1/pools/p1/runs/r1/ingest", json={"groups": [bad]})
        assert r.status_code == 422, reward
    # 0 and 1 as JSON integers are fine
    good = group(q, [1, 0, 0, 0])
    good["rollouts"][0]["reward"] = 1
    ok(await client.post("/v1/pools/p1/runs/r1/ingest", json={"groups": [good]}))


async def test_a_replayed_questions_probability_is_the_questions(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")  # K = 4, normal weighting, mu = K/2, sigma = 1
    qids = await _qids(client)
    # bucket 1: three questions, bucket 2: one question
    groups = [group(q, [1, 0, 0, 0]) for q in qids[:3]] + [group(qids[3], [1, 1, 0, 0])]
    ok(await client.post("/v1/pools/p1/runs/r1/ingest", json={"groups": groups}))
    sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 10, "seed": 1}))
    w = {k: math.exp(-((k - 2) ** 2) / 2) for k in (1, 2)}
    bucket_p = {k: w[k] / sum(w.values()) for k in w}
    size = {1: 3, 2: 1}
    probs = {i["question_id"]: i["probability"] for i in sel["replay"]}
    for item in sel["replay"]:
        b = item["bucket"]
        assert math.isclose(item["probability"], bucket_p[b] / size[b]), item
    assert math.isclose(sum(probs.values()), 1.0)
    plan = await plan_batch(client)
    for item in plan["replay"]:
        assert math.isclose(item["probability"], bucket_p[item["bucket"]] / size[item["bucket"]])


async def test_idempotency_keys_are_scoped_to_pool_and_endpoint(client: httpx.AsyncClient) -> None:
    await create_pool(client, "p1")
    await create_pool(client, "p2")
    key = {"Idempotency-Key": "one-key"}
    first = ok(await client.post("/v1/pools/p1/questions", json={"questions": [_q(1)]}, headers=key))
    # the same key on another pool's endpoint is another request, not a replay or a clash
    second = ok(await client.post("/v1/pools/p2/questions", json={"questions": [_q(1), _q(2)]}, headers=key))
    assert (first["inserted"], second["inserted"]) == (1, 2)
    run = await client.post("/v1/pools/p1/runs", json={"name": "r1"}, headers=key)
    assert run.status_code == 201
    # on the same endpoint it still replays, or refuses another body
    again = await client.post("/v1/pools/p1/questions", json={"questions": [_q(1)]}, headers=key)
    assert again.json() == first and again.headers.get("Idempotent-Replayed") == "true"
    clash = await client.post("/v1/pools/p1/questions", json={"questions": [_q(3)]}, headers=key)
    assert clash.status_code == 422


def _q(i: int) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"q{i}"}], "ground_truth": str(i)}


async def test_pool_scoped_tokens_read_only_their_pools(backend: Backend, client: httpx.AsyncClient) -> None:
    for name in ("p1", "p2"):
        await setup_pool(client, name, phase="mixed")
    q2 = (await _qids(client, "p2", 1))[0]
    tokens = [
        *TOKENS,
        TokenGrant(token="test-writer-of-p1-only-00", name="p1-writer", scopes=["write:p1"]),
        TokenGrant(token="test-reader-of-p1-only-00", name="p1-reader", scopes=["read:p1"]),
    ]
    settings = backend.settings(tokens=tokens)
    async with (
        serve(settings, "test-writer-of-p1-only-00") as w,
        serve(settings, "test-reader-of-p1-only-00") as rd,
    ):
        for c in (w, rd):
            assert [p["name"] for p in ok(await c.get("/v1/pools"))["data"]] == ["p1"]
            ok(await c.get("/v1/pools/p1"))
            ok(await c.get("/v1/pools/p1/runs/r1/stats"))
            for path in (
                "/v1/pools/p2",
                "/v1/pools/p2/stats",
                "/v1/pools/p2/export",
                "/v1/pools/p2/questions",
                f"/v1/pools/p2/questions/{q2}",
                "/v1/pools/p2/runs",
                "/v1/pools/p2/runs/r1/stats",
                "/v1/pools/p2/runs/r1/metrics",
            ):
                r = await c.get(path)
                assert r.status_code == 403, (path, r.status_code)
                assert "read:p2" in r.json()["detail"]
            sel = await c.post("/v1/pools/p2/runs/r1/select", json={"n": 1})
            assert sel.status_code == 403
        # the writer of p1 writes p1; the reader of p1 does not
        ok(await w.post("/v1/pools/p1/runs", json={"name": "r2"}), 201)
        assert (await rd.post("/v1/pools/p1/runs", json={"name": "r3"})).status_code == 403
    # the global read scope still reads everything
    async with serve(settings, TOKENS[1].token) as reader:
        assert len(ok(await reader.get("/v1/pools"))["data"]) == 2
        assert (await reader.get("/v1/pools/p2/export")).status_code == 200


async def test_unknown_scopes_are_refused_at_start() -> None:
    for scope in ("read:", "reads:p1", "write:"):
        try:
            TokenGrant(token="x" * 20, scopes=[scope])
        except ValueError:
            continue
        raise AssertionError(f"scope {scope!r} was accepted")
    assert TokenGrant(token="x" * 20, scopes=["read:p1", "read:*"]).scopes == ["read:p1", "read:*"]
