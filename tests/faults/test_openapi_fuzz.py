"""Schemathesis against the service's own /openapi.json, on both backends, through a real server.

Every operation of the document gets generated requests, valid ones and invalid ones; a part of
them is aimed at resources that exist (pool p1, run r1, an open batch, a leased task), so the
fuzz reaches past the 404s. Required: no 5xx, and every answer conforms to the document (its
status is declared, its content type and body match the declared schema). The budget is a few
hundred requests per backend; EXGRPO_FUZZ_CASES=N sets it (requests per backend, spread evenly
over the operations).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from service.factories import K, correct_first, make_groups
from service.harness import Backend

pytestmark = pytest.mark.faults

CASES = int(os.environ.get("EXGRPO_FUZZ_CASES", "320"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx: Any, value: Any) -> bytes:
    del ctx
    return value.encode() if isinstance(value, str) else str(value).encode()


@dataclass
class Tally:
    """What the fuzz sent and got: the numbers the operations guide quotes."""

    cases: int = 0
    operations: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    client_refused: int = 0
    failures: list[str] = field(default_factory=list)


def _world(url: str) -> dict[str, Any]:
    """Pool p1 (K=4, mixed run r1 with stored experience), an open batch with tasks and a leased
    task: the existing resources the fuzz aims at."""
    with httpx.Client(base_url=url, timeout=60) as c:

        def ok(r: httpx.Response) -> Any:
            assert r.status_code < 300, r.text
            return r.json()

        ok(c.post("/v1/pools", json={"name": "p1", "config": {"k": K, "batch_size": 8}}))
        qs = [
            {"prompt": [{"role": "user", "content": f"{i}+1?"}], "ground_truth": str(i + 1)}
            for i in range(24)
        ]
        ok(c.post("/v1/pools/p1/questions", json={"questions": qs}))
        ok(c.post("/v1/pools/p1/runs", json={"name": "r1", "phase": "mixed"}))
        first = ok(c.post("/v1/pools/p1/runs/r1/batches", json={}))
        ok(
            c.post(
                f"/v1/pools/p1/batches/{first['id']}/commit",
                json=make_groups(first, correct_first(lambda q: 2)),
            )
        )
        plan = ok(c.post("/v1/pools/p1/runs/r1/batches", json={"create_tasks": True}))
        task = ok(c.post("/v1/pools/p1/runs/r1/tasks/claim", json={"worker": "w", "max_tasks": 1}))["data"][0]
        return {"pool": "p1", "run": "r1", "batch_id": plan["id"], "task_id": task["id"]}


def _fuzz(url: str, tally: Tally) -> None:
    world = _world(url)
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    # deletes last: one that hits pool p1 or run r1 would leave the other operations nothing to reach
    operations = sorted(
        (op.ok() for op in schema.get_all_operations()),
        key=lambda op: (op.method.upper() == "DELETE", op.path),
    )
    tally.operations = len(operations)
    per_operation = max(2, CASES // len(operations))
    session = requests.Session()

    for operation in operations:
        strategy = operation.as_strategy(GenerationMode.POSITIVE) | operation.as_strategy(
            GenerationMode.NEGATIVE
        )

        @given(case=strategy, aim=st.lists(st.booleans(), min_size=4, max_size=4))
        @settings(
            max_examples=per_operation,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def one(case: Any, aim: list[bool]) -> None:
            for hit, key in zip(aim, ("pool", "run", "batch_id", "task_id"), strict=True):
                if hit and case.path_parameters and key in case.path_parameters:
                    case.path_parameters[key] = world[key]
            if isinstance(case.query, dict) and "wait" in case.query:
                case.query["wait"] = 0  # the results long poll would hold the fuzz for minutes
            try:
                response = case.call(base_url=url, session=session, timeout=30)
            except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, UnicodeError):
                tally.client_refused += 1  # the client would not send it: nothing reached the service
                return
            tally.cases += 1
            tally.statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=CHECKS)
            except BaseException as e:  # a failed check: collected, reported together at the end
                if len(tally.failures) < 40:
                    tally.failures.append(
                        f"{case.method} {case.formatted_path}: {response.status_code} {e}"[:1500]
                    )

        one()


def test_openapi_fuzz(
    backend: Backend, start_live_server: Callable[..., AbstractContextManager[Any]]
) -> None:
    tally = Tally()
    extra = (
        {"redis_url": backend.redis_url, "redis_prefix": backend.redis_prefix} if backend.uses_redis else {}
    )
    with start_live_server(backend.database_url, **extra) as server:
        _fuzz(server.url, tally)
    summary = (
        f"{backend.name}: {tally.cases} requests over {tally.operations} operations, statuses "
        f"{dict(sorted(tally.statuses.items()))}, {tally.client_refused} not sendable"
    )
    print(summary)
    assert tally.cases >= tally.operations * 2, summary
    assert not [s for s in tally.statuses if s >= 500], summary + "\n" + "\n".join(tally.failures)
    assert tally.failures == [], summary + "\n" + "\n\n".join(tally.failures)
