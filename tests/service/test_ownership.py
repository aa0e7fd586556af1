"""Run ownership: one writer lease per run (holder + generation), fencing of every run write,
expiry, release and explicit take-over."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from .factories import commit_batch, correct_first, group, make_groups, ok, setup_pool

LEASE = "/v1/pools/p1/runs/r1/lease"


async def _acquire(
    client: httpx.AsyncClient, holder: str, *, ttl_s: float = 60.0, takeover: bool = False, run: str = "r1"
) -> httpx.Response:
    body = {"holder": holder, "ttl_s": ttl_s, "takeover": takeover}
    return await client.put(f"/v1/pools/p1/runs/{run}/lease", json=body)


def _header(lease: dict[str, Any]) -> dict[str, str]:
    return {"X-Run-Lease": f"{lease['holder']}:{lease['generation']}"}


async def _plan(client: httpx.AsyncClient, headers: dict[str, str] | None = None) -> httpx.Response:
    return await client.post("/v1/pools/p1/runs/r1/batches", json={}, headers=headers or {})


async def test_two_holders_then_takeover_fences_the_old_holder(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    a = ok(await _acquire(client, "trainer-a"))
    assert (a["run"], a["holder"], a["generation"]) == ("r1", "trainer-a", 1)

    # the same holder renews: same generation, later expiry
    await asyncio.sleep(0.01)
    renewed = ok(await _acquire(client, "trainer-a"))
    assert renewed["generation"] == 1 and renewed["expires_at"] > a["expires_at"]

    # a second holder is refused while the lease is live, and told who holds it and how to take over
    refused = await _acquire(client, "trainer-b")
    assert refused.status_code == 409
    assert refused.headers["content-type"].startswith("application/problem+json")
    detail = refused.json()["detail"]
    assert "trainer-a" in detail and "generation 1" in detail and "takeover" in detail

    # the holder plans; a plan without the header or from someone else is fenced out
    plan = ok(await _plan(client, _header(a)), 201)
    no_header = await _plan(client)
    assert no_header.status_code == 409 and "trainer-a" in no_header.json()["detail"]
    forged = await _plan(client, {"X-Run-Lease": "trainer-b:1"})
    assert forged.status_code == 409

    # take-over: a new generation; the old holder's commit of its plan is refused, nothing changes
    b = ok(await _acquire(client, "trainer-b", takeover=True))
    assert (b["holder"], b["generation"]) == ("trainer-b", 2)
    body = make_groups(plan, correct_first(lambda q: q % 3))
    stale = await commit_batch(client, plan, body, **_header(a))
    assert stale.status_code == 409
    assert "trainer-b" in stale.json()["detail"] and "generation 2" in stale.json()["detail"]
    assert ok(await client.get("/v1/pools/p1/runs/r1"))["step"] == 0
    stale_plan = await _plan(client, _header(a))
    assert stale_plan.status_code == 409

    # the new holder goes on with the open batch
    again = ok(await _plan(client, _header(b)), 201)
    assert again["id"] == plan["id"]
    done = ok(await commit_batch(client, plan, body, **_header(b)))
    assert done["step"] == 1


async def test_every_run_write_is_fenced(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    lease = ok(await _acquire(client, "owner"))
    other = {"X-Run-Lease": f"owner:{lease['generation'] + 7}"}
    qid = ok(await client.get("/v1/pools/p1/questions", params={"limit": 1}))["data"][0]["id"]
    writes = [
        ("POST", "/v1/pools/p1/runs/r1/policy-versions", {"version": 1, "uri": "file:///w/1"}),
        ("POST", "/v1/pools/p1/runs/r1/metrics", {"step": 1, "metrics": {"loss": 1.0}}),
        ("PATCH", "/v1/pools/p1/runs/r1", {"overrides": {"batch_size": 4}}),
        ("POST", "/v1/pools/p1/runs/r1/ingest", {"groups": [group(qid, [1, 0, 0, 0])]}),
    ]
    for method, path, body in writes:
        for headers in ({}, other):
            r = await client.request(method, path, json=body, headers=headers)
            assert r.status_code == 409, (method, path, headers, r.text)
            assert "owner" in r.json()["detail"]
    # the holder's writes go through
    for method, path, body in writes:
        status = 201 if "policy" in path else 200
        ok(await client.request(method, path, json=body, headers=_header(lease)), status)
    # reads are not fenced
    ok(await client.get("/v1/pools/p1/runs/r1/stats"))


async def test_lease_expires_and_a_new_holder_resumes(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    a = ok(await _acquire(client, "a", ttl_s=1))
    await asyncio.sleep(1.2)
    # expired: anyone may take it (resume) with the next generation; the old generation is stale
    b = ok(await _acquire(client, "b"))
    assert b["generation"] == a["generation"] + 1
    stale = await _plan(client, _header(a))
    assert stale.status_code == 409 and "generation 2" in stale.json()["detail"]
    ok(await _plan(client, _header(b)), 201)


async def test_release_and_header_rules(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    # no lease ever: writes without the header keep working (older clients)
    ok(await _plan(client), 201)
    # a header naming a lease the run never had is refused
    assert (await _plan(client, {"X-Run-Lease": "ghost:1"})).status_code == 409
    # malformed headers are a 422
    for bad in ("no-generation", "x:", "x:-1", "x:abc", ":3"):
        r = await _plan(client, {"X-Run-Lease": bad})
        assert r.status_code == 422, bad
        assert "X-Run-Lease" in r.json()["detail"]

    a = ok(await _acquire(client, "a"))
    # only the holder may release
    wrong = await client.delete(LEASE, params={"holder": "b"})
    assert wrong.status_code == 409 and "'a'" in wrong.json()["detail"]
    assert (await client.delete(LEASE, params={"holder": "a"})).status_code == 204
    # released: writes without the header are accepted again, the holder's own header as well
    ok(await _plan(client), 201)
    ok(await _plan(client, _header(a)), 201)
    b = ok(await _acquire(client, "b"))
    assert b["generation"] == 2
    assert (await client.delete(LEASE, params={"holder": "b"})).status_code == 204
    # after b's generation, a's header is stale even though nobody holds the run now
    stale = await _plan(client, _header(a))
    assert stale.status_code == 409

    # bad lease requests
    for body in ({"holder": "", "ttl_s": 10}, {"holder": "x", "ttl_s": 0.5}, {"holder": "x", "ttl_s": 4000}):
        assert (await client.put(LEASE, json=body)).status_code == 422
    assert (await client.put("/v1/pools/p1/runs/nope/lease", json={"holder": "x"})).status_code == 404


async def test_renewal_of_a_generation_names_who_took_the_run_since(client: httpx.AsyncClient) -> None:
    await setup_pool(client)

    def renew(holder: str, generation: int) -> Any:
        body = {"holder": holder, "ttl_s": 60.0, "generation": generation}
        return client.put(LEASE, json=body)

    a = ok(await _acquire(client, "trainer-a"))
    again = ok(await renew("trainer-a", a["generation"]))  # its own generation: renewed
    assert again["generation"] == a["generation"] and again["holder"] == "trainer-a"

    b = ok(await _acquire(client, "trainer-b", takeover=True))
    released = await client.delete(LEASE, params={"holder": "trainer-b"})  # taken over, then given back
    assert released.status_code == 204
    refused = await renew("trainer-a", a["generation"])
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "trainer-b" in detail and f"generation {b['generation']}" in detail
    # a plain acquire would have taken the free run: renewal-only leaves it free
    assert ok(await _acquire(client, "trainer-c"))["generation"] == b["generation"] + 1
    never = await client.put("/v1/pools/p1/runs/r2/lease", json={"holder": "x", "generation": 1})
    assert never.status_code in (404, 409)
