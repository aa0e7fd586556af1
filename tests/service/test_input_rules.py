"""Input the databases cannot hold is refused the same way on both backends: 422 naming the
field, nothing written. Covers NUL characters, non-finite numbers in free-form JSON, integers
beyond their columns, pool configs whose bucket weights do not normalise, and pool imports, which
are held to the rules of the API."""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from exgrpo_client.schemas import encode_b64, pack_ids

from .factories import (
    K,
    commit_batch,
    correct_first,
    create_pool,
    make_groups,
    ok,
    plan_batch,
    question_body,
    setup_pool,
)

NUL = "\x00"


def assert_422(r: httpx.Response, *words: str, case: str = "") -> dict[str, Any]:
    assert r.status_code == 422, f"{case}: {r.status_code} {r.text[:600]}"
    assert r.headers["content-type"].startswith("application/problem+json"), case
    body = r.json()
    for w in words:
        assert w in body["detail"], (case, w, body["detail"])
    return body


async def _state(client: httpx.AsyncClient) -> dict[str, Any]:
    """Everything a refused request could have changed, read back through the API."""
    pools = ok(await client.get("/v1/pools"))
    out: dict[str, Any] = {"pools": pools}
    for p in pools["data"]:
        name = p["name"]
        out[name] = {
            "questions": ok(await client.get(f"/v1/pools/{name}/questions", params={"limit": 1000})),
            "runs": ok(await client.get(f"/v1/pools/{name}/runs")),
            "stats": ok(await client.get(f"/v1/pools/{name}/stats")),
        }
        for r in out[name]["runs"]["data"]:
            base = f"/v1/pools/{name}/runs/{r['name']}"
            out[name][r["name"]] = {
                "metrics": ok(await client.get(f"{base}/metrics")),
                "versions": ok(await client.get(f"{base}/policy-versions")),
            }
    return out


async def _pool_with_tasks(client: httpx.AsyncClient) -> dict[str, Any]:
    """Pool p1 (mixed run r1 with eligible questions) and an open batch with queued tasks."""
    await setup_pool(client, phase="mixed", questions=24)
    first = await plan_batch(client)
    ok(await commit_batch(client, first, make_groups(first, correct_first(lambda q: 2))))
    return await plan_batch(client, create_tasks=True)


def _question(**changes: Any) -> dict[str, Any]:
    return {"questions": [{**question_body(10_000), **changes}]}


def _raw(client: httpx.AsyncClient, url: str, text: str) -> Any:
    return client.post(url, content=text.encode(), headers={"Content-Type": "application/json"})


