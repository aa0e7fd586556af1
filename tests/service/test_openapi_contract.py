"""The OpenAPI document describes the API that runs: every error an operation can answer is
declared with its problem+json body, and a wrong method names the allowed ones."""

from __future__ import annotations

from typing import Any

import httpx

from exgrpo_client.schemas import Problem

from .factories import ok, setup_pool

PROBLEM = "application/problem+json"


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method.upper(), path, op)
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        if method in {"get", "post", "put", "patch", "delete"}
    ]


async def test_every_operation_declares_its_errors_as_problems(client: httpx.AsyncClient) -> None:
    spec = ok(await client.get("/openapi.json"))
    problem = spec["components"]["schemas"]["Problem"]
    assert set(problem["required"]) >= {"title", "status", "detail"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    missing: list[str] = []
    for method, path, op in _operations(spec):
        responses = op["responses"]
        expected = set()
        if path.startswith("/v1/"):
            expected |= {"401", "403", "503"}
        if "{" in path:
            expected.add("404")
        if op.get("parameters") or "requestBody" in op:
            expected.add("422")
        if "requestBody" in op:
            expected |= {"400", "413"}
        if method in {"POST", "PATCH"} and path.startswith("/v1/pools"):
            expected.add("409")
        for status in sorted(expected):
            if status not in responses:
                missing.append(f"{method} {path} {status}")
                continue
            content = responses[status].get("content", {})
            if list(content) != [PROBLEM] or content[PROBLEM]["schema"] != {
                "$ref": "#/components/schemas/Problem"
            }:
                missing.append(f"{method} {path} {status}: {content}")
        for status, response in responses.items():
            if status.startswith(("4", "5")) and path.startswith("/v1/"):
                assert list(response.get("content", {})) == [PROBLEM], (method, path, status)
    assert missing == []


async def test_writes_declare_the_idempotency_key(client: httpx.AsyncClient) -> None:
    spec = ok(await client.get("/openapi.json"))
    ops = {(m, p): op for m, p, op in _operations(spec)}
    commit = ops[("POST", "/v1/pools/{pool}/batches/{batch_id}/commit")]
    key = [p for p in commit["parameters"] if p["name"] == "Idempotency-Key"]
    assert key and key[0]["in"] == "header" and key[0]["schema"]["maxLength"] == 255
    reads = ops[("GET", "/v1/pools/{pool}")]
    assert all(p["name"] != "Idempotency-Key" for p in reads.get("parameters", []))


async def test_documented_content_types(client: httpx.AsyncClient) -> None:
    spec = ok(await client.get("/openapi.json"))
    ops = {(m, p): op for m, p, op in _operations(spec)}
    assert list(ops[("GET", "/metrics")]["responses"]["200"]["content"]) == ["text/plain"]
    both = ["application/x-ndjson", "application/x-msgpack"]
    assert list(ops[("GET", "/v1/pools/{pool}/export")]["responses"]["200"]["content"]) == both
    assert list(ops[("POST", "/v1/pools/import")]["requestBody"]["content"]) == both
    assert "503" in ops[("GET", "/readyz")]["responses"]


async def test_errors_match_the_declared_problem_schema(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    for r in (
        await client.get("/v1/pools/nope"),
        await client.post("/v1/pools", json={"name": "bad name"}),
        await client.post("/v1/pools", json={"name": "p1"}),
        await client.put("/v1/pools/p1"),
    ):
        assert r.status_code >= 400 and r.headers["content-type"] == PROBLEM
        Problem.model_validate(r.json())


async def test_405_names_the_allowed_methods(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    cases = {
        ("PUT", "/v1/pools/p1"): {"GET", "PATCH", "DELETE"},
        ("PUT", "/v1/pools"): {"GET", "POST"},
        ("GET", "/v1/pools/p1/batches/x/commit"): {"POST"},
        ("POST", "/v1/pools/p1/runs/r1"): {"GET", "PATCH", "DELETE"},
    }
    for (method, url), allowed in cases.items():
        r = await client.request(method, url)
        assert r.status_code == 405, (method, url, r.status_code)
        assert r.headers["content-type"] == PROBLEM
        got = {m.strip() for m in r.headers["allow"].split(",")} - {"HEAD"}
        assert got == allowed, (method, url, r.headers["allow"])
        for m in got:
            assert m in r.json()["detail"]
