"""`AsyncClient` against the real app over `httpx.ASGITransport` (SQLite in tmp_path)."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from asgi_lifespan import LifespanManager
from shared_data import VALID

from exgrpo_client import (
    AsyncClient,
    BadRequest,
    Conflict,
    Forbidden,
    GroupResult,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    decode_trajectory,
    rollout,
)
from exgrpo_client import schemas as s
from exgrpo_client.io import read_questions
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings, TokenGrant

K = 4


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[Any]:
    settings = Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/pool.db", log_level="WARNING"
    )
    application = create_app(settings)
    async with LifespanManager(application) as manager:
        yield manager.app


@pytest.fixture
async def client(app: Any) -> AsyncIterator[AsyncClient]:
    async with AsyncClient("http://pool.test", transport=httpx.ASGITransport(app=app), retries=0) as c:
        yield c


def _rows(n: int) -> list[s.QuestionCreate]:
    """The first n rows of the validation set (which repeats some questions), or made-up ones."""
    if VALID.is_file():
        return [q for batch in read_questions(VALID, limit=n) for q in batch]
    return [
        s.QuestionCreate(
            prompt=[s.ChatMessage(role="user", content=f"{i % 50} + 1 = ?")], ground_truth=str(i % 50)
        )
        for i in range(n)
    ]


def _key(q: s.QuestionCreate) -> tuple[str, str]:
    return json.dumps([m.model_dump() for m in q.prompt]), q.ground_truth


def _distinct(n: int) -> list[s.QuestionCreate]:
    """n different questions, real ones where the validation set is present."""
    out: dict[tuple[str, str], s.QuestionCreate] = {}
    if VALID.is_file():
        for batch in read_questions(VALID, batch_size=500):
            for q in batch:
                out.setdefault(_key(q), q)
                if len(out) == n:
                    return list(out.values())
    return [
        s.QuestionCreate(prompt=[s.ChatMessage(role="user", content=f"{i} + 1 = ?")], ground_truth=str(i + 1))
        for i in range(n)
    ]


def _grade(question_id: int, j: int) -> float:
    """A made-up policy: question q is solved by (q mod 5) of its K rollouts."""
    return 1.0 if j < question_id % 5 else 0.0


def _fresh_group(question_id: int, k: int = K) -> GroupResult:
    rollouts = []
    for j in range(k):
        ids = np.arange(5, dtype=np.int64) + 100 * question_id + 10 * j
        rollouts.append(rollout(_grade(question_id, j), ids, np.full(5, -0.25), entropy=0.5))
    return GroupResult(question_id=question_id, rollouts=rollouts)


def _replay_group(item: s.ReplayItem) -> GroupResult:
    rows = [rollout(1.0, None, None, replayed=True)]
    rows += [_fresh_group(item.question_id).rollouts[j] for j in range(item.num_samples)]
    return GroupResult(
        question_id=item.question_id, rollouts=rows, replay_trajectory_id=item.candidates[0].id
    )


def _groups(plan: s.BatchPlan) -> list[GroupResult]:
    return [_fresh_group(f.question_id) for f in plan.fresh] + [_replay_group(r) for r in plan.replay]


async def _pool_with_run(client: AsyncClient, name: str = "p1", n: int = 64) -> None:
    await client.create_pool(name, {"k": K, "batch_size": 8, "start_threshold": 0.3})
    await client.import_questions(name, _distinct(n))
    await client.create_run(name, "r1", seed=1)


# ------------------------------------------------------------------------------------ the step
async def test_full_training_steps(client: AsyncClient) -> None:
    pool = await client.create_pool("math", {"k": K, "batch_size": 8, "start_threshold": 0.3}, "test pool")
    assert pool.config.k == K and pool.description == "test pool" and pool.num_questions == 0

    questions = _rows(400)
    calls: list[tuple[int, int | None]] = []
    imported = await client.import_questions(
        "math", questions, chunk_size=128, progress=lambda d, t: calls.append((d, t))
    )
    assert calls == [(128, 400), (256, 400), (384, 400), (400, 400)]
    distinct = len({_key(q) for q in questions})
    assert imported == s.QuestionsImported(
        received=400, inserted=distinct, duplicates=400 - distinct, num_questions=distinct
    )

    run = await client.create_run("math", "r1", seed=1)
    assert (run.step, run.phase, run.pool) == (0, "on_policy", "math")

    results = []
    for step in range(1, 5):
        plan = await client.plan_batch("math", "r1", candidates="all")
        assert plan.step == step and plan.k == K
        assert len(plan.fresh) + len(plan.replay) == 8
        assert await client.plan_batch("math", "r1") == plan  # planning again returns the open plan
        assert (await client.get_batch("math", plan.id)).id == plan.id
        for item in plan.replay:
            ids, lps = decode_trajectory(item.candidates[0])
            assert ids.dtype == np.int32 and ids.size == 5 and np.allclose(lps, -0.25)
        result = await client.commit_batch("math", plan.id, _groups(plan), metrics={"loss": 0.5})
        assert result.batch_id == plan.id and result.step == step
        results.append((plan, result))

    assert results[0][1].switched  # solved fraction 0.5 >= start threshold 0.3
    assert sum(r.stored_trajectories for _, r in results) > 0
    assert any(plan.replay for plan, _ in results[2:])

    stats = await client.run_stats("math", "r1")
    assert stats.step == 4 and stats.phase == "mixed"
    # a retirement removes the retired question's trajectories (spec 3.3)
    assert stats.trajectories == sum(r.stored_trajectories - r.removed_trajectories for _, r in results)
    assert sum(bucket.questions for bucket in stats.buckets) == stats.eligible > 0
    pool_stats = await client.pool_stats("math")
    assert pool_stats.num_questions == distinct and pool_stats.runs == [stats]

    status = await client.batch_status("math", results[-1][0].id)
    assert status.status == "committed" and status.result == results[-1][1]

    picked = await client.select("math", "r1", 3, seed=7)
    assert picked.run == "r1" and 0 < len(picked.replay) <= 3

    qid = picked.replay[0].question_id
    detail = await client.question("math", qid, payload=True)
    assert detail.id == qid and detail.trajectories
    ids, _ = decode_trajectory(detail.trajectories[0])
    assert ids.size == detail.trajectories[0].num_tokens
    assert (await client.question("math", qid)).trajectories[0].token_ids_b64 is None


async def test_commit_twice_returns_the_first_result(client: AsyncClient) -> None:
    await _pool_with_run(client)
    plan = await client.plan_batch("p1", "r1")
    first = await client.commit_batch("p1", plan.id, _groups(plan))
    assert await client.commit_batch("p1", plan.id, _groups(plan)) == first


# --------------------------------------------------------------------------------- other calls
async def test_questions_pages(client: AsyncClient) -> None:
    await client.create_pool("p1", {"k": K})
    await client.import_questions(
        "p1", [{"prompt": [{"role": "user", "content": f"q{i}"}], "ground_truth": "1"} for i in range(25)]
    )
    page = await client.list_questions("p1", limit=10)
    assert page.count == 10 and page.next_after == page.data[-1].id
    seen = [q async for q in client.iter_questions("p1", page_size=7)]
    assert [q.prompt[0].content for q in seen] == [f"q{i}" for i in range(25)]
    assert len({q.id for q in seen}) == 25


async def test_pools_and_runs_can_be_listed_and_updated(client: AsyncClient) -> None:
    await client.create_pool("p1", s.PoolConfig(k=K, batch_size=16))
    await client.create_pool("p2")
    assert [p.name for p in (await client.list_pools()).data] == ["p1", "p2"]

    updated = await client.update_pool("p1", config={"experience_ratio": 0.25}, description="d")
    assert (
        updated.config.experience_ratio == 0.25
        and updated.config.batch_size == 16
        and updated.description == "d"
    )
    with pytest.raises(Conflict, match="k and sharing cannot change"):
        await client.update_pool("p1", config={"k": 6})

    await client.create_run("p1", "r1", overrides={"batch_size": 4})
    await client.create_run("p1", "r2", phase="mixed")
    runs = await client.list_runs("p1")
    assert [r.name for r in runs.data] == ["r1", "r2"] and runs.data[0].overrides.batch_size == 4
    run = await client.update_run("p1", "r1", phase="mixed")
    assert run.phase == "mixed" and (await client.get_run("p1", "r1")).phase == "mixed"

    await client.add_policy_version("p1", "r1", 1, "file:///ckpt/1", step=10)
    await client.add_policy_version("p1", "r1", 2, "file:///ckpt/2", 20)
    versions = await client.list_policy_versions("p1", "r1")
    assert [(v.version, v.uri, v.step) for v in versions.data] == [
        (1, "file:///ckpt/1", 10),
        (2, "file:///ckpt/2", 20),
    ]


async def test_ingest_adds_groups_outside_a_plan(client: AsyncClient) -> None:
    await _pool_with_run(client, n=16)
    await client.update_run("p1", "r1", phase="mixed")
    ids = [q.id async for q in client.iter_questions("p1")][:3]
    result = await client.ingest("p1", "r1", [_fresh_group(q) for q in ids], policy_version=0)
    assert result.batch_id is None and result.collected_groups + result.ignored_groups == 3


async def test_generation_tasks(client: AsyncClient) -> None:
    await _pool_with_run(client, n=16)
    plan = await client.plan_batch("p1", "r1", create_tasks=True, batch_size=3)
    status = await client.batch_status("p1", plan.id)
    assert status.num_tasks == 3 and status.tasks_pending == 3

    claimed = await client.claim_tasks("p1", "r1", "worker-1", 2, 30)
    assert claimed.count == 2 and all(t.status == "leased" and t.lease_token for t in claimed.data)
    first, second = claimed.data
    assert first.lease_token is not None and second.lease_token is not None
    renewed = await client.renew_task("p1", first.id, first.lease_token, lease_seconds=60)
    assert renewed.lease_expires_at is not None and first.lease_expires_at is not None
    assert renewed.lease_expires_at > first.lease_expires_at

    done = await client.complete_task(
        "p1", first.id, first.lease_token, _fresh_group(first.question_id).rollouts
    )
    assert done.status == "completed"
    failed = await client.fail_task("p1", second.id, second.lease_token, "out of memory", retry=False)
    assert failed.status == "failed"
    with pytest.raises(Conflict, match="lease lost"):
        await client.renew_task("p1", second.id, second.lease_token)

    results = await client.batch_results("p1", plan.id, wait=0)
    assert not results.complete and [g.question_id for g in results.groups] == [first.question_id]
    status = await client.batch_status("p1", plan.id)
    assert (status.tasks_completed, status.tasks_failed, status.tasks_pending) == (1, 1, 1)


async def test_fleet_tasks_carry_version_and_sampling(client: AsyncClient) -> None:
    await _pool_with_run(client, n=16)
    await client.create_run("p1", "r2", seed=2)
    await client.add_policy_version("p1", "r1", 0, "file:///ckpt/r1/0")
    await client.add_policy_version("p1", "r1", 1, "file:///ckpt/r1/1")
    sampling = s.SamplingParams(temperature=0.6, top_p=0.9, max_tokens=32)
    plan = await client.plan_batch(
        "p1", "r1", create_tasks=True, batch_size=3, policy_version=1, sampling=sampling
    )
    assert plan.policy_version == 1
    with pytest.raises(Conflict, match="no published policy version 5"):
        await client.plan_batch("p1", "r2", create_tasks=True, policy_version=5)

    claimed = await client.claim_pool_tasks("p1", "fleet-1", max_tasks=3, runs=["r1", "r2"])
    assert claimed.count == 3 and {t.run for t in claimed.data} == {"r1"}
    first = claimed.data[0]
    assert first.lease_token is not None
    assert (first.policy_version, first.policy_exact, first.policy_uri) == (1, True, "file:///ckpt/r1/1")
    assert first.sampling == sampling
    rollouts = _fresh_group(first.question_id).rollouts
    with pytest.raises(Conflict, match="exactly policy version 1"):
        await client.complete_task("p1", first.id, first.lease_token, rollouts, policy_version=0)
    done = await client.complete_task("p1", first.id, first.lease_token, rollouts, policy_version=1)
    assert done.status == "completed"
    results = await client.batch_results("p1", plan.id)
    assert [(g.question_id, g.policy_version) for g in results.groups] == [(first.question_id, 1)]


async def test_ops_endpoints(client: AsyncClient) -> None:
    assert (await client.health()).ok
    ready = await client.ready()
    assert ready.ok and ready.checks == {"database": "ok", "index": "ok"}
    await _pool_with_run(client, n=8)
    assert await client.rebuild_index() == {"indexed_questions": 0}
    assert await client.rebuild_index("p1") == {"1": 0}


# ------------------------------------------------------------------------------ export / import
async def test_export_then_import_round_trip(client: AsyncClient, tmp_path: Path) -> None:
    await _pool_with_run(client, n=40)
    for _ in range(3):
        plan = await client.plan_batch("p1", "r1")
        await client.commit_batch("p1", plan.id, _groups(plan))
    await client.add_policy_version("p1", "r1", 3, "file:///ckpt/3")
    original = await client.get_pool("p1")

    seen: list[int] = []
    exported = await client.export_pool("p1", tmp_path / "p1.ndjson", progress=lambda d, _t: seen.append(d))
    data = (tmp_path / "p1.ndjson").read_bytes()
    assert exported.num_bytes == len(data) == seen[-1] and exported.path == str(tmp_path / "p1.ndjson")
    assert exported.header.pool.name == "p1"
    assert (exported.header.num_questions, exported.header.num_trajectories) == (
        original.num_questions,
        original.num_trajectories,
    )

    progress: list[tuple[int, int | None]] = []
    imported = await client.import_pool(
        tmp_path / "p1.ndjson", "p1-copy", lambda d, t: progress.append((d, t))
    )
    assert imported.pool == "p1-copy" and imported.runs == 1
    assert imported.questions == original.num_questions and imported.trajectories == original.num_trajectories
    assert progress[-1] == (len(data), len(data))
    copy = await client.get_pool("p1-copy")
    assert (copy.num_questions, copy.num_trajectories, copy.config) == (
        original.num_questions,
        original.num_trajectories,
        original.config,
    )
    assert [(v.version, v.uri) for v in (await client.list_policy_versions("p1-copy", "r1")).data] == [
        (3, "file:///ckpt/3")
    ]

    buffer = io.BytesIO()
    await client.export_pool("p1-copy", buffer)
    buffer.seek(0)
    assert (await client.import_pool(buffer, name="p1-third")).questions == original.num_questions
    with pytest.raises(Conflict, match="already exists"):
        await client.import_pool(io.BytesIO(data))


async def test_export_of_a_missing_pool_writes_nothing(client: AsyncClient, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="pool 'nope' does not exist"):
        await client.export_pool("nope", tmp_path / "x.ndjson")
    assert list(tmp_path.glob("x.ndjson*")) == []


# ---------------------------------------------------------------------------------------- errors
async def test_errors_carry_the_service_message(client: AsyncClient) -> None:
    with pytest.raises(NotFound, match="pool 'nope' does not exist") as info:
        await client.get_pool("nope")
    assert info.value.status == 404 and info.value.request_id
    await _pool_with_run(client, n=16)
    with pytest.raises(Conflict):
        await client.create_pool("p1")
    with pytest.raises(NotFound, match="run"):
        await client.plan_batch("p1", "nope")
    with pytest.raises(NotFound, match="question 999999 does not exist"):
        await client.question("p1", 999999)
    with pytest.raises(BadRequest, match="limit") as bad:
        await client.list_questions("p1", limit=5000)
    assert bad.value.status == 422 and bad.value.errors

    plan = await client.plan_batch("p1", "r1")
    short = [GroupResult(question_id=g.question_id, rollouts=g.rollouts[:2]) for g in _groups(plan)]
    with pytest.raises(BadRequest, match="send exactly K rollouts"):
        await client.commit_batch("p1", plan.id, short)
    with pytest.raises(BadRequest, match="groups do not match batch"):
        await client.commit_batch("p1", plan.id, _groups(plan)[1:])


async def test_bearer_tokens(tmp_path: Path) -> None:
    admin, reader = "admin-token-000000000001", "reader-token-00000000002"
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/pool.db",
        log_level="WARNING",
        tokens=[
            TokenGrant(token=admin, scopes=["admin"]),
            TokenGrant(token=reader, name="ci", scopes=["read"]),
        ],
    )
    async with LifespanManager(create_app(settings)) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with AsyncClient("http://pool.test", transport=transport, token=None) as anonymous:
            with pytest.raises(Unauthorized, match="needs a bearer token"):
                await anonymous.list_pools()
        async with AsyncClient(
            "http://pool.test", transport=transport, token="wrong-token-000000000"
        ) as wrong:
            with pytest.raises(Unauthorized, match="unknown bearer token"):
                await wrong.list_pools()
        async with AsyncClient("http://pool.test", transport=transport, token=reader) as read_only:
            with pytest.raises(Forbidden, match="ci may not create pool"):
                await read_only.create_pool("p1")
        async with AsyncClient("http://pool.test", transport=transport, token=admin) as full:
            assert (await full.create_pool("p1")).name == "p1"


async def test_payload_too_large(tmp_path: Path) -> None:
    settings = Settings(
        allow_anonymous=True,
        database_url=f"sqlite+aiosqlite:///{tmp_path}/pool.db",
        log_level="WARNING",
        max_request_bytes=2048,
    )
    async with LifespanManager(create_app(settings)) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with AsyncClient("http://pool.test", transport=transport, retries=0) as client:
            await client.create_pool("p1")
            big = [
                {"prompt": [{"role": "user", "content": "x" * 1000}], "ground_truth": str(i)}
                for i in range(4)
            ]
            with pytest.raises(PayloadTooLarge, match="split it into smaller requests"):
                await client.import_questions("p1", big)
            small = await client.import_questions("p1", big, chunk_size=1)
            assert small.inserted == 4
