"""Plan and commit of training steps: composition, delayed start, collection, retirement, replay."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from .factories import (
    B,
    K,
    Model,
    commit_batch,
    correct_first,
    create_pool,
    create_run,
    group,
    import_questions,
    logprobs_for,
    make_groups,
    ok,
    payload_of,
    plan_batch,
    pool_stats,
    question_detail,
    run_stats,
    setup_pool,
)


async def test_plan_on_policy_has_b_fresh_questions_and_no_replay(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    plan = await plan_batch(client)
    assert plan["status"] == "planned" and plan["phase"] == "on_policy" and plan["step"] == 1
    assert plan["run"] == "r1" and plan["pool"] == "p1" and plan["k"] == K
    assert len(plan["fresh"]) == B and plan["replay"] == []
    qids = [f["question_id"] for f in plan["fresh"]]
    assert len(set(qids)) == B
    assert all(f["num_samples"] == K and f["prompt"][0]["content"] for f in plan["fresh"])

    # planning again before the commit answers the same batch
    again = await plan_batch(client)
    assert again["id"] == plan["id"] and [f["question_id"] for f in again["fresh"]] == qids
    shown = ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}"))
    assert shown["id"] == plan["id"] and shown["status"] == "planned"
    # ... also when the requests arrive together
    same = await asyncio.gather(*(plan_batch(client) for _ in range(4)))
    assert {p["id"] for p in same} == {plan["id"]}
    await create_run(client, "p1", "r2")
    first = await asyncio.gather(*(plan_batch(client, run="r2") for _ in range(4)))
    assert len({p["id"] for p in first}) == 1 and first[0]["step"] == 1

    # a batch-level size applies to a new plan
    ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 0))))
    small = await plan_batch(client, batch_size=3)
    assert len(small["fresh"]) == 3 and small["step"] == 2


async def test_replan_abandons_the_open_batch(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    old = await plan_batch(client)
    new = await plan_batch(client, replan=True)
    assert new["id"] != old["id"] and new["step"] == old["step"] == 1
    assert ok(await client.get(f"/v1/pools/p1/batches/{old['id']}"))["status"] == "abandoned"
    # the open batch is now the new one
    assert (await plan_batch(client))["id"] == new["id"]

    before = await pool_stats(client)
    stale = await commit_batch(client, old, make_groups(old, correct_first(lambda q: 2)))
    assert stale.status_code == 409
    assert stale.headers["content-type"].startswith("application/problem+json")
    assert "abandoned" in stale.json()["detail"]
    assert await pool_stats(client) == before
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["step"] == 0

    result = ok(await commit_batch(client, new, make_groups(new, correct_first(lambda q: 0))))
    assert result["batch_id"] == new["id"] and result["step"] == 1
    assert ok(await client.get(f"/v1/pools/p1/batches/{new['id']}"))["status"] == "committed"


async def test_delayed_start_switches_strictly_above_threshold(client: httpx.AsyncClient) -> None:
    # K * B = 32 rows per step; 8 correct rows give exactly 0.25
    await setup_pool(client, start_threshold=0.25)

    step1 = await plan_batch(client)
    qs = [f["question_id"] for f in step1["fresh"]]
    # two all-correct groups (retired even before the switch) and nothing else: 8/32 = 0.25
    body = make_groups(step1, correct_first(lambda q: K if q in qs[:2] else 0))
    r1 = ok(await commit_batch(client, step1, body))
    assert r1["solved_fraction"] == 0.25
    assert r1["switched"] is False and r1["phase"] == "on_policy"
    assert r1["retired"] == 2 and r1["stored_trajectories"] == 0 and r1["collected_groups"] == 0
    run = ok(await client.get("/v1/pools/p1/runs/r1"))
    assert run["phase"] == "on_policy" and run["switched_at_step"] is None and run["step"] == 1
    for q in qs[:2]:
        assert (await question_detail(client, q))["runs"][0]["retired"] is True

    # 9/32 > 0.25 switches; groups of this (on-policy) step are still not collected
    step2 = await plan_batch(client)
    assert step2["phase"] == "on_policy" and step2["replay"] == []
    q2 = [f["question_id"] for f in step2["fresh"]]
    counts = dict.fromkeys(q2, 0) | {q2[0]: 3, q2[1]: 3, q2[2]: 3}
    r2 = ok(await commit_batch(client, step2, make_groups(step2, correct_first(lambda q: counts[q]))))
    assert r2["solved_fraction"] == 9 / 32 and r2["switched"] is True and r2["phase"] == "mixed"
    assert r2["stored_trajectories"] == 0 and r2["collected_groups"] == 0
    run = ok(await client.get("/v1/pools/p1/runs/r1"))
    assert run["phase"] == "mixed" and run["switched_at_step"] == 2
    assert (await pool_stats(client))["num_trajectories"] == 0

    # the first mixed step has nothing to replay yet, but it collects
    step3 = await plan_batch(client)
    assert step3["phase"] == "mixed" and step3["replay"] == [] and len(step3["fresh"]) == B
    r3 = ok(await commit_batch(client, step3, make_groups(step3, correct_first(lambda q: 1))))
    assert r3["collected_groups"] == B and r3["stored_trajectories"] == B and r3["switched"] is False
    # a low solved fraction never switches back
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["phase"] == "mixed"

    step4 = await plan_batch(client)
    assert len(step4["replay"]) == B // 2 and len(step4["fresh"]) == B // 2


async def test_collection_rules_of_one_step(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    qs = [f["question_id"] for f in plan["fresh"]]
    same = [999, 998, 997]
    groups = [
        group(qs[0], [0, 0, 0, 0]),  # k = 0: nothing
        group(qs[1], [0, 1, 0, 0]),  # k = 1
        group(qs[2], [1, 0, 1, 0]),  # k = 2
        group(qs[3], [1, 1, 1, 0]),  # k = 3
        group(qs[4], [1, 1, 1, 1]),  # k = K: retired, nothing stored
        # k = 2 with both correct rollouts carrying the same tokens: stored once
        group(qs[5], [1, 1, 0, 0], lambda q, row: same if row < 2 else [q, row]),
        group(qs[6], [0.0, 0, 1.0, 0.0]),  # 0 and 1 as floats or integers (others: test_contract)
        group(qs[7], [0, 0, 1, 0], b64=False),  # payloads as JSON lists
    ]
    body = {"groups": groups}
    result = ok(await commit_batch(client, plan, body))
    assert result["retired"] == 1
    assert result["collected_groups"] == 6 and result["ignored_groups"] == 1
    assert result["stored_trajectories"] == 1 + 2 + 3 + 1 + 1 + 1
    assert result["duplicate_trajectories"] == 1
    assert result["bucket_moves"] == 6

    model = Model()
    model.apply("r1", body, collect=True)
    stats = await run_stats(client)
    assert (
        {b["bucket"]: b["questions"] for b in stats["buckets"]}
        == model.scope("r1").histogram()
        == {1: 3, 2: 2, 3: 1}
    )
    assert stats["eligible"] == 6 and stats["retired"] == 1 and stats["seen"] == B
    assert stats["trajectories"] == 9 == len(model.trajectories)
    assert (await pool_stats(client))["num_trajectories"] == 9

    for g in groups:
        qid = g["question_id"]
        detail = await question_detail(client, qid, payload=True)
        stored = {payload_of(t) for t in detail["trajectories"]}
        correct = {payload_of(r) for r in g["rollouts"] if r["reward"] == 1.0}
        state = detail["runs"][0]
        k = sum(r["reward"] == 1.0 for r in g["rollouts"])
        assert state["num_correct"] == k and state["last_step"] == 1
        if k in (0, K):
            assert stored == set()
            assert state["bucket"] is None and state["retired"] is (k == K)
        else:
            # exactly the correct rollouts, with the log-probs that were sent
            assert stored == correct
            assert state["bucket"] == k and state["retired"] is False
    assert len((await question_detail(client, qs[5]))["trajectories"]) == 1


async def test_zero_correct_keeps_the_old_bucket(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed", questions=B)  # every step draws the same 8 questions
    plan = await plan_batch(client, experience_ratio=0)
    ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 3))))
    qid = plan["fresh"][0]["question_id"]
    assert (await question_detail(client, qid))["runs"][0]["bucket"] == 3

    plan2 = await plan_batch(client, experience_ratio=0)
    assert qid in {f["question_id"] for f in plan2["fresh"]}
    r = ok(
        await commit_batch(client, plan2, make_groups(plan2, correct_first(lambda q: 0 if q == qid else 1)))
    )
    assert r["ignored_groups"] == 1 and r["collected_groups"] == B - 1
    state = (await question_detail(client, qid))["runs"][0]
    assert state == {"run": "r1", "num_correct": 0, "bucket": 3, "retired": False, "last_step": 2}
    hist = {b["bucket"]: b["questions"] for b in (await run_stats(client))["buckets"]}
    assert hist == {1: B - 1, 3: 1}


async def test_only_mixed_phase_collects(client: httpx.AsyncClient) -> None:
    await setup_pool(client, start_threshold=1.0)  # never switches by itself
    plan = await plan_batch(client)
    r = ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
    assert r["phase"] == "on_policy" and r["collected_groups"] == 0 and r["ignored_groups"] == B
    assert r["stored_trajectories"] == 0
    stats = await run_stats(client)
    assert stats["buckets"] == [] and stats["eligible"] == 0 and stats["seen"] == B
    assert (await pool_stats(client))["num_trajectories"] == 0

    # a run with experience disabled never replays; it cannot be mixed (test_run_rules.py)
    await create_run(client, "p1", "plain", experience=False)
    p = await plan_batch(client, run="plain")
    assert p["phase"] == "on_policy" and p["replay"] == []


def _reward_fn(step: int, replayed: set[int]) -> Any:
    """A deterministic spread of outcomes: k = 0..K, one group in eight all correct."""

    def k_of(qid: int) -> int:
        return (0, 1, 2, 3, 0, 2, 1, K)[(qid * 5 + step * 3) % 8]

    def reward(qid: int, row: int) -> float:
        if qid in replayed and row == 0:
            return 1.0  # the replayed stored trajectory is correct again
        return 1.0 if row < k_of(qid) else 0.0

    return reward


async def test_training_loop_follows_the_rules(client: httpx.AsyncClient) -> None:
    """Many steps through the on-policy and mixed phases against a reference model: composition,
    retirement in both phases, k = 0 keeping the bucket, candidates and the bucket histogram."""
    await setup_pool(client, questions=24)
    model = Model()
    phase = "on_policy"
    kept_on_zero = 0
    for step in range(1, 11):
        plan = await plan_batch(client)
        sc = model.scope("r1")
        assert plan["phase"] == phase and plan["step"] == step
        assert plan["num_eligible"] == len(sc.eligible)
        want = 0 if phase == "on_policy" else min(len(sc.eligible), B // 2)
        assert len(plan["replay"]) == want
        assert len(plan["fresh"]) + len(plan["replay"]) == B
        for item in plan["replay"]:
            qid = item["question_id"]
            assert qid in sc.eligible and qid not in sc.retired
            assert item["bucket"] == sc.bucket[qid] and item["num_samples"] == K - 1
            assert 0 < item["probability"] <= 1
            stored = {ids for q, ids in model.trajectories if q == qid}
            assert {tuple(payload_of(c)[0]) for c in item["candidates"]} == stored
            for c in item["candidates"]:
                ids, lps = payload_of(c)
                assert list(lps) == logprobs_for(ids) and c["num_tokens"] == len(ids)
        replayed = {i["question_id"] for i in plan["replay"]}
        body = make_groups(plan, _reward_fn(step, replayed))
        before = {q: sc.bucket.get(q) for q in sc.bucket}
        result = ok(await commit_batch(client, plan, body))
        model.apply("r1", body, collect=phase == "mixed")
        kept_on_zero += sum(
            1
            for g in body["groups"]
            if before.get(g["question_id"]) and all(r["reward"] == 0 for r in g["rollouts"])
        )
        assert result["retired"] == sum(all(r["reward"] == 1 for r in g["rollouts"]) for g in body["groups"])
        phase = result["phase"]

        stats = await run_stats(client)
        assert {b["bucket"]: b["questions"] for b in stats["buckets"]} == sc.histogram()
        assert stats["retired"] == len(sc.retired) and stats["eligible"] == len(sc.eligible)
        assert (await pool_stats(client))["num_trajectories"] == len(model.trajectories)
        if sc.retired:
            sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 50, "seed": step}))
            picked = {i["question_id"] for i in sel["replay"]}
            assert picked == sc.eligible and not picked & sc.retired
            assert all(i["candidates"] for i in sel["replay"])

    assert phase == "mixed"
    sc = model.scope("r1")
    assert sc.retired and sc.eligible and kept_on_zero > 0
    # retired questions really are retired, and k = 0 questions kept their bucket
    for qid in sorted(sc.retired)[:3]:
        state = (await question_detail(client, qid))["runs"][0]
        assert state["retired"] is True and state["bucket"] is None
    for qid, bucket in sc.bucket.items():
        if sc.last_k[qid] == 0:
            state = (await question_detail(client, qid))["runs"][0]
            assert state["num_correct"] == 0 and state["bucket"] == bucket


async def test_replay_count_is_min_of_eligible_and_b_times_ratio(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed", questions=40)
    plan = await plan_batch(client)
    qs = [f["question_id"] for f in plan["fresh"]]
    # only two questions become eligible
    ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2 if q in qs[:2] else 0))))
    plan = await plan_batch(client)
    assert plan["num_eligible"] == 2 and len(plan["replay"]) == 2 and len(plan["fresh"]) == B - 2
    assert plan["skipped_fresh"] == 2
    assert {i["question_id"] for i in plan["replay"]} == set(qs[:2])
    ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 1))))
    # now 2 + 6 eligible: floor(8 * 0.5) = 4 replayed
    plan = await plan_batch(client)
    assert plan["num_eligible"] == 8 and len(plan["replay"]) == 4
    # a batch-level ratio: floor(8 * 0.3) = 2; and a run-level override: floor(8 * 0.75) = 6
    plan = await plan_batch(client, replan=True, experience_ratio=0.3)
    assert len(plan["replay"]) == 2 and len(plan["fresh"]) == 6
    ok(await client.patch("/v1/pools/p1/runs/r1", json={"overrides": {"experience_ratio": 0.75}}))
    plan = await plan_batch(client, replan=True)
    assert len(plan["replay"]) == 6 and len(plan["fresh"]) == 2
    plan = await plan_batch(client, replan=True, candidates="none")
    assert all(i["candidates"] == [] for i in plan["replay"]) or plan["replay"] == []


async def test_commit_is_idempotent(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    first = ok(await commit_batch(client, plan, body))
    pool_before, run_before = await pool_stats(client), ok(await client.get("/v1/pools/p1/runs/r1"))
    second = ok(await commit_batch(client, plan, body))
    assert second == first
    assert await pool_stats(client) == pool_before
    assert ok(await client.get("/v1/pools/p1/runs/r1")) == run_before
    assert run_before["step"] == 1
    assert first["stored_trajectories"] == 2 * B == pool_before["num_trajectories"]

    # the same commit sent several times at once (a client retrying on a timeout) applies once
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 1), lambda q, row: [q, row, 99])
    results = await asyncio.gather(*(commit_batch(client, plan, body) for _ in range(4)))
    assert all(r.status_code == 200 for r in results), "\n".join(r.text for r in results)
    assert len({r.text for r in results}) == 1
    assert (await pool_stats(client))["num_trajectories"] == 2 * B + results[0].json()["stored_trajectories"]
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["step"] == 2


async def test_idempotency_key_replays_the_response(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    first = await commit_batch(client, plan, body, **{"Idempotency-Key": "commit-1"})
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    before = await pool_stats(client)

    again = await commit_batch(client, plan, body, **{"Idempotency-Key": "commit-1"})
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()

    other = make_groups(plan, correct_first(lambda q: 1))
    clash = await commit_batch(client, plan, other, **{"Idempotency-Key": "commit-1"})
    assert clash.status_code == 422 and "Idempotency-Key" in clash.json()["detail"]
    assert await pool_stats(client) == before

    # creating writes are replayed with their original status code
    r1 = await client.post("/v1/pools", json={"name": "p9"}, headers={"Idempotency-Key": "mk-p9"})
    r2 = await client.post("/v1/pools", json={"name": "p9"}, headers={"Idempotency-Key": "mk-p9"})
    assert r1.status_code == r2.status_code == 201 and r2.headers["Idempotent-Replayed"] == "true"
    assert r1.json() == r2.json()
    assert ok(await client.get("/v1/pools"))["count"] == 2


async def test_commit_with_stats_answers_the_run_stats_it_leaves(client: httpx.AsyncClient) -> None:
    """`with_stats`: the commit answers what GET .../stats answers right after it (collection,
    retirement and replay all changing them), and a replayed commit answers its first answer."""
    await setup_pool(client, phase="mixed", questions=24)
    answers = []
    for step in range(1, 6):
        plan = await plan_batch(client)
        replayed = {i["question_id"] for i in plan["replay"]}
        body = {**make_groups(plan, _reward_fn(step, replayed)), "with_stats": True}
        result = ok(await commit_batch(client, plan, body))
        assert result["stats"] == await run_stats(client)
        assert result["stats"]["step"] == result["step"] == step
        assert result["stats"]["replayed_last_step"] == len(plan["replay"])
        answers.append((plan, body, result))
    final = answers[-1][2]["stats"]
    assert final["eligible"] > 0 and final["retired"] > 0 and final["trajectories"] > 0
    # the count read back from the stored plan (GET) and the one the commit took from its own plan
    assert any(r["stats"]["replayed_last_step"] > 0 for _, _, r in answers)
    assert len({json.dumps(r["stats"], sort_keys=True) for _, _, r in answers}) == len(answers)

    # a commit sent again, even after later commits, answers the stats as that commit left them
    for plan, body, result in answers:
        assert ok(await commit_batch(client, plan, body)) == result
    plan = await plan_batch(client)
    body = {**make_groups(plan, correct_first(lambda q: 1), lambda q, row: [q, row, 7]), "with_stats": True}
    results = await asyncio.gather(*(commit_batch(client, plan, body) for _ in range(4)))
    assert all(r.status_code == 200 for r in results), "\n".join(r.text for r in results)
    assert len({r.text for r in results}) == 1
    assert results[0].json()["stats"] == await run_stats(client)

    # without the flag the answer has no stats (and costs no stats queries)
    plan = await plan_batch(client)
    result = ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 1))))
    assert result["stats"] is None


async def test_groups_not_matching_the_plan_change_nothing(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    before = await pool_stats(client)
    cases = {
        "missing group": {"groups": body["groups"][1:]},
        "extra group": {"groups": [*body["groups"], body["groups"][0]]},
        "foreign question": {"groups": [{**body["groups"][0], "question_id": 10**6}, *body["groups"][1:]]},
        "fresh sent as replay": {
            "groups": [
                group(body["groups"][0]["question_id"], [1, 1, 0, 0], replay_trajectory_id=1),
                *body["groups"][1:],
            ]
        },
    }
    for name, bad in cases.items():
        r = await commit_batch(client, plan, bad)
        assert r.status_code == 422, name
        assert "do not match batch" in r.json()["detail"], name
    assert await pool_stats(client) == before
    assert ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}"))["status"] == "planned"
    ok(await commit_batch(client, plan, body))


async def test_replayed_group_is_collected_with_k_including_the_replayed_row(
    client: httpx.AsyncClient,
) -> None:
    await setup_pool(client, phase="mixed", questions=2 * B)  # one epoch: steps 1 and 2 draw apart
    plan = await plan_batch(client, experience_ratio=0)
    ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 1))))
    plan = await plan_batch(client)
    assert len(plan["replay"]) == B // 2
    replayed = {i["question_id"] for i in plan["replay"]}
    assert not replayed & {f["question_id"] for f in plan["fresh"]}
    # replayed row correct + one fresh correct: k = 2; the replayed row is not stored again
    body = make_groups(plan, correct_first(lambda q: 2 if q in replayed else 0))
    r = ok(await commit_batch(client, plan, body))
    assert r["collected_groups"] == B // 2 and r["stored_trajectories"] == B // 2
    for qid in replayed:
        d = await question_detail(client, qid)
        assert d["runs"][0]["bucket"] == 2 and len(d["trajectories"]) == 2


async def test_first_step_of_a_new_pool_needs_enough_questions(client: httpx.AsyncClient) -> None:
    await create_pool(client)
    await import_questions(client, "p1", B - 1)
    await create_run(client)
    r = await client.post("/v1/pools/p1/runs/r1/batches", json={})
    assert r.status_code == 409 and "fewer than the batch size" in r.json()["detail"]


async def test_plan_retried_with_its_idempotency_key_replays_the_same_plan(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    headers = {"Idempotency-Key": "plan-step-1"}
    first = await client.post("/v1/pools/p1/runs/r1/batches", json={}, headers=headers)
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    again = await client.post("/v1/pools/p1/runs/r1/batches", json={}, headers=headers)
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert [f["question_id"] for f in again.json()["fresh"]] == [
        f["question_id"] for f in first.json()["fresh"]
    ]
    other = await client.post("/v1/pools/p1/runs/r1/batches", json={"replan": True}, headers=headers)
    assert other.status_code == 422 and "different request" in other.json()["detail"]
