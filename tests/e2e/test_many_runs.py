"""One pool, many runs, end to end: a real `exgrpo serve` on Postgres + Redis (a fresh database, a
free loopback port) and real `exgrpo train` processes with the tiny model, at the same time.

* Pool `shared` (`per_run`) has two runs, a1 and a2; pool `solo` (`pooled`) has run p1. a2 and p1
  train three steps; a1's first trainer is held inside its first step (a grader that waits on a
  file) while a fourth trainer with the name a1 is refused, naming the holder and how to take
  over; then a trainer with `--takeover` trains a1, and once the held trainer goes on, its commit
  is refused and it stops cleanly (exit status 3, no traceback, no checkpoint).
* Isolation: each run saw only its own pool's questions, a per_run run replays only its own
  trajectories, the pooled run's trajectories are its pool's.
* The dashboard's API has each run's curve: the steps and values its trainer logged.

Every trainer of one run writes to one output folder, as the compose and k8s files do."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest
import redis

# tests/ is on sys.path (its conftest.py has no package): the trainer and service tests' helpers
from distributed._helpers import HELD_PARITY, HOLD_ENV, child_env, make_pool, read_metrics, run_overrides
from faults.procs import free_port
from service.harness import REDIS_URL, delete_prefix, fresh_pg_database

from exgrpo_client import Client
from exgrpo_onebox.tiny import build_tiny_model

pytestmark = [pytest.mark.timeout(480), pytest.mark.postgres, pytest.mark.redis]

EXGRPO = Path(sys.executable).with_name("exgrpo")
OWNS = re.compile(r"this trainer \((\S+)\) (?:owns|took over) run (\S+) of pool (\S+)")
COMPARED = ("batch/solved", "loss/total", "actor/entropy")


# ------------------------------------------------------------------------------ the service
def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _service(database_url: str, log: Path) -> Iterator[str]:
    """`exgrpo db upgrade`, then `exgrpo serve` on Postgres + Redis (own key prefix) until the block
    ends; answers its URL once it is ready."""
    prefix = f"exgrpo-e2e-{secrets.token_hex(6)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_")}
    env.update(EXGRPO_LOG_LEVEL="WARNING", EXGRPO_REDIS_PREFIX=prefix)
    upgrade = [str(EXGRPO), "db", "upgrade", "--database-url", database_url]
    done = subprocess.run(upgrade, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    port = free_port()
    command = [str(EXGRPO), "serve", "--anonymous", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--database-url", database_url, "--redis-url", REDIS_URL]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the service exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the service did not get ready: {log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        _stop(proc)
        keys = redis.Redis.from_url(REDIS_URL)
        try:
            delete_prefix(keys, prefix)
        finally:
            keys.close()


# ------------------------------------------------------------------------------ the trainers
class Trainers:
    """`exgrpo train` processes of one test, each logging to its own file; all stopped at the end."""

    def __init__(self, url: str, model: Path, folder: Path) -> None:
        self.url, self.model, self.folder = url, model, folder
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def command(self, pool: str, run: str, out: Path, *extra: str) -> list[str]:
        settings = run_overrides(
            None, pool, self.model, out, f"run.name={run}", f"rollout.grader={HELD_PARITY}",
            "schedule.publish_every=1", "schedule.checkpoint_every=1", *extra,
        )  # fmt: skip
        return [str(EXGRPO), "--url", self.url, "train", *settings]

    def start(self, name: str, command: list[str], *, hold: Path | None = None) -> None:
        env = child_env()
        if hold is not None:
            env[HOLD_ENV] = str(hold)
        log = (self.folder / f"{name}.log").open("wb")
        self._logs.append(log)
        self.procs[name] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, name: str, timeout: float = 240) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} did not finish in {timeout:.0f} s: {self.log(name)[-3000:]}"
            ) from None

    def holder(self, name: str, timeout: float = 120) -> str:
        """The lease holder id the trainer logged once it owned its run."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = OWNS.search(self.log(name))
            if found:
                return found.group(1)
            assert self.procs[name].poll() is None, f"{name} exited: {self.log(name)[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"{name} never took its run: {self.log(name)[-3000:]}")

    def close(self) -> None:
        for proc in self.procs.values():
            _stop(proc)
        for log in self._logs:
            log.close()