# ----------------------------------------------------------------------------------------- NUL
async def test_nul_characters_are_refused_everywhere(client: httpx.AsyncClient) -> None:
    plan = await _pool_with_tasks(client)
    commit = f"/v1/pools/p1/batches/{plan['id']}/commit"
    good_groups = make_groups(plan, correct_first(lambda q: 2))
    task = ok(await client.post("/v1/pools/p1/runs/r1/tasks/claim", json={"worker": "w", "max_tasks": 1}))
    task_id, lease = task["data"][0]["id"], task["data"][0]["lease_token"]
    before = await _state(client)  # the claim is the one write made on purpose
    bodies: list[tuple[str, str, Any, str]] = [
        (
            "POST",
            "/v1/pools/p1/questions",
            _question(prompt=[{"role": "user", "content": f"a{NUL}"}]),
            "content",
        ),
        ("POST", "/v1/pools/p1/questions", _question(ground_truth=f"1{NUL}"), "ground_truth"),
        ("POST", "/v1/pools/p1/questions", _question(data_source=f"d{NUL}"), "data_source"),
        ("POST", "/v1/pools/p1/questions", _question(external_id=f"e{NUL}"), "external_id"),
        ("POST", "/v1/pools/p1/questions", _question(metadata={f"k{NUL}": 1}), "metadata"),
        ("POST", "/v1/pools/p1/questions", _question(metadata={"k": {"deep": [f"v{NUL}"]}}), "metadata"),
        ("POST", "/v1/pools", {"name": "p9", "description": f"d{NUL}"}, "description"),
        ("PATCH", "/v1/pools/p1", {"description": f"d{NUL}"}, "description"),
        ("POST", "/v1/pools/p1/runs/r1/policy-versions", {"version": 5, "uri": f"file:///m{NUL}"}, "uri"),
        ("POST", "/v1/pools/p1/runs/r1/metrics", {"step": 1, "metrics": {f"loss{NUL}": 1.0}}, "metrics"),
        ("POST", commit, {**good_groups, "metrics": {f"loss{NUL}": 1.0}}, "metrics"),
        ("POST", "/v1/pools/p1/runs/r1/tasks/claim", {"worker": f"w{NUL}"}, "worker"),
        ("POST", f"/v1/pools/p1/tasks/{task_id}/renew", {"lease_token": f"{lease}{NUL}"}, "lease_token"),
        ("POST", f"/v1/pools/p1/tasks/{task_id}/fail", {"lease_token": lease, "error": f"e{NUL}"}, "error"),
        ("PUT", "/v1/pools/p1/runs/r1/lease", {"holder": f"h{NUL}"}, "holder"),
        ("DELETE", "/v1/pools/p1/runs/r1/lease?holder=h%00", None, "holder"),
    ]
    for method, url, body, field in bodies:
        assert_422(await client.request(method, url, json=body), field, "NUL", case=f"{url} {field}")
    # path and query parameters, on reads and writes
    paths: list[tuple[str, str, Any, str]] = [
        ("GET", "/v1/pools/a%00b", None, "pool"),
        ("GET", "/v1/pools/a%00b/stats", None, "pool"),
        ("PATCH", "/v1/pools/a%00b", {"description": "x"}, "pool"),
        ("GET", "/v1/pools/p1/runs/a%00b", None, "run"),
        ("GET", "/v1/pools/p1/runs/a%00b/metrics", None, "run"),
        ("POST", "/v1/pools/p1/runs/a%00b/batches", {}, "run"),
        ("GET", "/v1/pools/p1/batches/a%00b", None, "batch_id"),
        ("GET", "/v1/pools/p1/batches/a%00b/status", None, "batch_id"),
        ("POST", "/v1/pools/p1/batches/a%00b/commit", good_groups, "batch_id"),
        ("POST", "/v1/pools/import?name=a%00b", None, "name"),
    ]
    for method, url, body, field in paths:
        r = await client.request(method, url, json=body)
        assert_422(r, field, case=url)
    assert await _state(client) == before
    # the same requests without the NUL are fine
    ok(await client.post("/v1/pools/p1/questions", json=_question(metadata={"k": {"deep": ["v"]}})))
    ok(await client.post("/v1/pools/p1/runs/r1/metrics", json={"step": 1, "metrics": {"loss": 1.0}}))


# --------------------------------------------------------------------------- free-form JSON
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]


async def test_non_finite_numbers_in_metadata_are_refused(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    before = await _state(client)
    for literal in NON_FINITE:
        for meta in ({"x": "LITERAL"}, {"x": [1, {"y": "LITERAL"}]}):
            body = json.dumps(_question(metadata=meta)).replace('"LITERAL"', literal)
            r = await _raw(client, "/v1/pools/p1/questions", body)
            assert_422(r, "metadata", "finite", case=body)
    # nesting deeper than a document needs
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    assert_422(await client.post("/v1/pools/p1/questions", json=_question(metadata={"x": deep})), "metadata")
    assert await _state(client) == before
    # what JSON can hold is kept as sent, and the export stays strict JSON
    meta = {"big": 2**70, "neg": -(2**63), "tiny": 5e-324, "s": "é\u2028", "n": None, "l": [[]], "f": 1.5e300}
    ok(await client.post("/v1/pools/p1/questions", json=_question(metadata=meta)))
    stored = [q for q in ok(await client.get("/v1/pools/p1/questions", params={"limit": 1000}))["data"]]
    (back,) = [q["metadata"] for q in stored if q["metadata"]]
    # Postgres keeps a JSON number as a decimal: 1.5e300 comes back as the same number, written out
    assert math.isclose(back.pop("f"), meta.pop("f"), rel_tol=1e-15)
    assert back == meta
    _strict_ndjson((await client.get("/v1/pools/p1/export")).text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def _strict_ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line, parse_constant=_reject_constant) for line in text.split("\n") if line]


