"""kill -9 trials: client threads keep writing to a real `exgrpo serve` process (question imports,
ingests, plans and commits, every one with an Idempotency-Key) while the process is killed with
SIGKILL (at a random moment, or by the fault hook right after a commit), and on Postgres + Redis
while Redis is killed and restarted empty. Each client retries a write that got no answer with the
same key until it gets one, and keeps a model of what the pool must hold. After the trials:

* every acknowledged write is present exactly once: questions, and every stored trajectory, each
  traced to the one write that sent it, in the number that write's answer reported;
* no partial commit: run steps, batch results and trajectory counts agree with the answers;
* retries answer the first answer: an answer never says a write was already applied ("inserted 0",
  409), and every key sent again later answers its recorded answer byte for byte;
* no 5xx but 503 (Redis away), and the sampling index agrees with the database.

EXGRPO_FAULT_TRIALS=N runs N trials per backend (default: 2 on each), the kinds of fault in turn.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from service.factories import K, group, ok, question_body
from service.harness import ADMIN_TOKEN, Backend, bearer

from exgrpo_client.schemas import unpack_ids

from .conftest import OwnRedis
from .procs import FAULT_HEADER, FAULT_TRIALS, ServiceProcess, service_env, trials

pytestmark = pytest.mark.faults

STREAMS = 3
B = 8
#: a client gives up on one write after this long without an answer (the service restarts in seconds)
PATIENCE_S = 120.0


@dataclass
class Write:
    """One keyed write and what its answer must say."""

    kind: str
    method: str
    path: str
    body: dict[str, Any]
    key: str
    status: int = 0
    text: str = ""
    answer: dict[str, Any] = field(default_factory=dict)
    faulted: bool = False  # sent again after a failure (no answer, or 503)


@dataclass
class Tally:
    """What the trials did, for docs/operations.md."""

    trials: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    writes: int = 0
    retried: int = 0
    replays: int = 0
    trajectories: int = 0


class Arm:
    """Hands the fault hook to the next write that asks (once per arming)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def take(self) -> bool:
        with self._lock:
            armed, self._armed = self._armed, False
            return armed


