"""Bad requests: each is refused with problem+json (a 4xx and a useful detail) and writes nothing."""

from __future__ import annotations

import base64
import copy
import json
import math
import struct
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .factories import (
    K,
    commit_batch,
    correct_first,
    create_pool,
    group,
    make_groups,
    ok,
    plan_batch,
    pool_stats,
    rollout,
    run_stats,
    setup_pool,
)
from .harness import (
    ADMIN_TOKEN,
    READ_TOKEN,
    WRITE_OTHER_TOKEN,
    WRITE_P1_TOKEN,
    Backend,
    bearer,
    serve,
    serve_app,
)


async def _snapshot(client: httpx.AsyncClient, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "pools": ok(await client.get("/v1/pools")),
        "pool": await pool_stats(client),
        "run": ok(await client.get("/v1/pools/p1/runs/r1")),
        "run_stats": await run_stats(client),
        "versions": ok(await client.get("/v1/pools/p1/runs/r1/policy-versions")),
    }
    if plan is not None:
        snap["batch"] = ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}/status"))
    return snap


def assert_problem(r: httpx.Response, status: int, *words: str, case: str = "") -> dict[str, Any]:
    """A problem+json error with this status whose detail mentions every word."""
    assert r.status_code == status, f"{case}: {r.status_code} {r.text[:1000]}"
    assert r.headers["content-type"].startswith("application/problem+json"), (case, r.headers["content-type"])
    body = r.json()
    assert body["status"] == status and body["title"] and isinstance(body["detail"], str) and body["detail"]
    for w in words:
        assert w in body["detail"], (case, w, body["detail"])
    return body