# -------------------------------------------------------------------------------- pool configs
BREAKING_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"sigma": 1e-200}, "sigma"),  # 2 sigma^2 underflows to 0: ZeroDivisionError
    ({"sigma": 1e-160}, "sigma"),  # every weight but the centre's underflows to exp(-inf)
    ({"mu": 1e308}, "mu"),  # (k - mu)^2 overflows: OverflowError
    ({"mu": -1e200, "sigma": 1e-3}, "mu"),
    ({"unit": "accuracy", "sigma": 1e-170}, "sigma"),
]


@pytest.mark.parametrize("where", ["create", "patch"])
async def test_configs_whose_weights_break_sampling_are_refused(
    client: httpx.AsyncClient, where: str
) -> None:
    await setup_pool(client, phase="mixed", questions=24)
    before = await _state(client)
    for bad, word in BREAKING_CONFIGS:
        config = {"k": K, "batch_size": 8, **bad}
        if where == "create":
            r = await client.post("/v1/pools", json={"name": "p2", "config": config})
        else:
            r = await client.patch("/v1/pools/p1", json={"config": config})
        assert_422(r, word, case=str(bad))
    assert await _state(client) == before


EDGE_CONFIGS: list[dict[str, Any]] = [
    {"sigma": 1e-6},
    {"sigma": 1e6},
    {"mu": 1e6, "sigma": 1e-6},
    {"mu": -1e6},
    {"unit": "accuracy", "mu": 1e6, "sigma": 1e-6},
    {"weighting": "linear", "lbound": 1},
]


@pytest.mark.parametrize("config", EDGE_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
async def test_configs_at_the_edges_sample(client: httpx.AsyncClient, config: dict[str, Any]) -> None:
    """Every config the schema allows plans, replays and selects (never a 500)."""
    await setup_pool(client, phase="mixed", questions=24, **config)
    for step in range(3):
        plan = await plan_batch(client)
        assert (step == 0) or plan["replay"], plan
        ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 1 + q % 3))))
    assert ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 5}))["replay"]


# ------------------------------------------------------------------------------------ integers
async def test_integral_numbers_count_as_integers(client: httpx.AsyncClient) -> None:
    """JSON Schema calls 5742733.0 an integer; the service agrees (and refuses 0.5 or "5")."""
    await setup_pool(client)
    run = ok(await client.post("/v1/pools/p1/runs", json={"name": "r2", "seed": 5742733.0}), 201)
    assert run["seed"] == 5742733 and isinstance(run["seed"], int)
    assert len((await plan_batch(client, "p1", "r2", batch_size=4.0))["fresh"]) == 4
    before = await _state(client)
    for seed in (5742733.5, "5", True, 1e300, 2.0**31):
        assert_422(await client.post("/v1/pools/p1/runs", json={"name": "r3", "seed": seed}), "seed")
    assert await _state(client) == before