def _wait_for(path: Path, trainers: Trainers, name: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert trainers.procs[name].poll() is None, f"{name} exited: {trainers.log(name)[-3000:]}"
        assert time.monotonic() < deadline, (
            f"{name} did not reach its first step: {trainers.log(name)[-3000:]}"
        )
        time.sleep(0.1)


def _solo_pool(client: Client) -> None:
    """A pooled pool whose questions (products) are none of the shared pool's (sums)."""
    client.create_pool("solo", config={"k": 4, "batch_size": 4, "start_threshold": 0.2, "sharing": "pooled"})
    items = [
        {"prompt": [{"role": "user", "content": f"{a}*{b}"}], "ground_truth": str(a * b)}
        for a in range(2, 8)
        for b in range(3, 7)
    ]
    client.import_questions("solo", items)


# ---------------------------------------------------------------------------------- the test
def test_three_trainers_on_one_service(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    hold = tmp_path / "hold-a1"
    hold.touch()
    outs = {run: tmp_path / f"out-{run}" for run in ("a1", "a2", "p1")}
    with (
        fresh_pg_database("exgrpo_e2e") as database_url,
        _service(database_url, tmp_path / "service.log") as url,
    ):
        with Client(url) as client:
            make_pool(client, "shared", start_threshold=0.2)
            _solo_pool(client)
        trainers = Trainers(url, model, tmp_path)
        try:
            # three trainers at once: a1 is held inside its first step, a2 and p1 train 3 steps
            trainers.start("a1", trainers.command("shared", "a1", outs["a1"], "run.steps=3"), hold=hold)
            trainers.start("a2", trainers.command("shared", "a2", outs["a2"], "run.steps=3", "run.seed=7"))
            trainers.start("p1", trainers.command("solo", "p1", outs["p1"], "run.steps=3"))
            first = trainers.holder("a1")
            _wait_for(Path(f"{hold}.reached"), trainers, "a1")

            # a fourth trainer with a taken run name is refused: who holds it, how to take over
            refused = subprocess.run(
                trainers.command("shared", "a1", outs["a1"], "run.steps=3"),
                env=child_env(), capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            said = refused.stderr
            assert refused.returncode == 3, said[-3000:]
            assert "error: run a1 of pool shared is owned by another trainer" in said
            assert first in said and "--takeover" in said and "Traceback" not in said

            # an explicit take-over trains the run; the held trainer, let go, is fenced out
            trainers.start(
                "taker", [*trainers.command("shared", "a1", outs["a1"], "run.steps=2"), "--takeover"]
            )
            taker = trainers.holder("taker")
            assert trainers.wait("taker") == 0, trainers.log("taker")[-3000:]
            hold.unlink()
            assert trainers.wait("a1") == 3, trainers.log("a1")[-3000:]
            fenced = trainers.log("a1")
            assert (
                "error: this trainer" in fenced
                and f"({first}) no longer owns run a1 of pool shared" in fenced
            )
            assert taker in fenced and "Traceback" not in fenced
            for name in ("a2", "p1"):
                assert trainers.wait(name) == 0, trainers.log(name)[-3000:]
        finally:
            trainers.close()

        with Client(url) as client:
            _check_isolation(client)
            _check_curves(client, outs)
            # the take-over trainer gave the run back: anyone may take it now, without take-over
            assert (
                client.acquire_run_lease("shared", "a1", "after-the-test", ttl_s=5).holder == "after-the-test"
            )

    # a1's folder: the taker's checkpoints and weights only (the fenced trainer wrote none)
    ckpt = outs["a1"] / "checkpoints" / "shared" / "a1"
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000001", "step-000002"]
    assert json.loads((ckpt / "run.json").read_text())["run"] == "a1"
    assert [m["step"] for m in read_metrics(outs["a1"])] == [1, 2]


def _check_isolation(client: Client) -> None:
    shared_q = {q.id: q for q in client.iter_questions("shared")}
    solo_q = {q.id: q for q in client.iter_questions("solo")}
    assert shared_q and solo_q and not set(shared_q) & set(solo_q)
    assert all("+" in q.prompt[-1].content for q in shared_q.values())
    assert all("*" in q.prompt[-1].content for q in solo_q.values())
    assert client.get_pool("shared").num_runs == 2 and client.get_pool("solo").num_runs == 1

    # which runs graded each question, and whose trajectories each question holds
    seen: dict[str, set[str]] = {"shared": set(), "solo": set()}
    sources: dict[str, set[str | None]] = {"shared": set(), "solo": set()}
    for pool, questions in (("shared", shared_q), ("solo", solo_q)):
        for qid in questions:
            detail = client.question(pool, qid)
            seen[pool] |= {st.run for st in detail.runs}
            sources[pool] |= {t.source_run for t in detail.trajectories}
    assert seen["shared"] == {"a1", "a2"}, "each per_run run keeps its own question states"
    assert seen["solo"] == {"*"}, "a pooled pool keeps one state per question for its runs"
    assert sources["shared"] <= {"a1", "a2"} and "a2" in sources["shared"]
    assert sources["solo"] == {"p1"}

    # replay candidates: a per_run run's own trajectories only, of its own pool's questions
    for pool, run, questions in (
        ("shared", "a2", shared_q),
        ("shared", "a1", shared_q),
        ("solo", "p1", solo_q),
    ):
        picked = client.select(pool, run, 4, candidates="all")
        if run != "a1":  # a1 (the taker's 2 steps) may not have stored anything: the others have
            assert picked.num_eligible > 0 and picked.replay, (pool, run)
        for item in picked.replay:
            assert item.question_id in questions
            assert item.candidates and {c.source_run for c in item.candidates} == {run}, (pool, run, item)


def _check_curves(client: Client, outs: dict[str, Path]) -> None:
    """Each run's curve on the dashboard API is what its trainer logged, step by step."""
    for pool, run, steps in (("shared", "a1", 2), ("shared", "a2", 3), ("solo", "p1", 3)):
        stored = {m.step: m.metrics for m in client.run_metrics(pool, run).data}
        assert sorted(stored) == list(range(1, steps + 1)), (run, sorted(stored))
        logged = read_metrics(outs[run])
        assert [int(m["step"]) for m in logged] == list(range(1, steps + 1))
        for m in logged:
            got = stored[int(m["step"])]
            for key in COMPARED:
                assert got[key] == m[key], (run, m["step"], key)
            assert "experience/eligible" in got and "timing/step" in got, "late metrics arrive too"
