"""The concurrency mix: about fifty clients at once against real `exgrpo serve` processes (one, two
replicas sharing Postgres and Redis, or one `exgrpo serve --workers 2` on a SQLite file with Redis,
whose processes take turns at the file on their event loops) for a bounded time: trainers
planning and committing on runs of a per_run pool and of a pooled pool (whose concurrent plans
rebuild the shared index), producers ingesting, readers of stats, selections, questions and runs,
and index rebuilds. Required: no 5xx answer, every write answered 2xx, and afterwards the runs'
steps and the sampling index agree with what the clients did."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from service.factories import K, group, question_body
from service.harness import ADMIN_TOKEN, Backend, bearer

from .conftest import OwnRedis
from .procs import FAULT_TRIALS, RedisServer, ServiceProcess, scaled, service_env

pytestmark = pytest.mark.faults

B = 8
TRAINERS = 12  # 8 runs of the per_run pool, 4 of the pooled one
PRODUCERS = 8
READERS = 28
REBUILDERS = 2
SECONDS = scaled(4, 60)


def _rollouts(qid: int, tag: tuple[int, int], replay_id: int | None = None) -> dict[str, Any]:
    """Two correct rows of K, with token ids no other group has."""
    tokens = lambda q, row: [q, row, *tag, int(replay_id is not None)]  # noqa: E731
    return group(qid, [1.0, 1.0, 0.0, 0.0][:K], tokens, replay_trajectory_id=replay_id)


class Mix:
    def __init__(self, urls: list[str], qids: dict[str, list[int]], seed: int) -> None:
        self.urls = urls
        self.qids = qids
        self.rng = random.Random(seed)
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.bad: list[str] = []
        self.steps: dict[tuple[str, str], int] = {}
        self.deadline = time.monotonic() + SECONDS

    async def call(
        self, http: httpx.AsyncClient, what: str, method: str, path: str, body: Any = None, **headers: str
    ) -> httpx.Response:
        url = self.rng.choice(self.urls) + path  # any replica
        r = await http.request(method, url, json=body, headers=headers)
        self.statuses[(what, r.status_code)] += 1
        if r.status_code >= 300:
            self.bad.append(f"{what} {method} {path}: {r.status_code} {r.text[:300]}")
        return r

    async def trainer(self, http: httpx.AsyncClient, pool: str, run: str) -> None:
        step = 0
        while time.monotonic() < self.deadline:
            plan = await self.call(http, "plan", "POST", f"/v1/pools/{pool}/runs/{run}/batches", {})
            if plan.status_code != 201:
                return
            p = plan.json()
            tag = (hash(run) % 1000, p["step"])
            groups = [_rollouts(f["question_id"], tag) for f in p["fresh"]]
            groups += [_rollouts(r["question_id"], tag, r["candidates"][0]["id"]) for r in p["replay"]]
            key = f"{pool}-{run}-{p['step']}"
            path = f"/v1/pools/{pool}/batches/{p['id']}/commit"
            commit = await self.call(
                http, "commit", "POST", path, {"groups": groups}, **{"Idempotency-Key": key}
            )
            if commit.status_code != 200:
                return
            step += 1
            self.steps[(pool, run)] = step

    async def producer(self, http: httpx.AsyncClient, n: int) -> None:
        i = 0
        while time.monotonic() < self.deadline:
            pool = "per-run" if n % 2 else "pooled"
            run = f"r{n % 4}"
            qids = self.rng.sample(self.qids[pool], 2)
            body = {"groups": [_rollouts(q, (500 + n, i)) for q in qids]}
            await self.call(http, "ingest", "POST", f"/v1/pools/{pool}/runs/{run}/ingest", body)
            i += 1

    async def reader(self, http: httpx.AsyncClient, n: int) -> None:
        while time.monotonic() < self.deadline:
            pool = self.rng.choice(["per-run", "pooled"])
            run = f"r{self.rng.randrange(4)}"
            choice = self.rng.randrange(5)
            if choice == 0:
                await self.call(http, "stats", "GET", f"/v1/pools/{pool}/stats")
            elif choice == 1:
                body = {"n": 4, "seed": self.rng.randrange(1000)}
                await self.call(http, "select", "POST", f"/v1/pools/{pool}/runs/{run}/select", body)
            elif choice == 2:
                await self.call(http, "questions", "GET", f"/v1/pools/{pool}/questions?limit=50")
            elif choice == 3:
                await self.call(http, "run", "GET", f"/v1/pools/{pool}/runs/{run}/stats")
            else:
                await self.call(http, "pools", "GET", "/v1/pools")

    async def rebuilder(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            pool = self.rng.choice(["per-run", "pooled"])
            await self.call(http, "rebuild", "POST", f"/v1/pools/{pool}/index/rebuild")
            await asyncio.sleep(0.2)


async def _setup(http: httpx.AsyncClient, url: str) -> dict[str, list[int]]:
    qids = {}
    for pool, sharing, runs in (("per-run", "per_run", 8), ("pooled", "pooled", 4)):
        body = {"name": pool, "config": {"k": K, "batch_size": B, "sharing": sharing}}
        assert (await http.post(f"{url}/v1/pools", json=body)).status_code == 201
        questions = {"questions": [question_body(i) for i in range(120)]}
        assert (await http.post(f"{url}/v1/pools/{pool}/questions", json=questions)).status_code == 200
        for r in range(runs):
            body = {"name": f"r{r}", "phase": "mixed", "seed": r}
            assert (await http.post(f"{url}/v1/pools/{pool}/runs", json=body)).status_code == 201
        page = (await http.get(f"{url}/v1/pools/{pool}/questions", params={"limit": 120})).json()
        qids[pool] = [q["id"] for q in page["data"]]
    return qids


async def _mix(urls: list[str]) -> Mix:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(headers=bearer(ADMIN_TOKEN), timeout=120, limits=limits) as http:
        qids = await _setup(http, urls[0])
        mix = Mix(urls, qids, seed=len(urls))
        tasks = [mix.trainer(http, "per-run", f"r{r}") for r in range(8)]
        tasks += [mix.trainer(http, "pooled", f"r{r}") for r in range(4)]
        tasks += [mix.producer(http, n) for n in range(PRODUCERS)]
        tasks += [mix.reader(http, n) for n in range(READERS)]
        tasks += [mix.rebuilder(http) for _ in range(REBUILDERS)]
        assert len(tasks) == TRAINERS + PRODUCERS + READERS + REBUILDERS
        await asyncio.gather(*tasks)
        # afterwards: steps as the trainers counted, the index as the database says
        for pool, runs in (("per-run", 8), ("pooled", 4)):
            for r in range(runs):
                run = (await http.get(f"{urls[0]}/v1/pools/{pool}/runs/r{r}")).json()
                assert run["step"] == mix.steps.get((pool, f"r{r}"), 0)
                stats = (await http.get(f"{urls[-1]}/v1/pools/{pool}/runs/r{r}/stats")).json()
                plan = await http.post(f"{urls[-1]}/v1/pools/{pool}/runs/r{r}/batches", json={"replan": True})
                assert plan.status_code == 201 and plan.json()["num_eligible"] == stats["eligible"]
        return mix


@pytest.mark.parametrize(
    ("store", "replicas"),
    [
        ("sqlite", 1),
        ("sqlite-workers", 1),
        pytest.param("postgres", 2, marks=pytest.mark.postgres),
        # one replica on Postgres + Redis as well in the long version (the default run stays short)
        *([pytest.param("postgres", 1, marks=pytest.mark.postgres)] if FAULT_TRIALS else []),
    ],
)
def test_concurrency_mix(store: str, replicas: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    settings: dict[str, Any] = {"db_pool_size": 20}
    with contextlib.ExitStack() as stack:
        if store == "postgres":
            own: OwnRedis = request.getfixturevalue("own_redis")
            backend = own.backend
        elif store == "sqlite-workers":
            redis = stack.enter_context(RedisServer(tmp_path / "redis"))
            url = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}"
            backend = Backend("sqlite-file", url, redis.url, "exgrpo-mix")
            settings["workers"] = 2
        else:
            backend = Backend("sqlite-file", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
        services = [
            ServiceProcess(service_env(backend, **settings), tmp_path / f"service-{i}.log")
            for i in range(replicas)
        ]
        try:
            for svc in services:
                svc.start()
            mix = asyncio.run(_mix([svc.url for svc in services]))
        finally:
            for svc in services:
                svc.stop()
    total = sum(mix.statuses.values())
    print(f"\nconcurrency mix, {store}, {replicas} replica(s), {SECONDS} s: {total} requests {mix.statuses}")
    assert not mix.bad, f"{len(mix.bad)} answers not 2xx of {total}:\n" + "\n".join(mix.bad[:10])
    assert sum(n for (what, _), n in mix.statuses.items() if what == "commit") >= TRAINERS