async def test_integers_beyond_their_columns_are_refused(client: httpx.AsyncClient) -> None:
    plan = await _pool_with_tasks(client)
    before = await _state(client)
    groups = make_groups(plan, correct_first(lambda q: 2))
    replayed = next(g for g in groups["groups"] if "replay_trajectory_id" in g)
    cases: list[tuple[str, str, Any, str]] = [
        (
            "POST",
            "/v1/pools",
            {"name": "p5", "config": {"active_refresh_margin": 2**70}},
            "active_refresh_margin",
        ),
        ("POST", "/v1/pools", {"name": "p5", "config": {"lbound": 2**70}}, "lbound"),
        (
            "POST",
            f"/v1/pools/p1/batches/{plan['id']}/commit",
            {"groups": [{**replayed, "replay_trajectory_id": 2**70}]},
            "replay_trajectory_id",
        ),
        (
            "POST",
            "/v1/pools/p1/runs/r1/ingest",
            {"groups": [{**replayed, "replay_trajectory_id": 2**63}]},
            "replay_trajectory_id",
        ),
        ("POST", "/v1/pools/p1/runs/r1/metrics", {"step": 2**31, "metrics": {"x": 1.0}}, "step"),
    ]
    for method, url, body, field in cases:
        assert_422(await client.request(method, url, json=body), field, case=field)
    assert await _state(client) == before


async def test_every_integer_of_a_request_body_is_bounded(client: httpx.AsyncClient) -> None:
    """The schema of every request body gives each integer a maximum a database column holds."""
    spec = ok(await client.get("/openapi.json"))
    schemas = spec["components"]["schemas"]
    unbounded: list[str] = []

    def walk(node: Any, where: str, seen: frozenset[str]) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None:
                name = ref.rsplit("/", 1)[-1]
                if name not in seen:
                    walk(schemas[name], name, seen | {name})
                return
            if node.get("type") == "integer" and not (
                isinstance(node.get("maximum"), int) and node["maximum"] <= 2**63 - 1
            ):
                unbounded.append(where)
            for key, value in node.items():
                walk(value, f"{where}.{key}", seen)
        elif isinstance(node, list):
            for value in node:
                walk(value, where, seen)

    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                walk(param["schema"], f"{method} {path} {param['name']}", frozenset())
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                walk(body["schema"], f"{method} {path}", frozenset())
    # a selection seed only seeds a generator: any integer is fine (see test_validation)
    assert [u for u in unbounded if not u.startswith("SelectRequest.properties.seed")] == []


# ------------------------------------------------------------------------------------- imports
async def _export(client: httpx.AsyncClient, pool: str = "p1") -> list[dict[str, Any]]:
    r = await client.get(f"/v1/pools/{pool}/export")
    assert r.status_code == 200
    return _strict_ndjson(r.text)


def _lines(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(rec) + "\n" for rec in records).encode()


