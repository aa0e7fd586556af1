"""Chaos: a remote run rides through crashes of the pool service and of a rollout worker.

Real processes on loopback: `exgrpo serve` on Postgres + a Redis server of the test's own, the
trainer as `exgrpo train` (rollout.engine=remote, synchronous, a tiny random model) and two
rollout worker processes (`exgrpo_onebox.fleet.WorkerFleet`: the worker loop of `exgrpo rollout`).
While the run trains, the pool service is killed with SIGKILL twice and one worker once, each at a
moment drawn by a seeded RNG (a step of the run, then a delay into it), and each is started again
after a drawn pause. The trainer is never touched. At the end:

* the trainer exits 0 (it never gave up: its pool calls retried through the outages within
  run.retry_budget_s) and its log shows those retries; its metrics have each step 1..S once;
* every step was committed exactly once: one committed batch per step 1..S, no other batch, and
  the pool's run.step == S;
* no task was lost: every task of the run is completed (the killed worker's leases expired and
  another worker, or it after its restart, generated them), none failed, each generated with
  exactly the policy version it names;
* the killed worker came back and serves again.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from distributed._helpers import child_env, make_pool, run_overrides

from exgrpo_client import Client
from exgrpo_onebox.fleet import WorkerFleet
from exgrpo_trainer.config import load_config

from .conftest import OwnRedis
from .procs import ServiceProcess, service_env

pytestmark = [pytest.mark.faults, pytest.mark.slow]  # about 5 minutes: `bash scripts/test.sh -m slow`

SEED = 13
STEPS = 6
POOL, RUN = "chaos", "chaos-run"
LEASE_S = 6.0
"""Task lease of the workers: a killed worker's tasks are claimable again this long after."""
RETRY_LOG = "retrying"
"""What a pool call that failed and is sent again logs (exgrpo_client)."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from exgrpo_onebox.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _steps_done(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


class Chaos:
    """Kills the service twice and a worker once, each during a drawn step of the run (after the
    trainer wrote the metrics of the step before it, plus a drawn delay), restarting each after
    a drawn pause; what it did, in `events`."""

    def __init__(
        self,
        service: ServiceProcess,
        fleet: WorkerFleet,
        metrics: Path,
        rng: random.Random,
        trainer_running: Callable[[], bool],
    ) -> None:
        self.service, self.fleet, self.metrics, self.rng = service, fleet, metrics, rng
        self.trainer_running = trainer_running
        kinds = ["service", "service", "worker"]
        rng.shuffle(kinds)
        # the steps the faults strike in (after that many steps are done): three different ones, not
        # before the first step and early enough that the run is still going when the last one strikes
        after = sorted(rng.sample(range(1, STEPS - 1), 3))
        self.plan = list(zip(after, kinds, strict=True))
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def _run(self) -> None:
        try:
            for after, kind in self.plan:
                while _steps_done(self.metrics) < after:
                    if self.stop.wait(0.1):
                        return
                time.sleep(self.rng.uniform(0.0, 2.0))
                pause = self.rng.uniform(0.5, 4.0)
                event: dict[str, Any] = {"kind": kind, "steps_done": _steps_done(self.metrics)}
                event["trainer_running"] = self.trainer_running()
                if kind == "service":
                    self.service.kill9()
                    time.sleep(pause)
                    self.service.start()
                else:  # started again at once; it loads its engine while the run goes on
                    name = self.rng.choice(self.fleet.names)
                    event["worker"] = name
                    self.fleet.kill9(name)
                    time.sleep(pause)
                    self.fleet.launch(name)
                event["pause_s"] = round(pause, 2)
                self.events.append(event)
        except BaseException as e:  # reported by the test
            self.error = e


async def _rows(url: str, run: str) -> tuple[int, list[tuple[int, str]], Counter[tuple[str, bool]]]:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"), timeout=5)
    try:
        run_id, step = await conn.fetchrow("select id, step from run where name = $1", run)
        batches = await conn.fetch("select step, status from batch where run_id = $1 order by step", run_id)
        tasks = await conn.fetch(
            "select status, policy_version, generated_version from task where run_id = $1", run_id
        )
    finally:
        await conn.close()
    steps = [(r["step"], r["status"]) for r in batches]
    return step, steps, Counter((r["status"], r["generated_version"] == r["policy_version"]) for r in tasks)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_remote_run_rides_through_service_and_worker_crashes(
    own_redis: OwnRedis, tiny_model: Path, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    service = ServiceProcess(service_env(own_redis.backend, allow_anonymous=True), tmp_path / "service.log")
    service.start()
    out = tmp_path / "run"
    items = run_overrides(
        service.url,
        POOL,
        tiny_model,
        out,
        f"run.name={RUN}",
        f"run.steps={STEPS}",
        "run.retry_budget_s=300",
        "run.lease_ttl_s=60",
        "rollout.engine=remote",
        "rollout.results_timeout_s=600",
        "schedule.checkpoint_every=0",
    )
    cfg = load_config(None, items)
    with Client(service.url) as client:
        make_pool(client, POOL, start_threshold=0.05)
        # workers serving one run stop at once when it does not exist: create it as the trainer would
        client.create_run(POOL, RUN, seed=cfg.run.seed, overrides=cfg.run_overrides())
    env = child_env()
    fleet = WorkerFleet(
        service.url, cfg, tiny_model, tmp_path / "workers", count=2, env=env, lease_seconds=LEASE_S
    )
    trainer_log = tmp_path / "trainer.log"
    trainer: subprocess.Popen[bytes] | None = None
    chaos = Chaos(
        service, fleet, out / "metrics.jsonl", rng, lambda: trainer is not None and trainer.poll() is None
    )
    try:
        fleet.start()
        with trainer_log.open("wb") as log:
            command = [sys.executable, "-m", "exgrpo_cli.main", "train", "--log-format", "plain", *items]
            trainer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        chaos.thread.start()
        code = trainer.wait(timeout=720)
        chaos.stop.set()
        chaos.thread.join(timeout=120)
        killed = [e["worker"] for e in chaos.events if e["kind"] == "worker"]
        fleet.wait_serving(killed)  # the killed worker came back and serves again
    finally:
        chaos.stop.set()
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        fleet.stop()
        service.stop()
    text = trainer_log.read_text(errors="replace")
    assert chaos.error is None, repr(chaos.error)
    assert [e["kind"] for e in chaos.events].count("service") == 2, chaos.events
    assert [e["kind"] for e in chaos.events].count("worker") == 1, chaos.events
    assert all(e["trainer_running"] for e in chaos.events), chaos.events  # every fault struck the run
    assert service.starts == 3  # the first start and two restarts

    # the trainer never gave up: it finished every step, and its pool calls retried the outages
    assert code == 0, text[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert RETRY_LOG in text, text[-5000:]

    # every step committed exactly once, and the pool's view agrees
    run_step, batches, tasks = asyncio.run(_rows(own_redis.backend.database_url, RUN))
    assert batches == [(step, "committed") for step in range(1, STEPS + 1)], batches
    assert run_step == STEPS

    # no task lost: every task of the run completed (none failed), each with exactly its version
    assert tasks and set(tasks) == {("completed", True)}, tasks