class Stream(threading.Thread):
    """One client: its own run and questions, a model of what it wrote, writes until stopped."""

    def __init__(self, n: int, url: str, qids: list[int], arm: Arm, seed: int) -> None:
        super().__init__(name=f"stream-{n}", daemon=True)
        self.n, self.url, self.qids, self.arm = n, url, qids, arm
        self.rng = random.Random(seed)
        self.http = httpx.Client(base_url=url, headers=bearer(ADMIN_TOKEN), timeout=30)
        self.stop = threading.Event()
        self.ops = itertools.count()
        self.writes: list[Write] = []
        self.errors: list[str] = []
        self.step = 0
        self.imported = 0
        self.run_name = f"s{n}"

    # -------------------------------------------------------------------------------- sending
    def send(self, w: Write) -> Write:
        deadline = time.monotonic() + PATIENCE_S
        first = True
        while True:
            headers = {"Idempotency-Key": w.key}
            if first and self.arm.take():
                headers[FAULT_HEADER] = "kill-after-commit"
            first = False
            try:
                r = self.http.request(w.method, w.path, json=w.body, headers=headers)
            except httpx.TransportError:
                r = None
            if r is not None and r.status_code != 503:
                w.status, w.text = r.status_code, r.text
                w.answer = r.json() if r.headers.get("content-type", "").endswith("json") else {}
                self.writes.append(w)
                if r.status_code >= 500:
                    self.errors.append(f"{w.kind} {w.path}: {r.status_code} {r.text[:300]}")
                return w
            w.faulted = True
            if time.monotonic() > deadline:
                raise AssertionError(f"{w.kind} {w.path}: no answer for {PATIENCE_S:.0f} s")
            time.sleep(0.05)

    def expect(self, w: Write, status: int, **fields: Any) -> bool:
        got = {k: w.answer.get(k) for k in fields}
        if w.status != status or got != fields:
            self.errors.append(f"{w.kind} {w.path} (retried: {w.faulted}): {w.status} {w.text[:300]}")
            return False
        return True

    def tokens(self, op: int, qid: int, row: int, replay: bool) -> list[int]:
        """Token ids that trace a stored trajectory to the write that sent it."""
        return [qid, row, 1000 + self.n, 100_000 + op, int(replay)]

    def rollouts(self, op: int, qid: int, replay_id: int | None) -> dict[str, Any]:
        """A group of K with two correct rows (collected in bucket 2, never retired)."""
        rewards = [1.0, 1.0, 0.0, 0.0][:K]
        tokens = lambda q, row: self.tokens(op, q, row, replay_id is not None)  # noqa: E731
        return group(qid, rewards, tokens, replay_trajectory_id=replay_id)

    # ---------------------------------------------------------------------------------- writes
    def key(self, op: int) -> str:
        return f"s{self.n}-op{op}"

    def do_import(self) -> None:
        op = next(self.ops)
        n = self.rng.randint(5, 40)
        questions = [
            {"prompt": [{"role": "user", "content": f"s{self.n} op{op} q{i}"}], "ground_truth": str(i)}
            for i in range(n)
        ]
        w = self.send(
            Write("import", "POST", "/v1/pools/p1/questions", {"questions": questions}, self.key(op))
        )
        if self.expect(w, 200, inserted=n, duplicates=0):
            self.imported += n

    def do_ingest(self) -> None:
        op = next(self.ops)
        qids = self.rng.sample(self.qids, 3)
        body = {"groups": [self.rollouts(op, q, None) for q in qids]}
        w = self.send(
            Write("ingest", "POST", f"/v1/pools/p1/runs/{self.run_name}/ingest", body, self.key(op))
        )
        self.expect(w, 200, stored_trajectories=2 * len(qids), duplicate_trajectories=0)
        w.answer["op"] = op

    def do_step(self) -> None:
        op = next(self.ops)
        path = f"/v1/pools/p1/runs/{self.run_name}/batches"
        plan = self.send(Write("plan", "POST", path, {}, self.key(op)))
        if not self.expect(plan, 201, step=self.step + 1):
            return
        op = next(self.ops)
        groups = [self.rollouts(op, f["question_id"], None) for f in plan.answer["fresh"]]
        groups += [
            self.rollouts(op, r["question_id"], r["candidates"][0]["id"]) for r in plan.answer["replay"]
        ]
        body = {"groups": groups}
        w = self.send(
            Write("commit", "POST", f"/v1/pools/p1/batches/{plan.answer['id']}/commit", body, self.key(op))
        )
        if self.expect(w, 200, step=self.step + 1, batch_id=plan.answer["id"]):
            self.step += 1
        w.answer["op"] = op

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                choice = self.rng.random()
                if choice < 0.2:
                    self.do_import()
                elif choice < 0.55:
                    self.do_ingest()
                else:
                    self.do_step()
        except Exception as e:  # reported by the test, not lost in the thread
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.http.close()


# -------------------------------------------------------------------------------------- checks
def _export(http: httpx.Client) -> list[dict[str, Any]]:
    r = http.get("/v1/pools/p1/export")
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line]


def _check(http: httpx.Client, streams: list[Stream], base_questions: int, tally: Tally) -> None:
    errors = [e for s in streams for e in s.errors]
    assert not errors, "\n".join(errors[:10])
    records = _export(http)
    header = records[0]
    trajectories = [r for r in records if r["type"] == "trajectory"]
    # every stored trajectory traces to exactly one write, as often as that write's answer says
    sent: Counter[tuple[int, int]] = Counter()
    seen: set[tuple[int, ...]] = set()
    for t in trajectories:
        ids = tuple(int(x) for x in unpack_ids(t["token_ids_b64"]))
        assert ids not in seen, f"trajectory stored twice: {ids}"
        seen.add(ids)
        sent[(ids[2] - 1000, ids[3] - 100_000)] += 1
    expected: Counter[tuple[int, int]] = Counter()
    for s in streams:
        for w in s.writes:
            if w.kind in ("ingest", "commit") and w.answer.get("stored_trajectories"):
                expected[(s.n, w.answer["op"])] += w.answer["stored_trajectories"]
    assert sent == expected
    assert header["num_questions"] == base_questions + sum(s.imported for s in streams)
    assert header["num_trajectories"] == sum(expected.values()) == len(trajectories)
    tally.trajectories = len(trajectories)
    for s in streams:
        run = ok(http.get(f"/v1/pools/p1/runs/{s.run_name}"))
        assert run["step"] == s.step
        for w in s.writes:
            if w.kind == "commit":
                status = ok(http.get(w.path.removesuffix("/commit") + "/status"))
                assert status["status"] == "committed" and status["result"]["step"] == w.answer["step"]
    # every key answers its recorded answer again
    for s in streams:
        for w in s.writes:
            r = http.request(w.method, w.path, json=w.body, headers={"Idempotency-Key": w.key})
            assert r.status_code == w.status and r.headers["idempotent-replayed"] == "true"
            if w.kind == "plan":  # a replayed plan shows the batch as it is now
                assert r.json()["id"] == w.answer["id"]
            else:
                assert r.text == w.text, (w.kind, w.path)
            tally.replays += 1
    # the index agrees with the database
    for s in streams:
        stats = ok(http.get(f"/v1/pools/p1/runs/{s.run_name}/stats"))
        plan = http.post(f"/v1/pools/p1/runs/{s.run_name}/batches", json={"replan": True})
        assert plan.status_code == 201 and plan.json()["num_eligible"] == stats["eligible"]


