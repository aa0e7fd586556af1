"""The Redis index never walks the Redis database on a request: plan, commit and select cost the
same whatever else the db holds. Measured by the commands the service sends (no SCAN or KEYS),
with 100k unrelated keys in the db; the idempotency records live in the database, not in Redis."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from asgi_lifespan import LifespanManager

from exgrpo_pool.app import create_app
from exgrpo_pool.index.redis import RedisIndex
from exgrpo_pool.service.context import Context

from .factories import commit_batch, correct_first, make_groups, ok, plan_batch, setup_pool
from .harness import ADMIN_TOKEN, Backend, bearer

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

UNRELATED = 100_000


@contextlib.asynccontextmanager
async def _serve(backend: Backend) -> AsyncIterator[tuple[httpx.AsyncClient, Context]]:
    app = create_app(backend.settings())
    async with (
        LifespanManager(app, startup_timeout=30, shutdown_timeout=30),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://pool.test",
            headers=bearer(ADMIN_TOKEN),
            timeout=60,
        ) as client,
    ):
        yield client, app.state.ctx


@dataclass
class _Recording:
    #: the name of every command sent, pipelines included
    commands: list[str] = field(default_factory=list)
    #: one entry per trip to Redis: a command's name, or the names a pipeline sent in one go
    trips: list[str] = field(default_factory=list)
    #: the arguments of every command sent alone (not in a pipeline), its name first
    sent: list[tuple[Any, ...]] = field(default_factory=list)


def _record(ctx: Context) -> _Recording:
    """What the index's Redis client sends from now on."""
    rec = _Recording()
    client: Any = ctx.index._r  # type: ignore[attr-defined]
    plain = client.execute_command

    async def execute_command(*args: Any, **kwargs: Any) -> Any:
        rec.commands.append(str(args[0]).upper())
        rec.trips.append(rec.commands[-1])
        rec.sent.append(args)
        return await plain(*args, **kwargs)

    make_pipeline = client.pipeline

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = make_pipeline(*args, **kwargs)
        queue = pipe.execute_command
        run = pipe.execute

        def queued(*a: Any, **kw: Any) -> Any:
            rec.commands.append(str(a[0]).upper())
            return queue(*a, **kw)

        async def execute(*a: Any, **kw: Any) -> Any:
            if pipe.command_stack:  # an empty pipeline sends nothing
                rec.trips.append("+".join(sorted({str(c[0][0]).upper() for c in pipe.command_stack})))
            return await run(*a, **kw)

        pipe.execute_command = queued
        pipe.execute = execute
        return pipe

    client.execute_command = execute_command
    client.pipeline = pipeline
    return rec


@pytest.mark.parametrize("backend", ["postgres-redis"], indirect=True)
async def test_plan_commit_select_send_no_scan_with_100k_unrelated_keys(
    backend: Backend, redis_client: redis.Redis
) -> None:
    pipe = redis_client.pipeline(transaction=False)
    for i in range(0, UNRELATED, 10_000):
        pipe.mset({f"{backend.redis_prefix}:unrelated:{j}": "x" for j in range(i, i + 10_000)})
    pipe.execute()
    async with _serve(backend) as (client, ctx):
        await setup_pool(client, questions=64, runs=("r1", "r2"), phase="mixed")
        sent = _record(ctx).commands
        for step in range(3):
            plan = await plan_batch(client)
            body = make_groups(plan, correct_first(lambda q: 2))
            ok(await commit_batch(client, plan, body, **{"Idempotency-Key": f"step-{step}"}))
        ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 1}))
        # a scope whose index was dropped (a stale pick, Redis missed a change) and a scope with
        # no eligible question at all are rebuilt on their next use: still no walk of the db
        run = ok(await client.get("/v1/pools/p1/runs/r1"))
        await ctx.index.drop(run["id"])
        ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2}))
        await plan_batch(client, run="r2")
        ok(await client.post("/v1/pools/p1/runs/r2/select", json={"n": 8, "seed": 3}))

    assert "EVALSHA" in sent and "ZCARD" in sent, sent  # the recording saw the index's traffic
    assert not {"SCAN", "KEYS"} & set(sent), sorted(set(sent))
    # idempotency records are kept in the database: Redis holds the index and nothing else
    ours = {
        k.decode()
        for k in redis_client.scan_iter(match=f"{backend.redis_prefix}:*", count=10_000)
        if b":unrelated:" not in k
    }
    assert ours and all(k.startswith(f"{backend.redis_prefix}:idx:") for k in ours), sorted(ours)[:20]


