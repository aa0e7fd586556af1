"""A selection draws from the bucket sizes its replica read last (`KnownSizes`): a write that lands
while a selection waits on the index neither breaks the selection nor is forgotten, and the answer
is always the one drawn from sizes read afresh. On both backends (the in-process index and Redis)."""

from __future__ import annotations

from typing import Any

from exgrpo_pool.service.context import KnownSizes

from .factories import commit_batch, correct_first, make_groups, ok, plan_batch, setup_pool
from .harness import Backend, serve_app


async def test_a_write_landing_while_a_selection_waits_on_the_index_stands(backend: Backend) -> None:
    async with serve_app(backend.settings()) as (app, client):
        ctx = app.state.ctx
        await setup_pool(client, questions=64, phase="mixed")
        for _ in range(3):
            plan = await plan_batch(client)
            ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        scope = ok(await client.get("/v1/pools/p1/runs/r1"))["id"]
        first = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 1}))
        known = ctx.known_sizes[scope]
        assert known.sizes and sum(known.sizes.values()) == first["num_eligible"]

        # a write's index update lands while the next selection waits on the index (as another
        # request's `_follow` would, between the selection's await and its answer)
        index: Any = ctx.index
        plain = index.pick_sized

        async def pick_sized(*args: Any, **kwargs: Any) -> Any:
            answer = await plain(*args, **kwargs)
            ctx.known_sizes[scope] = KnownSizes(None, True)
            return answer

        index.pick_sized = pick_sized
        try:
            during = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2}))
        finally:
            index.pick_sized = plain
        assert during["replay"] and during["num_eligible"] == first["num_eligible"]
        assert ctx.known_sizes[scope].sizes is None  # the write's word stands: nothing kept over it

        ctx.known_sizes.clear()  # what a replica that knows no sizes answers
        assert ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 8, "seed": 2})) == during