def _setup(http: httpx.Client) -> list[int]:
    r = http.post("/v1/pools", json={"name": "p1", "config": {"k": K, "batch_size": B}})
    assert r.status_code == 201, r.text
    ok(http.post("/v1/pools/p1/questions", json={"questions": [question_body(i) for i in range(60)]}))
    for n in range(STREAMS):
        r = http.post("/v1/pools/p1/runs", json={"name": f"s{n}", "phase": "mixed", "seed": n})
        assert r.status_code == 201, r.text
    return [q["id"] for q in ok(http.get("/v1/pools/p1/questions", params={"limit": 60}))["data"]]


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_kill_trials(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    own: OwnRedis | None = None
    if store == "postgres":
        own = request.getfixturevalue("own_redis")
        backend = own.backend
        # the default run leaves out the plain kill here (SQLite has it): one restart less
        kinds = ["kill -9 after a commit", "redis restarted empty"] + (["kill -9"] if FAULT_TRIALS else [])
    else:
        backend = Backend("sqlite-file", f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", None, "unused")
        kinds = ["kill -9", "kill -9 after a commit"]
    n_trials = trials(len(kinds))
    rng = random.Random(16)
    tally = Tally()
    svc = ServiceProcess(service_env(backend), tmp_path / "service.log", fault_hooks=True)
    with svc, httpx.Client(base_url=svc.url, headers=bearer(ADMIN_TOKEN), timeout=30) as http:
        qids = _setup(http)
        arm = Arm()
        streams: list[Stream] = []
        for trial in range(n_trials):
            kind = kinds[trial % len(kinds)]
            group = [
                Stream(n, svc.url, qids[20 * n : 20 * n + 20], arm, seed=1000 * trial + n)
                for n in range(STREAMS)
            ]
            for s in group:  # a stream continues the run of its predecessor
                s.step = streams[-STREAMS + s.n].step if streams else 0
                s.ops = itertools.count(10_000 * trial)
                s.start()
            time.sleep(rng.uniform(0.2, 0.8))
            if kind == "kill -9":
                svc.kill9()
                svc.start()
            elif kind == "kill -9 after a commit":
                arm.arm()
                assert svc.wait_dead(timeout=60) == -9, "the fault hook fired"
                svc.start()
            else:
                assert own is not None
                own.redis.kill()
                time.sleep(rng.uniform(0.1, 0.5))
                own.redis.start()
            tally.faults[kind] += 1
            time.sleep(0.5)  # writes go on after the fault
            for s in group:
                s.stop.set()
            for s in group:
                s.join(timeout=PATIENCE_S + 30)
                assert not s.is_alive(), f"{s.name} hangs"
            streams += group
            tally.trials += 1
        tally.writes = sum(len(s.writes) for s in streams)
        tally.retried = sum(w.faulted for s in streams for w in s.writes)
        _check(http, _merged(streams), 60, tally)
    print(f"\nkill trials on {store}: {tally}")
    assert tally.retried > 0, "no write was caught by a fault: the trials tested nothing"


def _merged(streams: list[Stream]) -> list[Stream]:
    """One stream per run: the writes and imports of all its trials, the step of its last."""
    out: dict[int, Stream] = {}
    for s in streams:
        if s.n not in out:
            out[s.n] = s
            continue
        m = out[s.n]
        m.writes += s.writes
        m.errors += s.errors
        m.imported += s.imported
        m.step = s.step
    return list(out.values())
