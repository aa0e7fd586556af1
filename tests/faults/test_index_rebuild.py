"""Rebuilds of the sampling index under concurrency: parallel rebuilds of one scope, and plans of
several runs of a pooled pool that rebuild their shared scope at the same time."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from service.factories import (
    B,
    commit_batch,
    correct_first,
    make_groups,
    ok,
    plan_batch,
    run_stats,
    setup_pool,
)
from service.harness import Backend, serve

from exgrpo_pool.index.memory import MemoryIndex
from exgrpo_pool.index.redis import RedisIndex

pytestmark = pytest.mark.faults


async def _fill(client: httpx.AsyncClient, runs: tuple[str, ...], steps: int) -> None:
    """Commit `steps` batches per run with two of K rollouts correct: every question collected."""
    for _ in range(steps):
        for run in runs:
            plan = await plan_batch(client, run=run)
            ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))


def _eligible(stats: dict[str, Any]) -> int:
    return sum(b["questions"] for b in stats["buckets"])


async def test_concurrent_rebuilds_of_one_scope_all_succeed_and_keep_the_index(
    client: httpx.AsyncClient,
) -> None:
    await setup_pool(client, questions=64, phase="mixed")
    await _fill(client, ("r1",), steps=3)
    eligible = (await run_stats(client))["eligible"]
    assert eligible >= B

    answers = await asyncio.gather(*(client.post("/v1/pools/p1/index/rebuild") for _ in range(16)))
    assert [r.status_code for r in answers] == [200] * 16, [r.text for r in answers if r.status_code != 200]
    assert {r.text for r in answers} == {answers[0].text}

    # the index holds every eligible question: a plan sees them all and replays
    plan = await plan_batch(client)
    assert plan["num_eligible"] == eligible
    assert len(plan["replay"]) == B // 2
    sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 1000, "seed": 1}))
    assert sel["num_eligible"] == eligible


async def test_rebuilds_racing_plans_and_selections_answer_no_5xx(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=64, phase="mixed", runs=("r1", "r2"))
    await _fill(client, ("r1", "r2"), steps=2)
    calls = []
    for i in range(24):
        if i % 3 == 0:
            calls.append(client.post("/v1/pools/p1/index/rebuild"))
        elif i % 3 == 1:
            calls.append(client.post(f"/v1/pools/p1/runs/r{1 + i % 2}/select", json={"n": 4, "seed": i}))
        else:
            calls.append(client.post(f"/v1/pools/p1/runs/r{1 + i % 2}/batches", json={"replan": True}))
    answers = await asyncio.gather(*calls)
    assert not [r for r in answers if r.status_code >= 500], [r.text for r in answers if r.status_code >= 500]
    for run in ("r1", "r2"):
        stats = await run_stats(client, run=run)
        plan = await plan_batch(client, run=run, replan=True)
        assert plan["num_eligible"] == stats["eligible"] == _eligible(stats) >= B


async def test_pooled_runs_planning_at_once_after_their_scope_is_dropped(
    backend: Backend, redis_direct: Any
) -> None:
    """Stale picks make every plan of a pooled pool drop the shared scope, so the next plans rebuild
    it concurrently; forced here by deleting the index under them."""
    runs = tuple(f"r{i}" for i in range(8))
    async with serve(backend.settings()) as client:
        await setup_pool(client, questions=96, phase="mixed", runs=runs, sharing="pooled")
        await _fill(client, runs[:2], steps=2)
        eligible = (await run_stats(client, run="r0"))["eligible"]
        assert eligible > 0
        for round_ in range(3):
            if redis_direct is not None:
                for key in redis_direct.scan_iter(match=f"{backend.redis_prefix}:idx:*"):
                    redis_direct.delete(key)
            answers = await asyncio.gather(
                *(client.post(f"/v1/pools/p1/runs/{r}/batches", json={"replan": True}) for r in runs)
            )
            bad = [r.text for r in answers if r.status_code != 201]
            assert not bad, f"round {round_}: {bad}"
            assert {r.json()["num_eligible"] for r in answers} == {eligible}
            assert all(len(r.json()["replay"]) == min(eligible, B // 2) for r in answers)


# ------------------------------------------------------------------------ the index itself
@pytest.fixture
async def index(backend: Backend) -> Any:
    if not backend.uses_redis:
        yield MemoryIndex()
        return
    import redis.asyncio as aioredis

    assert backend.redis_url is not None
    idx = RedisIndex(aioredis.from_url(backend.redis_url), backend.redis_prefix)
    yield idx
    await idx.close()


async def _contents(index: Any, scope: int) -> dict[int, list[int]]:
    sizes = await index.sizes(scope)
    picked = await index.pick(scope, {b: list(range(n)) for b, n in sizes.items()})
    return {b: ids for b, ids in sorted(picked.items())}


async def test_concurrent_replaces_install_one_whole_snapshot(index: Any) -> None:
    snapshots = [{1 + i % 3: list(range(i, i + 5 + i)), 3 - i % 3: [100 + i]} for i in range(20)]
    loaded = await asyncio.gather(*(index.replace(7, snap) for snap in snapshots))
    assert all(loaded) and await index.is_loaded(7)
    got = await _contents(index, 7)
    assert any(got == {b: sorted(ids) for b, ids in sorted(s.items())} for s in snapshots), got


async def test_a_change_during_a_rebuild_leaves_the_scope_unloaded(index: Any) -> None:
    await index.replace(3, {1: [10, 11], 2: [12]})
    generation = await index.generation(3)
    snapshot = {1: [10, 11], 2: [12]}  # read from the database before the change below
    await index.apply(3, [(13, 2), (10, None)])
    assert await index.replace(3, snapshot, generation=generation) is False
    assert not await index.is_loaded(3)
    # a rebuild that starts after the change is loaded
    generation = await index.generation(3)
    assert await index.replace(3, {1: [11], 2: [12, 13]}, generation=generation) is True
    assert await index.is_loaded(3) and await _contents(index, 3) == {1: [11], 2: [12, 13]}
    # dropping counts as a change, and empties the scope
    generation = await index.generation(3)
    await index.drop(3)
    assert not await index.is_loaded(3) and await index.sizes(3) == {}
    assert await index.generation(3) > generation
    assert await index.replace(3, {}, generation=generation) is False


async def test_loaded_sizes_answers_loaded_and_sizes_together(index: Any) -> None:
    assert await index.loaded_sizes(4) is None  # never built
    assert await index.replace(4, {}) and await index.loaded_sizes(4) == {}  # loaded, nothing eligible
    assert await index.replace(4, {1: [10, 11], 2: [12], 3: []})
    assert await index.loaded_sizes(4) == {1: 2, 2: 1} == await index.sizes(4)
    await index.apply(4, [(12, None), (13, 1)])  # bucket 2 emptied, bucket 1 grown
    assert await index.loaded_sizes(4) == {1: 3} == await index.sizes(4)
    # ranks past a bucket's end (it shrank since it was sized) pick nothing
    assert await index.pick(4, {1: [2, 0, 3], 2: [0], 5: []}) == {1: [13, 10], 2: [], 5: []}
    await index.drop(4)
    assert await index.loaded_sizes(4) is None
    # changed while being rebuilt: installed, but not loaded
    generation = await index.generation(4)
    await index.apply(4, [(10, 1)])
    assert await index.replace(4, {1: [10, 11]}, generation=generation) is False
    assert await index.loaded_sizes(4) is None and await index.sizes(4) == {1: 2}


async def test_a_pick_against_known_sizes_answers_the_picks_or_the_sizes_now(index: Any) -> None:
    """`pick_sized` picks only when the scope is loaded with exactly the sizes the caller drew from
    (every non-empty bucket, no other); otherwise it answers the sizes as they are (None: not
    loaded), read together with the loaded marker."""
    assert await index.pick_sized(5, {}, {}) == (None, None)  # never built
    assert await index.replace(5, {1: [10, 11], 2: [12]})
    assert await index.pick_sized(5, {1: 2, 2: 1}, {1: [1], 2: [0]}) == ({1: [11], 2: [12]}, {1: 2, 2: 1})
    assert await index.pick_sized(5, {1: 2, 2: 1}, {}) == ({}, {1: 2, 2: 1})
    # a bucket the caller does not know of, one it knows that is not there, a size off by one
    assert await index.pick_sized(5, {1: 2}, {1: [0]}) == (None, {1: 2, 2: 1})
    assert await index.pick_sized(5, {1: 2, 2: 1, 3: 4}, {1: [0]}) == (None, {1: 2, 2: 1})
    await index.apply(5, [(13, 1)])
    assert await index.pick_sized(5, {1: 2, 2: 1}, {1: [0]}) == (None, {1: 3, 2: 1})
    assert await index.pick_sized(5, {1: 3, 2: 1}, {1: [2, 0]}) == ({1: [13, 10]}, {1: 3, 2: 1})
    await index.apply(5, [(12, None)])  # bucket 2 emptied
    assert await index.pick_sized(5, {1: 3, 2: 1}, {2: [0]}) == (None, {1: 3})
    assert await index.pick_sized(5, {1: 3}, {1: [1]}) == ({1: [11]}, {1: 3})
    assert await index.replace(6, {}) and await index.pick_sized(6, {}, {}) == ({}, {})  # loaded, empty
    assert await index.pick_sized(6, {1: 1}, {1: [0]}) == (None, {})
    await index.drop(5)
    assert await index.pick_sized(5, {1: 3}, {1: [0]}) == (None, None)


async def test_many_moves_in_one_apply_leave_each_question_in_its_last_bucket(index: Any) -> None:
    """More moves than one script call takes (Redis applies them 1,000 at a time), a question moved
    more than once in one write, and removals: each question ends where its last move put it."""
    assert await index.replace(6, {1: list(range(0, 300)), 2: list(range(300, 600))})
    generation = await index.generation(6)
    moves: list[tuple[int, int | None]] = []
    expected: dict[int, int | None] = {q: 1 if q < 300 else 2 for q in range(600)}
    for q in range(2_500):
        bucket = None if q % 7 == 0 else 1 + q % 5
        moves.append((q, bucket))
        expected[q] = bucket
    for q in range(0, 2_500, 3):  # moved again later in the same write
        moves.append((q, 4))
        expected[q] = 4
    await index.apply(6, moves)
    want: dict[int, list[int]] = {}
    for q, b in sorted(expected.items()):
        if b is not None:
            want.setdefault(b, []).append(q)
    assert await _contents(index, 6) == want
    assert await index.sizes(6) == {b: len(ids) for b, ids in want.items()}
    assert await index.generation(6) > generation
