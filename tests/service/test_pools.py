"""Pools, questions, runs, policy versions and the operational endpoints."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx

from .factories import (
    B,
    K,
    commit_batch,
    correct_first,
    create_pool,
    create_run,
    import_questions,
    make_groups,
    ok,
    plan_batch,
    question_body,
    question_detail,
    setup_pool,
)


async def test_pool_crud(client: httpx.AsyncClient) -> None:
    created = await create_pool(client, "p1", description="math")
    assert created["name"] == "p1"
    assert created["config"]["k"] == K and created["config"]["batch_size"] == B
    assert created["config"]["experience_ratio"] == 0.5 and created["config"]["sharing"] == "per_run"
    assert (created["num_questions"], created["num_trajectories"], created["num_runs"]) == (0, 0, 0)
    await create_pool(client, "p2", k=8, batch_size=4)

    again = await client.post("/v1/pools", json={"name": "p1"})
    assert again.status_code == 409
    assert again.headers["content-type"].startswith("application/problem+json")
    assert "already exists" in again.json()["detail"]

    listed = ok(await client.get("/v1/pools"))
    assert listed["count"] == 2
    assert [p["name"] for p in listed["data"]] == ["p1", "p2"]

    shown = ok(await client.get("/v1/pools/p2"))
    assert shown["config"]["k"] == 8 and shown["config"]["batch_size"] == 4

    patched = ok(
        await client.patch(
            "/v1/pools/p1", json={"description": "harder math", "config": {"k": K, "batch_size": 16}}
        )
    )
    assert patched["description"] == "harder math" and patched["config"]["batch_size"] == 16
    assert ok(await client.get("/v1/pools/p1"))["config"]["batch_size"] == 16

    k_change = await client.patch("/v1/pools/p1", json={"config": {"k": 8}})
    assert k_change.status_code == 409 and "cannot change" in k_change.json()["detail"]
    assert ok(await client.get("/v1/pools/p1"))["config"]["k"] == K

    missing = await client.get("/v1/pools/nope")
    assert missing.status_code == 404
    body = missing.json()
    assert body["status"] == 404 and "nope" in body["detail"] and body["instance"] == "/v1/pools/nope"


async def test_question_import_counts_duplicates(client: httpx.AsyncClient) -> None:
    await create_pool(client)
    first = await import_questions(client, "p1", 10)
    assert first == {"received": 10, "inserted": 10, "duplicates": 0, "num_questions": 10}

    # 5 already stored, 2 repeated inside the request, 3 new
    body = {"questions": [question_body(i) for i in [5, 6, 7, 8, 9, 10, 11, 12, 10, 11]]}
    second = ok(await client.post("/v1/pools/p1/questions", json=body))
    assert second == {"received": 10, "inserted": 3, "duplicates": 7, "num_questions": 13}
    assert ok(await client.get("/v1/pools/p1"))["num_questions"] == 13

    # same content in another pool is not a duplicate there
    await create_pool(client, "p2")
    assert (await import_questions(client, "p2", 3))["inserted"] == 3


async def test_question_list_pagination(client: httpx.AsyncClient) -> None:
    await create_pool(client)
    await import_questions(client, "p1", 25)
    seen: list[int] = []
    pages = 0
    after = 0
    while True:
        page = ok(await client.get("/v1/pools/p1/questions", params={"after": after, "limit": 10}))
        pages += 1
        assert page["count"] == len(page["data"]) <= 10
        seen += [q["id"] for q in page["data"]]
        if page["next_after"] is None:
            break
        assert page["next_after"] == page["data"][-1]["id"]
        after = page["next_after"]
    assert pages == 3
    assert len(seen) == 25 and seen == sorted(set(seen))
    first = ok(await client.get("/v1/pools/p1/questions", params={"limit": 1}))["data"][0]
    assert first["ground_truth"] == "0" and first["external_id"] == "q-0" and first["pool"] == "p1"
    assert first["prompt"][0]["role"] == "user"

    bad = await client.get("/v1/pools/p1/questions", params={"limit": 0})
    assert bad.status_code == 422 and "limit" in bad.json()["detail"]


async def test_a_question_page_past_the_end_or_of_an_empty_pool_is_empty_and_an_unknown_pool_404(
    client: httpx.AsyncClient,
) -> None:
    await create_pool(client)
    await import_questions(client, "p1", 5)
    await create_pool(client, "empty")
    await create_pool(client, "p3")
    await import_questions(client, "p3", 4)
    ids = [q["id"] for q in ok(await client.get("/v1/pools/p1/questions"))["data"]]
    assert len(ids) == 5
    # only the pool's own questions, in id order, whatever the other pools hold
    other = [q["id"] for q in ok(await client.get("/v1/pools/p3/questions"))["data"]]
    assert len(other) == 4 and not set(other) & set(ids)
    for path, params in (
        ("/v1/pools/p1/questions", {"after": ids[-1]}),
        ("/v1/pools/p1/questions", {"after": max(other) + 1000}),
        ("/v1/pools/empty/questions", {}),
    ):
        page = ok(await client.get(path, params=params))
        assert page == {"data": [], "count": 0, "next_after": None}, (path, params)
    for path in ("/v1/pools/nope/questions", "/v1/pools/nope/questions?after=5"):
        r = await client.get(path)
        assert r.status_code == 404 and "nope" in r.json()["detail"], path


async def test_question_detail_shows_trajectories_and_run_state(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda q: 2))
    ok(await commit_batch(client, plan, body))
    qid = plan["fresh"][0]["question_id"]

    detail = await question_detail(client, qid)
    assert detail["id"] == qid and detail["pool"] == "p1"
    assert len(detail["trajectories"]) == 2
    assert all(
        t["source_run"] == "r1" and t["step"] == 1 and t["reward"] == 1.0 for t in detail["trajectories"]
    )
    assert all(t["token_ids_b64"] is None for t in detail["trajectories"])
    assert detail["runs"] == [{"run": "r1", "num_correct": 2, "bucket": 2, "retired": False, "last_step": 1}]

    with_payload = await question_detail(client, qid, payload=True)
    assert all(t["token_ids_b64"] and t["logprobs_b64"] for t in with_payload["trajectories"])

    missing = await client.get("/v1/pools/p1/questions/999999")
    assert missing.status_code == 404 and "999999" in missing.json()["detail"]
    # a question of another pool is not found through this one
    await create_pool(client, "p2")
    assert (await client.get(f"/v1/pools/p2/questions/{qid}")).status_code == 404


async def test_run_creation(client: httpx.AsyncClient) -> None:
    await create_pool(client)
    run = await create_run(client, "p1", "r1", seed=7, experience_ratio=0.25)
    assert run["name"] == "r1" and run["pool"] == "p1" and run["seed"] == 7
    assert run["phase"] == "on_policy" and run["step"] == 0 and run["switched_at_step"] is None
    assert run["overrides"]["experience_ratio"] == 0.25 and run["overrides"]["experience"] is True

    mixed = await create_run(client, "p1", "r2", phase="mixed")
    assert mixed["phase"] == "mixed" and mixed["switched_at_step"] == 0

    dup = await client.post("/v1/pools/p1/runs", json={"name": "r1"})
    assert dup.status_code == 409 and "already exists" in dup.json()["detail"]

    runs = ok(await client.get("/v1/pools/p1/runs"))
    assert [r["name"] for r in runs["data"]] == ["r1", "r2"] and runs["count"] == 2
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["seed"] == 7
    assert ok(await client.get("/v1/pools/p1"))["num_runs"] == 2

    unknown = await client.get("/v1/pools/p1/runs/nope")
    assert unknown.status_code == 404 and "nope" in unknown.json()["detail"]

    patched = ok(await client.patch("/v1/pools/p1/runs/r1", json={"phase": "mixed"}))
    assert patched["phase"] == "mixed" and patched["switched_at_step"] == 0


async def test_policy_versions(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    url = "/v1/pools/p1/runs/r1/policy-versions"
    v1 = ok(await client.post(url, json={"version": 1, "uri": "s3://ckpt/1", "step": 10}), 201)
    assert (v1["version"], v1["uri"], v1["step"]) == (1, "s3://ckpt/1", 10)
    ok(await client.post(url, json={"version": 3, "uri": "s3://ckpt/3", "step": 30}), 201)
    # the same version again is idempotent; another URI for it is a conflict
    ok(await client.post(url, json={"version": 1, "uri": "s3://ckpt/1", "step": 10}), 201)
    clash = await client.post(url, json={"version": 1, "uri": "s3://elsewhere"})
    assert clash.status_code == 409 and "s3://ckpt/1" in clash.json()["detail"]

    listed = ok(await client.get(url))
    assert listed["count"] == 2
    assert [(p["version"], p["uri"]) for p in listed["data"]] == [(1, "s3://ckpt/1"), (3, "s3://ckpt/3")]
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["policy_version"] == 3
    # new batches are planned against the latest policy version
    assert (await plan_batch(client))["policy_version"] == 3


async def test_health_ready_metrics_openapi(client: httpx.AsyncClient) -> None:
    assert ok(await client.get("/healthz")) == {"status": "ok"}
    ready = ok(await client.get("/readyz"))
    assert ready == {"status": "ok", "checks": {"database": "ok", "index": "ok"}}

    await setup_pool(client, phase="mixed")
    plan = await plan_batch(client)
    result = ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 1))))
    assert result["stored_trajectories"] == B

    metrics = await client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert "exgrpo_http_request_seconds_bucket" in text
    assert 'route="/v1/pools/{pool}/batches/{batch_id}/commit"' in text
    assert f'exgrpo_trajectories_ingested_total{{pool="p1"}} {float(B)}' in text
    assert 'exgrpo_batches_committed_total{pool="p1"} 1.0' in text

    spec = ok(await client.get("/openapi.json"))
    paths = set(spec["paths"])
    for path in [
        "/v1/pools",
        "/v1/pools/import",
        "/v1/pools/{pool}",
        "/v1/pools/{pool}/questions",
        "/v1/pools/{pool}/questions/{question_id}",
        "/v1/pools/{pool}/export",
        "/v1/pools/{pool}/runs",
        "/v1/pools/{pool}/runs/{run}/batches",
        "/v1/pools/{pool}/runs/{run}/ingest",
        "/v1/pools/{pool}/runs/{run}/select",
        "/v1/pools/{pool}/runs/{run}/tasks/claim",
        "/v1/pools/{pool}/batches/{batch_id}/commit",
        "/v1/pools/{pool}/batches/{batch_id}/results",
        "/v1/pools/{pool}/tasks/{task_id}/complete",
        "/v1/admin/index/rebuild",
    ]:
        assert path in paths, path
    assert all(p.startswith("/v1/") for p in paths - {"/healthz", "/readyz", "/metrics"})


async def test_request_id_is_echoed(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/pools/nope", headers={"X-Request-ID": "abc123"})
    assert r.headers["X-Request-ID"] == "abc123"
    assert r.json()["request_id"] == "abc123"


async def test_run_metrics_merge_commit_and_posted_numbers(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    plan = await plan_batch(client)
    body = make_groups(plan, correct_first(lambda qid: 1))
    body["metrics"] = {"loss/total": 0.25}
    ok(await commit_batch(client, plan, body))
    posted = ok(
        await client.post("/v1/pools/p1/runs/r1/metrics", json={"step": 1, "metrics": {"eval/acc": 0.4}})
    )
    assert posted["metrics"]["eval/acc"] == 0.4 and posted["metrics"]["loss/total"] == 0.25
    assert posted["metrics"]["batch/solved"] == 1 / K
    ok(await client.post("/v1/pools/p1/runs/r1/metrics", json={"step": 3, "metrics": {"eval/acc": 0.5}}))
    curves = ok(await client.get("/v1/pools/p1/runs/r1/metrics"))
    assert [d["step"] for d in curves["data"]] == [1, 3]
    later = ok(await client.get("/v1/pools/p1/runs/r1/metrics", params={"after_step": 1}))
    assert [d["step"] for d in later["data"]] == [3]
    bad = await client.post("/v1/pools/p1/runs/r1/metrics", json={"step": 2, "metrics": {"x": "NaN"}})
    assert bad.status_code == 422
    assert [d["step"] for d in ok(await client.get("/v1/pools/p1/runs/r1/metrics"))["data"]] == [1, 3]


class _AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.fields: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.fields.append(dict(getattr(record, "fields", {})))


async def test_access_line_and_histogram_of_every_answer(client: httpx.AsyncClient) -> None:
    """One access line per request with its route template ("unmatched" when no route matched),
    its status and the request id it was answered with, and one histogram sample per request."""
    await create_pool(client, "p1")
    lines = _AccessLines()
    access = logging.getLogger("exgrpo.access")
    level = access.level  # the test service logs at WARNING
    access.addHandler(lines)
    access.setLevel(logging.INFO)
    try:
        found = await client.get("/v1/pools/p1", headers={"X-Request-ID": "given-1"})
        missing = await client.get("/v1/pools/p1/no/such/thing")
    finally:
        access.setLevel(level)
        access.removeHandler(lines)
    assert found.status_code == 200 and found.headers["X-Request-ID"] == "given-1"
    assert missing.status_code == 404
    generated = missing.headers["X-Request-ID"]
    assert len(generated) == 16 and int(generated, 16) >= 0 and missing.json()["request_id"] == generated
    assert [{k: v for k, v in f.items() if k != "ms"} for f in lines.fields] == [
        {
            "method": "GET",
            "route": "/v1/pools/{pool}",
            "path": "/v1/pools/p1",
            "status": 200,
            "request_id": "given-1",
        },
        {
            "method": "GET",
            "route": "unmatched",
            "path": "/v1/pools/p1/no/such/thing",
            "status": 404,
            "request_id": generated,
        },
    ]
    assert all(isinstance(f["ms"], float) and f["ms"] >= 0 for f in lines.fields)
    text = (await client.get("/metrics")).text
    assert 'exgrpo_http_request_seconds_count{method="GET",route="unmatched",status="404"} 1.0' in text
    assert 'exgrpo_http_request_seconds_count{method="GET",route="/v1/pools/{pool}",status="200"} 1.0' in text


async def test_no_access_record_is_made_where_no_handler_would_take_it(client: httpx.AsyncClient) -> None:
    """With the access logger at INFO and no handler on its way up (an app in a process that set
    up no logging), no record is made for a request (Python would drop it: its last-resort handler
    takes warnings and above); a handler added while the service runs gets every line from then on."""
    await create_pool(client, "p1")
    access = logging.getLogger("exgrpo.access")
    made: list[logging.LogRecord] = []
    real = access.makeRecord

    def spy(*args: Any, **kwargs: Any) -> logging.LogRecord:
        made.append(real(*args, **kwargs))
        return made[-1]

    level, propagate = access.level, access.propagate
    lines = _AccessLines()
    access.setLevel(logging.INFO)
    access.propagate = False  # the test run's own handlers sit on the root
    access.makeRecord = spy  # type: ignore[method-assign]
    try:
        ok(await client.get("/v1/pools/p1"))
        ok(await client.get("/v1/pools/p1/questions"))
        assert made == []
        access.addHandler(lines)
        ok(await client.get("/v1/pools/p1/questions", headers={"X-Request-ID": "later-1"}))
    finally:
        del access.makeRecord
        access.removeHandler(lines)
        access.setLevel(level)
        access.propagate = propagate
    assert len(made) == 1
    assert [(f["route"], f["status"], f["request_id"]) for f in lines.fields] == [
        ("/v1/pools/{pool}/questions", 200, "later-1")
    ]


#: metadata whose JSON text a database may keep in another form than the client sent it (Postgres
#: keeps JSONB: keys in its own order, numbers as `numeric`, spaces of its own). Not here: what JSONB
#: itself changes (-0.0 reads back as 0, 2.5e300 as its 301 digits), whichever way it is read.
_TRICKY_METADATA: list[dict[str, Any]] = [
    {},
    {"b": 1, "a": [1.0, 0.1, 1.5e-7, 2.5e-300, 123456789012345678901234567890], "": None},
    {"nested": {"deep": [{"x": [True, False, None]}, []], "empty": {}}, "zz": "last", "a": "first"},
    {"text": 'quote " backslash \\ tab \t newline \n bell \x07 é ✓ 😀 \u2028', "k\u00e9y": "\ud7ff"},
    {"n": -9223372036854775808, "m": 9223372036854775807, "f": 3.141592653589793},
]


async def test_a_page_of_questions_answers_their_prompts_and_metadata_as_imported(
    client: httpx.AsyncClient,
) -> None:
    """The page gives the values the import took and the question's own read gives, whatever form
    the database keeps their JSON in, as strict JSON (no NaN, no control character unescaped)."""
    await create_pool(client)
    sent = []
    for i, meta in enumerate(_TRICKY_METADATA):
        body = question_body(i)
        body["prompt"] = [
            {"role": "system", "content": f'sys {i} \u00e9\n"quoted"'},
            {"role": "user", "content": f"What is {i} + 0? \\boxed{{}} \t 😀"},
        ]
        body["metadata"] = meta
        sent.append(body)
    ok(await client.post("/v1/pools/p1/questions", json={"questions": sent}))
    r = await client.get("/v1/pools/p1/questions", params={"limit": 100})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")

    def refuse(constant: str) -> Any:
        raise AssertionError(f"not strict JSON: {constant}")

    page = json.loads(r.content, parse_constant=refuse)
    assert page["count"] == len(sent) and page["next_after"] is None
    for q, body in zip(page["data"], sent, strict=True):
        assert q["prompt"] == body["prompt"]
        assert q["metadata"] == body["metadata"]  # keys in any order: JSONB keeps its own
        detail = await question_detail(client, q["id"])
        assert detail["prompt"] == q["prompt"] and detail["metadata"] == q["metadata"]
        assert {k: detail[k] for k in q} == q
    # the same question on the next page alone, written the same way
    one = ok(await client.get("/v1/pools/p1/questions", params={"after": page["data"][0]["id"], "limit": 1}))
    assert one["data"] == page["data"][1:2]