@pytest.mark.parametrize("backend", ["postgres-redis"], indirect=True)
async def test_a_plan_takes_two_redis_round_trips_and_a_select_of_a_known_scope_one(backend: Backend) -> None:
    """A plan: whether the scope is loaded and its buckets' sizes in one trip, the picks in a second.
    A selection of a scope whose sizes this replica read last (the plan's): sizes checked and
    questions picked in one trip. An empty scope the same; a dropped one is rebuilt, then known."""
    async with _serve(backend) as (client, ctx):
        await setup_pool(client, questions=64, runs=("r1", "r2"), phase="mixed")
        for _ in range(3):
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 1}))
        await plan_batch(client, run="r2")  # loads r2's scope: nothing eligible in it

        trips = _record(ctx).trips
        plan = await plan_batch(client)
        assert plan["replay"] and len(trips) == 2, trips
        del trips[:]
        sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2}))
        assert sel["replay"] and len(trips) == 1, trips
        del trips[:]
        sel = ok(await client.post("/v1/pools/p1/runs/r2/select", json={"n": 8, "seed": 3}))
        assert sel["num_eligible"] == 0 and len(trips) == 1, trips  # loaded, empty: nothing to pick
        del trips[:]
        run = ok(await client.get("/v1/pools/p1/runs/r1"))
        await ctx.index.drop(run["id"])
        del trips[:]
        sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2}))
        assert sel["replay"] and sel["num_eligible"] == plan["num_eligible"], sel
        assert len(trips) > 2, trips  # rebuilt
        del trips[:]
        sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2}))
        assert sel["replay"] and len(trips) == 1, trips


@pytest.mark.parametrize("backend", ["postgres-redis"], indirect=True)
async def test_a_select_of_a_scope_unchanged_since_it_was_sized_takes_one_redis_round_trip(
    backend: Backend,
) -> None:
    """A replica keeps the bucket sizes it last read per scope and draws from them: the pick's
    script checks them against the scope (and that it is loaded) and picks in the same trip. Its
    own write drops them; another replica's write is found in that trip (sizes come back instead of
    picks, the draws are made again from them), and the scope's selections read the sizes first
    until they are found unchanged. The answer is the one drawn from sizes read afresh, always."""
    async with _serve(backend) as (client, ctx):
        await setup_pool(client, questions=64, phase="mixed")
        for _ in range(3):
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        rec = _record(ctx)
        trips = rec.trips
        ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 1}))
        del trips[:]
        again = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2}))
        assert again["replay"] and len(trips) == 1, trips
        ctx.known_sizes.clear()  # what a replica that never sized the scope answers
        assert ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2})) == again

        # this replica's own commit moves questions between buckets: the sizes it knew are dropped,
        # so the next selection's first trip reads the sizes only (nothing drawn in vain)
        plan = await plan_batch(client)
        ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        del trips[:], rec.sent[:]
        changed = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 3}))
        assert len(trips) == 2 and rec.sent[0][-2:] == ("", ""), rec.sent
        ctx.known_sizes.clear()
        assert ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 3})) == changed
        del trips[:]
        ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 4}))
        assert len(trips) == 1, trips

        # another replica's commit: the sizes known here are found out of date in the same trip as
        # the picks; they come back, and the questions are drawn again from them and picked
        async with _serve(backend) as (other, _):
            plan = await plan_batch(other)
            ok(await commit_batch(other, plan, make_groups(plan, correct_first(lambda q: 2))))
        del trips[:], rec.sent[:]
        moved = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 5}))
        assert len(trips) == 2 and rec.sent[0][-1] != "", rec.sent  # ranks sent: drawn from known sizes
        ctx.known_sizes.clear()
        assert ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 5})) == moved
        # a draw made in vain: until its sizes are found unchanged, the scope's selections read them
        # first (nothing drawn before), however often the other replica writes; then quiet again
        async with _serve(backend) as (other, _):
            for seed in (6, 7, 8):
                plan = await plan_batch(other)
                ok(await commit_batch(other, plan, make_groups(plan, correct_first(lambda q: 2))))
                del trips[:], rec.sent[:]
                ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": seed}))
                in_vain = rec.sent[0][-1] != ""  # ranks sent with the check
                assert len(trips) == 2 and in_vain == (seed == 6), rec.sent
        for expected in (2, 1):  # sizes first, found unchanged: quiet again, one trip
            del trips[:], rec.sent[:]
            ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 9}))
            assert len(trips) == expected and (expected == 1 or rec.sent[0][-1] == ""), rec.sent


