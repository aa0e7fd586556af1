"""Records the service stores or reads back: batch plans of older databases and import lines
validated against the export record models."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from exgrpo_pool.store.models import Batch

from .factories import commit_batch, make_groups, ok, plan_batch, run_stats, setup_pool
from .harness import Backend, serve


async def _swap_plan(url: str, batch_id: str, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Replace batch `batch_id`'s stored plan by `change(plan)`, behind the service's back."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            plan = (await conn.execute(sa.select(Batch.plan).where(Batch.id == batch_id))).scalar_one()
            new = change(dict(plan))
            await conn.execute(sa.update(Batch).where(Batch.id == batch_id).values(plan=new))
    finally:
        await engine.dispose()


def _short_keys(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as an older service wrote it: replay picks as {"q", "b", "p", "c"}."""
    picks = plan["replay"]
    assert picks and set(picks[0]) == {"question_id", "bucket", "probability", "candidates"}
    short = [
        {"q": p["question_id"], "b": p["bucket"], "p": p["probability"], "c": p["candidates"]} for p in picks
    ]
    return {**plan, "replay": short}


async def test_a_plan_stored_with_the_old_short_keys_still_reads_and_commits(backend: Backend) -> None:
    async with serve(backend.settings()) as client:
        await setup_pool(client, phase="mixed", questions=16)
        first = await plan_batch(client)
        ok(await commit_batch(client, first, make_groups(first, lambda q, row: float(row < 2))))
        plan = await plan_batch(client)
        assert plan["replay"], "the second step replays"

    await _swap_plan(backend.database_url, plan["id"], _short_keys)

    async with serve(backend.settings()) as client:
        assert ok(await client.get(f"/v1/pools/p1/batches/{plan['id']}")) == plan
        # a commit is checked against the old plan: a group missing is refused, the full set taken
        groups = make_groups(plan, lambda q, row: float(row < 1))
        short = {"groups": groups["groups"][:-1]}
        assert (await commit_batch(client, plan, short)).status_code == 422
        result = ok(await commit_batch(client, plan, groups))
        assert result["step"] == 2 and result["batch_id"] == plan["id"]
        stats = await run_stats(client)
        assert stats["step"] == 2 and stats["replayed_last_step"] == len(plan["replay"])


def _export_lines(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(x) for x in raw.splitlines()]


async def test_import_refuses_bad_records_and_writes_nothing(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed", questions=16)
    plan = await plan_batch(client)
    ok(await commit_batch(client, plan, make_groups(plan, lambda q, row: float(row < 2))))
    lines = _export_lines((await client.get("/v1/pools/p1/export")).content)
    before = ok(await client.get("/v1/pools"))
    at = {kind: next(i for i, x in enumerate(lines) if x["type"] == kind) for kind in ("run", "state")}
    at["trajectory"] = next(i for i, x in enumerate(lines) if x["type"] == "trajectory")
    at["question"] = next(i for i, x in enumerate(lines) if x["type"] == "question")

    def edited(kind: str, **change: Any) -> list[dict[str, Any]]:
        out = [dict(x) for x in lines]
        out[at[kind]] = {k: v for k, v in {**out[at[kind]], **change}.items() if v is not ...}
        return out

    cases: dict[str, tuple[list[dict[str, Any]], str]] = {
        "a seed as a string": (edited("run", seed="3"), "seed"),
        "a retired flag as 0": (edited("state", retired=0), "retired"),
        "an unknown field": (edited("trajectory", colour="red"), "colour"),
        "a reward missing": (edited("trajectory", reward=...), "reward"),
        "a negative step": (edited("run", step=-1), "step"),
        "a state of an unknown question": (edited("state", question=10**9), "no earlier question record"),
        "a state of an unknown run": (edited("state", scope=10**9), "no earlier run record"),
        "ids and log-probs of different lengths": (
            edited("trajectory", logprobs_b64=""),
            "token ids but 0 log-probs",
        ),
        "a second header": ([*lines, lines[0]], "one export header"),
        "a record before the header": ([lines[at["question"]], *lines], "first line"),
    }
    for name, (records, message) in cases.items():
        body = b"\n".join(json.dumps(x).encode() for x in records)
        r = await client.post("/v1/pools/import", params={"name": "copy"}, content=body)
        assert r.status_code == 422, (name, r.status_code, r.text[:300])
        detail = r.json()["detail"]
        assert detail.startswith("import line ") and message in detail, (name, detail)
        assert (await client.get("/v1/pools/copy")).status_code == 404, name
        assert ok(await client.get("/v1/pools")) == before, name

    # the unedited export imports
    body = b"\n".join(json.dumps(x).encode() for x in lines)
    imported = ok(await client.post("/v1/pools/import", params={"name": "copy"}, content=body), 201)
    assert imported["pool"] == "copy" and imported["questions"] == 16
