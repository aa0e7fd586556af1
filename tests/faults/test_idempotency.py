"""Idempotency-Key under faults: a retry after a crash between a write's commit and its answer
gets the first answer; the same key sent many times at once is applied once and answered alike;
a batch committed once refuses other groups."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from service.factories import (
    K,
    commit_batch,
    correct_first,
    group,
    make_groups,
    ok,
    plan_batch,
    pool_stats,
    question_body,
    run_stats,
    setup_pool,
)
from service.harness import ADMIN_TOKEN, Backend, bearer, db_execute, db_rows, serve

from exgrpo_client import schemas as s
from exgrpo_pool.service import convert

from .procs import FAULT_HEADER, FAULT_TRIALS, ServiceProcess, service_env

pytestmark = pytest.mark.faults

KILL = {FAULT_HEADER: "kill-after-commit"}


def _keyed(key: str, **extra: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **extra}


def _crash_then_retry(
    svc: ServiceProcess, http: httpx.Client, method: str, path: str, body: dict[str, Any], key: str
) -> httpx.Response:
    """Send a keyed write that kills the service right after its transaction commits; restart
    the service and send the same request again."""
    with pytest.raises(httpx.TransportError):
        http.request(method, path, json=body, headers=_keyed(key, **KILL))
    assert svc.wait_dead() == -9, "the fault hook kills the process after the commit"
    svc.start()
    return http.request(method, path, json=body, headers=_keyed(key))


#: The writes crashed on each backend; the others are sent once, plainly. The default run splits
#: the six between the backends (a crash costs a restart); the long version crashes all on both.
CRASHED = {
    "sqlite-memory": {"c-pool", "c-run", "c-ingest"},
    "postgres-redis": {"c-questions", "c-plan", "c-commit"},
}


def test_retry_after_a_crash_between_commit_and_answer_gets_the_first_answer(
    backend: Backend, tmp_path: Path
) -> None:
    svc = ServiceProcess(service_env(backend), tmp_path / "service.log", fault_hooks=True)
    crashed = set().union(*CRASHED.values()) if FAULT_TRIALS else CRASHED[backend.name]
    with svc, httpx.Client(base_url=svc.url, headers=bearer(ADMIN_TOKEN), timeout=30) as http:

        def crash(method: str, path: str, body: dict[str, Any], key: str, status: int) -> dict[str, Any]:
            if key not in crashed:
                return dict(ok(http.request(method, path, json=body, headers=_keyed(key)), status))
            r = _crash_then_retry(svc, http, method, path, body, key)
            assert r.status_code == status, f"{method} {path}: {r.status_code} {r.text}\n{svc.tail()}"
            # and the answer stays the same from then on
            again = http.request(method, path, json=body, headers=_keyed(key))
            assert again.status_code == status and again.headers["idempotent-replayed"] == "true"
            assert again.json() == r.json()
            return dict(r.json())

        pool = crash("POST", "/v1/pools", {"name": "p1", "config": {"k": K, "batch_size": 8}}, "c-pool", 201)
        assert pool["name"] == "p1" and pool["config"]["k"] == K

        questions = {"questions": [question_body(i) for i in range(24)]}
        imported = crash("POST", "/v1/pools/p1/questions", questions, "c-questions", 200)
        assert (imported["inserted"], imported["duplicates"], imported["num_questions"]) == (24, 0, 24)

        run = crash("POST", "/v1/pools/p1/runs", {"name": "r1", "phase": "mixed"}, "c-run", 201)
        assert run["name"] == "r1" and run["step"] == 0

        qids = [q["id"] for q in ok(http.get("/v1/pools/p1/questions", params={"limit": 24}))["data"]]
        groups = {"groups": [group(q, [1, 1, 0, 0], lambda q, row: [q, row, 31]) for q in qids[:3]]}
        ingested = crash("POST", "/v1/pools/p1/runs/r1/ingest", groups, "c-ingest", 200)
        assert (ingested["stored_trajectories"], ingested["duplicate_trajectories"]) == (6, 0)

        plan = crash("POST", "/v1/pools/p1/runs/r1/batches", {}, "c-plan", 201)
        assert plan["step"] == 1 and ok(http.get(f"/v1/pools/p1/batches/{plan['id']}/status"))["status"] == (
            "planned"
        )

        body = make_groups(plan, correct_first(lambda q: 2), lambda q, row: [q, row, 32])
        committed = crash("POST", f"/v1/pools/p1/batches/{plan['id']}/commit", body, "c-commit", 200)
        stats = ok(http.get("/v1/pools/p1/stats"))
        # the answer counts what the commit stored (a retry that did it again would say 0)
        assert committed["step"] == 1 and committed["stored_trajectories"] >= len(plan["fresh"]) > 0
        stored = committed["stored_trajectories"]
        assert (stats["num_questions"], stats["num_trajectories"]) == (24, 6 + stored)
        assert ok(http.get("/v1/pools/p1/runs/r1"))["step"] == 1
        assert svc.starts == 1 + len(crashed)


async def test_the_same_key_sent_at_once_is_applied_once(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=24, phase="mixed")
    n = 40

    async def at_once(method: str, path: str, body: dict[str, Any], key: str) -> list[httpx.Response]:
        calls = [client.request(method, path, json=body, headers=_keyed(key)) for _ in range(n)]
        answers = await asyncio.gather(*calls)
        bad = [f"{r.status_code} {r.text}" for r in answers if r.status_code >= 300]
        assert not bad, bad[:3]
        assert len({r.text for r in answers}) == 1, {r.text for r in answers}
        assert sum("idempotent-replayed" not in r.headers for r in answers) == 1
        return answers

    body = {"questions": [question_body(i) for i in range(100, 130)]}
    imported = (await at_once("POST", "/v1/pools/p1/questions", body, "same-import"))[0].json()
    assert imported["inserted"] == 30 and (await pool_stats(client))["num_questions"] == 54

    run = (await at_once("POST", "/v1/pools/p1/runs", {"name": "r2"}, "same-run"))[0]
    assert run.status_code == 201

    qids = [q["id"] for q in ok(await client.get("/v1/pools/p1/questions", params={"limit": 4}))["data"]]
    groups = {"groups": [group(q, [1, 0, 0, 0], lambda q, row: [q, row, 41]) for q in qids]}
    ingested = (await at_once("POST", "/v1/pools/p1/runs/r1/ingest", groups, "same-ingest"))[0].json()
    assert ingested["stored_trajectories"] == 4

    plans = await at_once("POST", "/v1/pools/p1/runs/r1/batches", {}, "same-plan")
    plan = plans[0].json()
    body = make_groups(plan, correct_first(lambda q: 2), lambda q, row: [q, row, 42])
    commit = (await at_once("POST", f"/v1/pools/p1/batches/{plan['id']}/commit", body, "same-commit"))[0]
    assert commit.json()["step"] == 1
    assert (await run_stats(client))["step"] == 1
    stats = await pool_stats(client)
    assert stats["num_trajectories"] == 4 + commit.json()["stored_trajectories"]


async def test_a_committed_batch_refuses_other_groups(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    first = await commit_batch(client, plan, body, **_keyed("commit-a"))
    assert first.status_code == 200
    before = (await pool_stats(client), await run_stats(client))

    other = make_groups(plan, correct_first(lambda q: 1), lambda q, row: [q, row, 51])
    for headers in ({}, _keyed("commit-b")):
        clash = await commit_batch(client, plan, other, **headers)
        assert clash.status_code == 409, clash.text
        assert clash.headers["content-type"] == "application/problem+json"
        assert plan["id"] in clash.json()["detail"] and "already committed" in clash.json()["detail"]
    # the same groups again: the first answer, as a replay only with the first key
    same = await commit_batch(client, plan, body)
    assert same.status_code == 200 and same.json() == first.json()
    assert "idempotent-replayed" not in same.headers
    replay = await commit_batch(client, plan, body, **_keyed("commit-a"))
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == first.json()
    assert (await pool_stats(client), await run_stats(client)) == before


async def test_an_idempotent_write_that_fails_records_nothing(backend: Backend) -> None:
    async with serve(backend.settings()) as client:
        await setup_pool(client)
        r = await client.post("/v1/pools/p1/runs", json={"name": "r1"}, headers=_keyed("dup-run"))
        assert r.status_code == 409  # the run exists: refused, and the key is not used up
        r = await client.post("/v1/pools/p1/runs", json={"name": "r1"}, headers=_keyed("dup-run"))
        assert r.status_code == 409 and "idempotent-replayed" not in r.headers


async def test_a_recorded_key_holds_the_hash_of_its_request(backend: Backend) -> None:
    """The request's hash is computed beside the write and written with its answer: what is
    committed is the hash of the route and the body as sent, whatever the write did meanwhile; for
    a commit, of the route and its content digest (its batch digest, made from the payload as
    decoded, and the rest of its body), so that its payload is hashed once."""
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed")
        plan_path = "/v1/pools/p1/runs/r1/batches"
        plan_raw = b"{}"
        r = await client.post(
            plan_path, content=plan_raw, headers={**_keyed("hashed-plan"), "content-type": "application/json"}
        )
        plan = r.json()
        body = make_groups(plan, correct_first(lambda q: 2))
        raw = json.dumps(body).encode()
        path = f"/v1/pools/p1/batches/{plan['id']}/commit"
        headers = {**_keyed("hashed-commit"), "content-type": "application/json"}
        assert (await client.post(path, content=raw, headers=headers)).status_code == 200
        stored = await db_rows(backend.database_url, "SELECT route, request_hash FROM idempotency_key")
        assert (
            f"POST {plan_path}",
            hashlib.sha256(f"POST {plan_path}\n".encode() + plan_raw).hexdigest(),
        ) in stored
        model = s.BatchCommit.model_validate(body, strict=False)
        convert.predecode(model.groups)
        content = (
            f"{convert.commit_digest(model)} {model.model_dump_json(exclude={'groups', 'policy_version'})}"
        )
        expected = hashlib.sha256(f"POST {path}\ncontent:{content}".encode()).hexdigest()
        assert (f"POST {path}", expected) in stored
        # and a replay with another body under the key is still told apart
        other = make_groups(plan, correct_first(lambda q: 1))
        clash = await client.post(path, json=other, headers=_keyed("hashed-commit"))
        assert clash.status_code == 422 and "different request" in clash.json()["detail"]


async def test_a_commit_recorded_with_the_first_digest_replays_after_an_upgrade(backend: Backend) -> None:
    """A service that made commit digests with `commit_digest_v1` left keys whose records hash that
    content digest, and batches that keep `COMMIT_DIGEST_V1`. After the upgrade a retry of such a
    commit under its key is still replayed (another commit under it still refused), and the commit
    sent again without a key is still told apart from another one."""
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed")
        plan = (await client.post("/v1/pools/p1/runs/r1/batches", json={})).json()
        body = make_groups(plan, correct_first(lambda q: 2))
        path = f"/v1/pools/p1/batches/{plan['id']}/commit"
        first = await client.post(path, json=body, headers=_keyed("upgraded"))
        assert first.status_code == 200
        # the key's record and the batch as the earlier version wrote them
        model = s.BatchCommit.model_validate(body, strict=False)
        convert.predecode(model.groups)
        content = await convert.commit_request_v1(model)
        recorded = hashlib.sha256(f"POST {path}\ncontent:{content}".encode()).hexdigest()
        (result,) = await db_rows(backend.database_url, f"SELECT result FROM batch WHERE id = '{plan['id']}'")
        stored = json.loads(result[0]) if isinstance(result[0], str) else dict(result[0])
        assert stored.pop(convert.COMMIT_DIGEST) == convert.commit_digest(model)
        stored[convert.COMMIT_DIGEST_V1] = convert.commit_digest_v1(model)
        await db_execute(
            backend.database_url,
            f"UPDATE idempotency_key SET request_hash = '{recorded}' WHERE route = 'POST {path}'",
            f"UPDATE batch SET result = '{json.dumps(stored)}' WHERE id = '{plan['id']}'",
        )
        again = await client.post(path, json=body, headers=_keyed("upgraded"))
        assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"
        assert again.json() == first.json()
        other = make_groups(plan, correct_first(lambda q: 1))
        clash = await client.post(path, json=other, headers=_keyed("upgraded"))
        assert clash.status_code == 422 and "different request" in clash.json()["detail"]
        assert (await client.post(path, json=body)).json() == first.json()
        assert (await client.post(path, json=other)).status_code == 409