@pytest.mark.parametrize("backend", ["postgres-redis"], indirect=True)
async def test_a_pick_sends_its_ranks_as_one_argument(backend: Backend) -> None:
    """The ranks a plan or a selection picks go to Redis packed in one argument of the pick's
    script, not two per question (the client encodes each argument in Python): the same few
    arguments for 2 questions as for 12, and the picks are those asked for."""
    async with _serve(backend) as (client, ctx):
        await setup_pool(client, questions=128, phase="mixed")
        for _ in range(3):
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 1, "seed": 4}))  # sizes known
        sizes: list[int] = []
        for n in (2, 12):
            rec = _record(ctx)
            sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": n, "seed": 5}))
            picked = [r["question_id"] for r in sel["replay"]]
            assert len(set(picked)) == n <= sel["num_eligible"], sel["num_eligible"]
            assert rec.sent and {str(c[0]).upper() for c in rec.sent} == {"EVALSHA"}, rec.sent
            sizes.append(len(rec.sent[-1]))
        # the script's sha, its keys (the loaded marker, the bucket set), the bucket key prefix, the
        # sizes drawn from and the ranks
        assert sizes[0] == sizes[1] <= 8, sizes


@pytest.mark.parametrize("backend", ["postgres-redis"], indirect=True)
async def test_the_index_reads_redis_replies_with_hiredis(backend: Backend) -> None:
    """The service's Redis connections parse replies with hiredis (a dependency of the server),
    and the index answers through them."""
    async with _serve(backend) as (client, ctx):
        await setup_pool(client, questions=64, phase="mixed")
        for _ in range(2):
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        assert ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 1}))["replay"]
        pool: Any = ctx.index._r.connection_pool  # type: ignore[attr-defined]
        used = [*pool._available_connections, *pool._in_use_connections]
        assert used, "the selection used a connection"
        assert all("Hiredis" in type(c._parser).__name__ for c in used), [type(c._parser) for c in used]


@pytest.mark.parametrize("backend", ["postgres-redis"], indirect=True)
async def test_prepare_drops_bucket_keys_of_the_layout_without_a_bucket_set_once(
    backend: Backend, redis_client: redis.Redis
) -> None:
    p = backend.redis_prefix
    # scope 7 in the old layout (bucket keys, no `bk` set), scope 8 in today's, one staged key
    redis_client.zadd(f"{p}:idx:7:b:2", {"5": 5, "6": 6})
    redis_client.set(f"{p}:idx:7:loaded", "1")
    redis_client.zadd(f"{p}:idx:-3:b:1", {"9": 9})
    index = RedisIndex(aioredis.from_url(backend.redis_url or ""), p)
    try:
        assert await index.replace(8, {1: [1, 2]})
        redis_client.zadd(f"{p}:idx:8:stage:abc:b:1", {"3": 3})
        await index.prepare()
        assert not redis_client.exists(f"{p}:idx:7:b:2", f"{p}:idx:-3:b:1")
        assert not await index.is_loaded(7) and await index.sizes(7) == {}
        assert await index.is_loaded(8) and await index.sizes(8) == {1: 2}
        assert redis_client.exists(f"{p}:idx:8:stage:abc:b:1")
        assert redis_client.get(f"{p}:idx:format") == b"2"
        # the marker makes later start-ups skip the walk: old-layout keys written now stay
        redis_client.zadd(f"{p}:idx:7:b:2", {"5": 5})
        await index.prepare()
        assert redis_client.exists(f"{p}:idx:7:b:2")
    finally:
        await index.close()