async def _mixed_plan(client: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pool with eligible questions and an open mixed-phase batch with replays."""
    await setup_pool(client, phase="mixed", questions=32)
    first = await plan_batch(client)
    ok(await commit_batch(client, first, make_groups(first, correct_first(lambda q: 2))))
    plan = await plan_batch(client)
    assert plan["replay"]
    return plan, make_groups(plan, correct_first(lambda q: 2))


def _with_rollout(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    bad = copy.deepcopy(body)
    bad["groups"][0]["rollouts"][0].update(changes)
    return bad


def _b64_floats(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


async def test_bad_commits_are_refused_and_write_nothing(client: httpx.AsyncClient) -> None:
    plan, body = await _mixed_plan(client)
    before = await _snapshot(client, plan)
    ids = [5, 6, 7]
    cases: list[tuple[str, dict[str, Any], int, tuple[str, ...]]] = [
        (
            "K mismatch",
            {
                "groups": [
                    {**body["groups"][0], "rollouts": body["groups"][0]["rollouts"][: K - 1]},
                    *body["groups"][1:],
                ]
            },
            422,
            ("K is 4",),
        ),
        (
            "NaN log-prob in base64",
            _with_rollout(body, logprobs_b64=_b64_floats([-0.5, math.nan, -0.5, -0.5])),
            422,
            ("finite",),
        ),
        (
            "infinite log-prob in base64",
            _with_rollout(body, logprobs_b64=_b64_floats([-math.inf] * 4)),
            422,
            ("finite",),
        ),
        ("positive log-prob", _with_rollout(body, logprobs_b64=_b64_floats([0.5] * 4)), 422, ("<= 0",)),
        ("strict reward type", _with_rollout(body, reward=False), 422, ("reward",)),
        ("reward as string", _with_rollout(body, reward="1"), 422, ("reward",)),
        ("unknown field", _with_rollout(body, rewrad=1.0), 422, ("rewrad",)),
        ("both list and base64 ids", _with_rollout(body, token_ids=[1, 2, 3, 4]), 422, ("not both",)),
        ("ids without log-probs", _with_rollout(body, logprobs_b64=None), 422, ("both or neither",)),
        (
            "correct rollout without payload",
            _with_rollout(body, token_ids_b64=None, logprobs_b64=None, reward=1.0),
            422,
            ("token ids",),
        ),
        ("broken base64", _with_rollout(body, token_ids_b64="!!notbase64!!"), 422, ("packed",)),
        (
            "ragged int32 bytes",
            _with_rollout(body, token_ids_b64=base64.b64encode(b"\x01\x02\x03").decode()),
            422,
            ("packed",),
        ),
        (
            "negative token id",
            _with_rollout(body, token_ids_b64=None, logprobs_b64=None, token_ids=[-1], logprobs=[-0.5]),
            422,
            ("token_ids", "greater than or equal to 0"),
        ),
        (
            "empty trajectory",
            _with_rollout(body, token_ids_b64=None, logprobs_b64=None, token_ids=[], logprobs=[]),
            422,
            ("at least one token",),
        ),
        (
            "two replayed rows",
            {
                "groups": [
                    {**g, "rollouts": [{"reward": 1.0, "replayed": True}] * K}
                    if "replay_trajectory_id" in g
                    else g
                    for g in body["groups"]
                ]
            },
            422,
            ("replayed",),
        ),
        ("no groups", {"groups": []}, 422, ("groups",)),
        ("groups not a list", {"groups": {"a": 1}}, 422, ("groups",)),
        ("negative policy version", {**body, "policy_version": -1}, 422, ("policy_version",)),
        ("NaN metric", {**body, "metrics": {"loss": "nan"}}, 422, ("metrics",)),
    ]
    # ids and log-probs of different lengths, as lists and as base64
    lists = _with_rollout(body, token_ids_b64=None, logprobs_b64=None, token_ids=ids, logprobs=[-0.5, -0.5])
    cases.append(("length mismatch (lists)", lists, 422, ("3 token ids but 2 log-probs",)))
    packed = _with_rollout(body, logprobs_b64=_b64_floats([-0.5] * 3))
    cases.append(("length mismatch (base64)", packed, 422, ("4 token ids but 3 log-probs",)))
    for name, bad, status, words in cases:
        r = await commit_batch(client, plan, bad)
        assert_problem(r, status, *words, case=name)
        assert r.json()["instance"] == f"/v1/pools/p1/batches/{plan['id']}/commit", name
    assert await _snapshot(client, plan) == before
    ok(await commit_batch(client, plan, body))


async def test_nan_in_a_json_list_is_refused(client: httpx.AsyncClient) -> None:
    plan, body = await _mixed_plan(client)
    before = await _snapshot(client, plan)
    bad = _with_rollout(
        body, token_ids_b64=None, logprobs_b64=None, token_ids=[1, 2], logprobs=[-0.5, math.nan]
    )
    raw = json.dumps(bad)  # Python writes the non-standard literal NaN
    assert "NaN" in raw
    r = await client.post(
        f"/v1/pools/p1/batches/{plan['id']}/commit", content=raw, headers={"Content-Type": "application/json"}
    )
    assert_problem(r, 422, "logprobs")
    inf = raw.replace("NaN", "-Infinity")
    assert_problem(
        await client.post(
            f"/v1/pools/p1/batches/{plan['id']}/commit",
            content=inf,
            headers={"Content-Type": "application/json"},
        ),
        422,
        "logprobs",
    )
    not_json = await client.post(
        f"/v1/pools/p1/batches/{plan['id']}/commit",
        content=b"{groups: [",
        headers={"Content-Type": "application/json"},
    )
    assert_problem(not_json, 422)
    assert await _snapshot(client, plan) == before


async def test_unknown_resources_are_404(client: httpx.AsyncClient) -> None:
    plan, body = await _mixed_plan(client)
    before = await _snapshot(client, plan)
    assert_problem(await client.post(f"/v1/pools/nope/batches/{plan['id']}/commit", json=body), 404, "nope")
    assert_problem(
        await client.post("/v1/pools/p1/batches/not-a-batch/commit", json=body), 404, "not-a-batch"
    )
    assert_problem(await client.post("/v1/pools/nope/runs/r1/batches", json={}), 404, "nope")
    assert_problem(await client.post("/v1/pools/p1/runs/nope/batches", json={}), 404, "nope")
    assert_problem(await client.post("/v1/pools/p1/runs/nope/ingest", json=body), 404, "nope")
    assert_problem(await client.post("/v1/pools/nope/questions", json={"questions": []}), 404, "nope")
    assert_problem(await client.get("/v1/nothing-here"), 404)
    # a batch of one pool is not reachable through another
    await create_pool(client, "p2")
    assert_problem(await client.post(f"/v1/pools/p2/batches/{plan['id']}/commit", json=body), 404)
    assert_problem(await client.put("/v1/pools/p1"), 405)  # DELETE deletes a pool (admin)
    after = await _snapshot(client, plan)
    after["pools"] = before["pools"]  # p2 was created on purpose
    assert after == before


async def test_ingest_refuses_questions_of_other_pools(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    await create_pool(client, "p2")
    before = await _snapshot(client)
    body = {"groups": [group(10**6, [1, 0, 0, 0])]}
    assert_problem(await client.post("/v1/pools/p1/runs/r1/ingest", json=body), 422, "not in pool")
    assert await _snapshot(client) == before


async def test_scopes(backend: Backend, client: httpx.AsyncClient) -> None:
    plan, body = await _mixed_plan(client)
    before = await _snapshot(client, plan)
    url = f"/v1/pools/p1/batches/{plan['id']}/commit"
    settings_ = backend.settings()
    async with serve(settings_, READ_TOKEN) as reader, serve(settings_, WRITE_OTHER_TOKEN) as other:
        assert_problem(await reader.post(url, json=body), 403, "write:p1")
        assert_problem(await other.post(url, json=body), 403, "write:p1")
        assert_problem(await reader.post("/v1/pools", json={"name": "p3"}), 403)
        assert_problem(await reader.post("/v1/pools/p1/runs/r1/batches", json={}), 403)
        assert_problem(await other.post("/v1/pools/p1/questions", json={"questions": []}), 403)
        assert_problem(await reader.post("/v1/admin/index/rebuild"), 403, "admin")
        assert_problem(await reader.post("/v1/pools/import", content=b"{}"), 403, "admin")
        # reading is allowed
        assert ok(await reader.get("/v1/pools/p1"))["name"] == "p1"
        # no token, an unknown token, a malformed header
        anon = await reader.post(url, json=body, headers={"Authorization": ""})
        assert_problem(anon, 401, "bearer token")
        assert_problem(await reader.get("/v1/pools", headers=bearer("x" * 30)), 401, "unknown")
        assert_problem(await reader.get("/v1/pools", headers={"Authorization": "Basic abc"}), 401, "Bearer")
        # a pool-scoped writer may create that pool only
        assert_problem(await other.post("/v1/pools", json={"name": "p3"}), 403, "p3")
    assert await _snapshot(client, plan) == before
    async with serve(settings_, WRITE_P1_TOKEN) as writer:
        ok(await writer.post(url, json=body))


async def test_no_token_at_all_is_401(backend: Backend) -> None:
    async with serve(backend.settings()) as c:
        c.headers.pop("Authorization")
        assert_problem(await c.get("/v1/pools"), 401, "bearer token")
        assert_problem(await c.post("/v1/pools", json={"name": "p1"}), 401)
        # the probes stay open
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/readyz")).status_code == 200
    async with serve(backend.settings()) as admin:
        assert ok(await admin.get("/v1/pools"))["count"] == 0


async def test_oversize_request_is_413(backend: Backend) -> None:
    async with serve(backend.settings()) as c:
        await setup_pool(c)
        plan = await plan_batch(c)
    async with serve(backend.settings(max_request_bytes=1024)) as c:
        before = await _snapshot(c, plan)
        body = make_groups(plan, correct_first(lambda q: 2))
        assert len(json.dumps(body)) > 1024
        assert_problem(await commit_batch(c, plan, body), 413, "1024 bytes")
        many = {
            "questions": [
                {"prompt": [{"role": "user", "content": "x" * 100}], "ground_truth": str(i)}
                for i in range(20)
            ]
        }
        assert_problem(await c.post("/v1/pools/p1/questions", json=many), 413)

        # a streamed body without Content-Length is cut off as well
        async def chunks() -> Any:
            for _ in range(10):
                yield b" " * 200

        streamed = await c.post(
            "/v1/pools/p1/questions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert_problem(streamed, 413)
        assert await _snapshot(c, plan) == before


async def _raw_request(
    app: Any, http_version: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> int:
    """A POST of a page of questions sent to the app as an ASGI server of `http_version` sends it
    (the body in `chunks`, with exactly the `headers` given): its answer's status."""
    pending = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": http_version, "method": "POST",
        "scheme": "http", "path": "/v1/pools/p1/questions", "raw_path": b"/v1/pools/p1/questions",
        "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1), "server": ("test", 80),
        "headers": [(b"host", b"test"), (b"authorization", f"Bearer {ADMIN_TOKEN}".encode()), *headers],
    }  # fmt: skip
    await app(scope, receive, send)
    return int(sent[0]["status"])