Mutation = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def _change(kind: str, **changes: Any) -> Mutation:
    """The export with the first record of `kind` changed."""

    def apply(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = copy.deepcopy(records)
        rec = next(r for r in out if r["type"] == kind)
        rec.update(changes)
        return out

    return apply


def _append(extra: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> Mutation:
    return lambda records: [*copy.deepcopy(records), extra(records)]


def _first(records: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(r for r in records if r["type"] == kind)


def _logprobs_b64(values: list[float]) -> str:
    return encode_b64(struct.pack(f"<{len(values)}f", *values))


IMPORT_CASES: list[tuple[str, Mutation, tuple[str, ...]]] = [
    ("bogus phase", _change("run", phase="bogus"), ("phase",)),
    ("seed beyond int32", _change("run", seed=2**70), ("seed",)),
    ("step beyond int32", _change("run", step=2**40), ("step",)),
    ("bucket beyond K", _change("state", bucket=99, retired=False), ("bucket", "1 to 3")),
    ("bucket 0", _change("state", bucket=0, retired=False), ("bucket",)),
    ("last_k beyond K", _change("state", last_k=K + 1), ("last_k",)),
    ("retired with a bucket", _change("state", retired=True, bucket=2), ("retired",)),
    ("scope 0 in a per-run pool", _change("state", scope=0), ("scope",)),
    ("NaN reward", _change("trajectory", reward=math.nan), ("reward",)),
    ("NaN log-prob", _change("trajectory", logprobs_b64=_logprobs_b64([math.nan] * 4)), ("finite",)),
    ("positive log-prob", _change("trajectory", logprobs_b64=_logprobs_b64([0.5] * 4)), ("<= 0",)),
    (
        "negative token id",
        _change("trajectory", token_ids_b64=pack_ids([-1, 2, 3, 4])),
        ("token ids",),
    ),
    ("empty trajectory", _change("trajectory", token_ids_b64="", logprobs_b64=""), ("at least one token",)),
    ("NUL in a question", _change("question", ground_truth=f"1{NUL}"), ("ground_truth", "NUL")),
    ("NUL in a policy URI", _change("policy_version", uri=f"x{NUL}"), ("uri", "NUL")),
    (
        "NUL in the description",
        lambda rs: [{**rs[0], "pool": {**rs[0]["pool"], "description": NUL}}, *rs[1:]],
        ("description",),
    ),
    (
        "sigma that underflows",
        lambda rs: [
            {**rs[0], "pool": {**rs[0]["pool"], "config": {**rs[0]["pool"]["config"], "sigma": 1e-200}}},
            *rs[1:],
        ],
        ("sigma",),
    ),
    ("a run name twice", _append(lambda rs: {**_first(rs, "run"), "id": 10**6}), ("r1", "twice")),
    ("a run id twice", _append(lambda rs: {**_first(rs, "run"), "name": "other"}), ("run id", "twice")),
    (
        "a policy version twice",
        _append(lambda rs: {**_first(rs, "policy_version"), "uri": "y"}),
        ("version",),
    ),
    (
        "a question id twice",
        _append(lambda rs: {**_first(rs, "question"), "ground_truth": "new"}),
        ("question id",),
    ),
]


@pytest.mark.parametrize(("case", "mutate", "words"), IMPORT_CASES, ids=[c[0] for c in IMPORT_CASES])
async def test_imports_are_held_to_the_api_rules(
    client: httpx.AsyncClient, case: str, mutate: Mutation, words: tuple[str, ...]
) -> None:
    await setup_pool(client, phase="mixed", questions=16)
    plan = await plan_batch(client)
    ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
    ok(
        await client.post("/v1/pools/p1/runs/r1/policy-versions", json={"version": 1, "uri": "file:///m/1"}),
        201,
    )
    records = await _export(client)
    assert {r["type"] for r in records} >= {
        "header",
        "run",
        "policy_version",
        "question",
        "state",
        "trajectory",
    }
    before = await _state(client)
    r = await client.post("/v1/pools/import", params={"name": "copy"}, content=_lines(mutate(records)))
    body = assert_422(r, *words, case=case)
    assert "import line" in body["detail"], body
    assert await _state(client) == before
    # the export itself imports, and the copy plans with replays and selects
    ok(await client.post("/v1/pools/import", params={"name": "copy"}, content=_lines(records)), 201)
    replan = await plan_batch(client, "copy", "r1")
    assert replan["replay"]
    assert ok(await client.post("/v1/pools/copy/runs/r1/select", json={"n": 3}))["replay"]


async def test_import_of_a_pooled_pool_checks_scopes(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed", questions=16, sharing="pooled")
    plan = await plan_batch(client)
    ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
    records = await _export(client)
    run_id = _first(records, "run")["id"]
    before = await _state(client)
    bad = _change("state", scope=run_id)(records)
    assert_422(await client.post("/v1/pools/import?name=copy", content=_lines(bad)), "scope")
    assert await _state(client) == before
    ok(await client.post("/v1/pools/import?name=copy", content=_lines(records)), 201)


async def test_import_name_must_be_a_pool_name(client: httpx.AsyncClient) -> None:
    await create_pool(client)
    records = await _export(client)
    before = await _state(client)
    for name in ("has space", "", "-lead", "x" * 129):
        assert_422(
            await client.post("/v1/pools/import", params={"name": name}, content=_lines(records)), "name"
        )
    assert await _state(client) == before