async def test_a_body_without_a_length_is_limited_over_every_http_version(backend: Backend) -> None:
    """HTTP/1 requests without a length or a transfer coding have no body and go to the app as
    they came; a body streamed without either (HTTP/2 sends one so) is limited all the same."""
    json_in = (b"content-type", b"application/json")
    big = [b"[" + b" " * 200] + [b" " * 200] * 9 + [b"]"]
    async with serve(backend.settings()) as c:
        await setup_pool(c)
    async with serve_app(backend.settings(max_request_bytes=1024)) as (app, c):
        before = await _snapshot(c)
        assert await _raw_request(app, "2", [json_in], big) == 413
        assert await _raw_request(app, "1.1", [json_in, (b"transfer-encoding", b"chunked")], big) == 413
        # without a body: the body's model refuses it (422), nothing is stored
        assert await _raw_request(app, "1.1", [json_in], [b""]) == 422
        assert await _raw_request(app, "2", [json_in], [b""]) == 422
        assert await _snapshot(c) == before


async def test_bad_pool_and_run_bodies(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    before = await _snapshot(client)
    bad_pools = [
        ({"name": "has space"}, "name"),
        ({"name": "p5", "config": {"k": 1}}, "k"),
        ({"name": "p5", "config": {"k": 4, "rbound": 4}}, "rbound"),
        ({"name": "p5", "config": {"k": 4, "lbound": 3}}, "lbound"),
        ({"name": "p5", "config": {"experience_ratio": 1.5}}, "experience_ratio"),
        ({"name": "p5", "config": {"sigma": 0}}, "sigma"),
        ({"name": "p5", "config": {"weighting": "cubic"}}, "weighting"),
        ({"name": "p5", "config": {"batch_size": "8"}}, "batch_size"),
        ({"name": "p5", "extra": 1}, "extra"),
    ]
    for body, word in bad_pools:
        assert_problem(await client.post("/v1/pools", json=body), 422, word)
    bad_runs = [
        ({"name": "r9", "seed": -1}, "seed"),
        ({"name": "r9", "phase": "offline"}, "phase"),
        ({"name": "r9", "overrides": {"batch_size": 0}}, "batch_size"),
        ({"name": "r9", "seed": True}, "seed"),
    ]
    for body, word in bad_runs:
        assert_problem(await client.post("/v1/pools/p1/runs", json=body), 422, word)
    bad_questions = [
        {"questions": []},
        {"questions": [{"prompt": [], "ground_truth": "1"}]},
        {"questions": [{"prompt": [{"role": "robot", "content": "hi"}], "ground_truth": "1"}]},
        {"questions": [{"prompt": [{"role": "user", "content": "hi"}]}]},
        {"questions": [{"prompt": [{"role": "user", "content": "hi"}], "ground_truth": 1}]},
    ]
    for body in bad_questions:
        assert_problem(await client.post("/v1/pools/p1/questions", json=body), 422, "questions")
    assert_problem(
        await client.post("/v1/pools/p1/runs/r1/batches", json={"batch_size": 0}), 422, "batch_size"
    )
    assert_problem(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 0}), 422, "n")
    assert_problem(await client.post("/v1/pools/p1/runs/r1/tasks/claim", json={"worker": ""}), 422, "worker")
    assert_problem(
        await client.post("/v1/pools/p1/runs/r1/policy-versions", json={"version": 1, "uri": ""}), 422, "uri"
    )
    assert await _snapshot(client) == before


# ------------------------------------------------------------------------------ never a 500
HUGE = 2**70


async def test_out_of_range_numbers_are_4xx(client: httpx.AsyncClient) -> None:
    plan, body = await _mixed_plan(client)
    before = await _snapshot(client, plan)
    commit = f"/v1/pools/p1/batches/{plan['id']}/commit"

    def tokens(qid: int, row: int) -> list[int]:
        return [1, row + 2]

    requests: list[tuple[str, str, Any]] = [
        (
            "POST",
            commit,
            _with_rollout(body, token_ids_b64=None, logprobs_b64=None, token_ids=[HUGE], logprobs=[-0.5]),
        ),
        (
            "POST",
            commit,
            _with_rollout(body, token_ids_b64=None, logprobs_b64=None, token_ids=[2**31], logprobs=[-0.5]),
        ),
        (
            "POST",
            commit,
            {**body, "groups": [{**body["groups"][0], "question_id": HUGE}, *body["groups"][1:]]},
        ),
        ("POST", commit, {**body, "policy_version": HUGE}),
        ("POST", commit, {**body, "policy_version": 2**40}),
        ("POST", commit, _with_rollout(body, reward=1e300)),
        (
            "POST",
            commit,
            _with_rollout(body, token_ids_b64=None, logprobs_b64=None, token_ids=[1], logprobs=[-1e300]),
        ),
        ("POST", "/v1/pools/p1/runs/r1/ingest", {"groups": [group(HUGE, [1, 0, 0, 0], tokens)]}),
        ("POST", "/v1/pools/p1/runs/r1/ingest", {"groups": [group(-1, [1, 0, 0, 0], tokens)]}),
        ("POST", "/v1/pools/p1/runs/r1/ingest", {"groups": body["groups"][:1], "step": 2**40}),
        ("POST", "/v1/pools/p1/runs/r1/ingest", {"groups": body["groups"][:1], "policy_version": HUGE}),
        ("POST", "/v1/pools/p1/runs/r1/policy-versions", {"version": HUGE, "uri": "x"}),
        ("POST", "/v1/pools/p1/runs/r1/policy-versions", {"version": 2**40, "uri": "x", "step": 2**40}),
        (
            "POST",
            f"/v1/pools/p1/tasks/{HUGE}/complete",
            {"lease_token": "x", "rollouts": [rollout(1, 0, 1.0)]},
        ),
        ("POST", f"/v1/pools/p1/tasks/{HUGE}/renew", {"lease_token": "x"}),
        ("POST", f"/v1/pools/p1/tasks/{HUGE}/fail", {"lease_token": "x", "error": "e"}),
        ("GET", f"/v1/pools/p1/questions/{HUGE}", None),
        ("GET", f"/v1/pools/p1/questions?after={HUGE}", None),
        ("POST", "/v1/pools/p1/runs/r1/tasks/claim", {"worker": "w", "lease_seconds": 1e9}),
        ("POST", "/v1/pools/p1/runs/r1/batches", {"batch_size": HUGE}),
    ]
    failures = []
    for method, url, payload in requests:
        r = await client.request(method, url, json=payload)
        if not 400 <= r.status_code < 500:
            failures.append((method, url, r.status_code, r.text[:300]))
            continue
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["detail"]
    assert not failures, "\n".join(map(str, failures))
    # any integer is a fine selection seed
    for seed in (HUGE, -HUGE):
        picks = [
            ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 2, "seed": seed}))
            for _ in range(2)
        ]
        assert picks[0] == picks[1] and len(picks[0]["replay"]) == 2
    after = await _snapshot(client, plan)
    assert after == before


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    # what Postgres cannot hold: NaN and infinities (sent as the literals NaN, Infinity), NUL
    | st.sampled_from([math.nan, math.inf, -math.inf, "\x00", "a\x00b"])
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.just("k\x00"), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(body: Any, path: tuple[Any, ...], action: str, value: Any) -> Any:
    body = copy.deepcopy(body)
    if not path:
        return value
    parent = body
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "replace":
        parent[last] = value
    elif isinstance(parent, dict):
        parent[f"x_{last}"] = value
    return body


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
async def test_malformed_bodies_never_500(client: httpx.AsyncClient, data: st.DataObject) -> None:
    if not (await client.get("/v1/pools")).json()["count"]:
        await setup_pool(client, phase="mixed", questions=32)
        first = await plan_batch(client)
        ok(await commit_batch(client, first, make_groups(first, correct_first(lambda q: 2))))
    plan = await plan_batch(client)
    valid = make_groups(plan, correct_first(lambda q: 2), b64=data.draw(st.booleans()))
    valid["groups"] = valid["groups"][:2] + valid["groups"][-1:]
    targets = {
        "commit": f"/v1/pools/p1/batches/{plan['id']}/commit",
        "ingest": "/v1/pools/p1/runs/r1/ingest",
        "select": "/v1/pools/p1/runs/r1/select",
        "plan": "/v1/pools/p1/runs/r1/batches",
        "claim": "/v1/pools/p1/runs/r1/tasks/claim",
        "questions": "/v1/pools/p1/questions",
        "metrics": "/v1/pools/p1/runs/r1/metrics",
        "versions": "/v1/pools/p1/runs/r1/policy-versions",
        "pool": "/v1/pools",
    }
    bodies = {
        "commit": valid,
        "ingest": {"groups": valid["groups"], "step": 3, "policy_version": 1},
        "select": {"n": 3, "seed": 1, "candidates": "all"},
        "plan": {"batch_size": 8, "experience_ratio": 0.5, "candidates": "all"},
        "claim": {"worker": "w", "max_tasks": 2, "lease_seconds": 10.0},
        "questions": {
            "questions": [
                {"prompt": [{"role": "user", "content": "hi"}], "ground_truth": "1", "metadata": {"a": [1]}}
            ]
        },
        "metrics": {"step": 1, "metrics": {"loss": 0.5}},
        "versions": {"version": 2, "uri": "file:///w/2", "step": 1},
        "pool": {"name": "p2", "description": "d", "config": {"k": 4, "sigma": 1.0, "mu": 2.0}},
    }
    target = data.draw(st.sampled_from(sorted(targets)))
    body = bodies[target]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(body)))
        action = data.draw(st.sampled_from(["replace", "delete", "add"] if path else ["replace"]))
        body = _mutate(body, path, action, data.draw(_json))
    # json.dumps writes NaN and Infinity as the literals some clients send (httpx would refuse)
    content = json.dumps(body)
    r = await client.post(targets[target], content=content, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (target, body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["detail"]
