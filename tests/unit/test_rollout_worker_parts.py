"""Rollout worker pieces without a service: the loop against a fake client and engine (lost leases,
engine errors, stop requests, SIGTERM during generation, lease renewal), grouping of claimed tasks
and the choice of the policy version each group is generated with (an exact task never gets other
weights), the task's sampling settings, riding through pool outages, policy uris, JSON logs,
Prometheus metrics, and the vLLM engine and weight-reload extension against stand-ins of vLLM."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import types
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from exgrpo_client.errors import Conflict, NotFound, ServerError, TransportError
from exgrpo_client.schemas import (
    ChatMessage,
    PolicyVersionPublic,
    PolicyVersionsPublic,
    SamplingParams,
    TaskPublic,
    TasksPublic,
)
from exgrpo_onebox.tiny import build_tokenizer
from exgrpo_rollout.engines.base import Completion, GenerationStats, SamplingConfig
from exgrpo_rollout.logs import JsonFormatter, configure_json_logging, fields
from exgrpo_rollout.worker import (
    RolloutWorker,
    TaskGroup,
    Weights,
    WorkerConfig,
    WorkerMetrics,
    choose_policy,
    group_tasks,
    path_from_uri,
)

TOK = build_tokenizer()
ANSWER = "</think> so \\boxed{2}"


def _task(
    task_id: int,
    num_samples: int = 2,
    policy_version: int = 0,
    *,
    run: str = "r",
    exact: bool = True,
    uri: str | None = None,
    sampling: SamplingParams | None = None,
) -> TaskPublic:
    return TaskPublic(
        id=task_id,
        batch_id="b",
        run=run,
        question_id=100 + task_id,
        prompt=[ChatMessage(role="user", content="What is 1 + 1?")],
        ground_truth="2",
        data_source="",
        num_samples=num_samples,
        replayed=False,
        policy_version=policy_version,
        policy_exact=exact,
        policy_uri=uri,
        sampling=sampling,
        status="leased",
        attempts=1,
        lease_token=f"tok{task_id}",
        lease_expires_at=datetime.now(UTC),
    )


def _versions(*pairs: tuple[int, str]) -> list[PolicyVersionPublic]:
    return [PolicyVersionPublic(version=v, uri=uri, step=v, created_at=datetime.now(UTC)) for v, uri in pairs]


class FakeClient:
    """Shared by the worker's clients (main loop and lease thread); records every call.

    `versions`: the published versions of every run, or per run name (a dict). `outage`: call
    names (claim, complete, renew, versions) answered with a transport error that many times."""

    def __init__(
        self,
        tasks: list[TaskPublic],
        versions: list[PolicyVersionPublic] | dict[str, list[PolicyVersionPublic]] | None = None,
        pools: dict[str, list[TaskPublic]] | None = None,
    ) -> None:
        self.queue = list(tasks)
        self.pools = pools or {}
        self.versions = versions or []
        self.calls: list[tuple[str, Any]] = []
        self.lost: set[int] = set()  # tasks whose lease the service no longer honours
        self.refused: set[int] = set()  # completions refused (409) while the lease is still held
        self.outage: dict[str, int] = {}
        self.stall: dict[str, float] = {}  # seconds a call spends retrying before it answers
        self.claim_error: Exception | None = None
        self.lock = threading.Lock()

    def _down(self, name: str) -> None:
        end = time.monotonic() + self.stall.get(name, 0.0)
        while time.monotonic() < end:  # an SDK call riding through an outage
            time.sleep(0.01)
        if self.outage.get(name, 0) > 0:
            self.outage[name] -= 1
            raise TransportError("connection refused", method="POST", url="http://pool")

    def _log(self, name: str, arg: Any) -> None:
        with self.lock:
            self.calls.append((name, arg))

    def names(self, name: str) -> list[Any]:
        with self.lock:
            return [a for n, a in self.calls if n == name]

    def claim_tasks(
        self, pool: str, run: str, worker: str, max_tasks: int, lease_seconds: float
    ) -> TasksPublic:
        self._down("claim")
        if self.claim_error is not None:
            raise self.claim_error
        taken, self.queue = self.queue[:max_tasks], self.queue[max_tasks:]
        self._log("claim", [t.id for t in taken])
        return TasksPublic(data=taken, count=len(taken))

    def claim_pool_tasks(
        self, pool: str, worker: str, max_tasks: int, lease_seconds: float, runs: list[str] | None = None
    ) -> TasksPublic:
        self._down("claim")
        queue = self.pools.get(pool, [])
        taken, self.pools[pool] = queue[:max_tasks], queue[max_tasks:]
        self._log("pool_claim", (pool, runs, [t.id for t in taken]))
        return TasksPublic(data=taken, count=len(taken))

    def renew_task(self, pool: str, task_id: int, token: str, lease_seconds: float) -> None:
        self._log("renew", task_id)
        self._down("renew")
        if task_id in self.lost:
            raise Conflict(409, "Conflict", "lease lost")

    def complete_task(
        self, pool: str, task_id: int, token: str, rollouts: list[Any], policy_version: int | None = None
    ) -> None:
        self._log("complete_try", (task_id, token))
        self._down("complete")
        if task_id in self.lost or task_id in self.refused:
            raise Conflict(409, "Conflict", "lease lost")
        self._log("complete", (task_id, rollouts))
        self._log("version", (task_id, policy_version))

    def fail_task(self, pool: str, task_id: int, token: str, error: str, retry: bool = True) -> None:
        self._down("fail")
        if task_id in self.lost:
            raise Conflict(409, "Conflict", "lease lost")
        self._log("fail", (task_id, error, retry))

    def list_policy_versions(self, pool: str, run: str) -> PolicyVersionsPublic:
        self._log("versions", run)
        self._down("versions")
        data = self.versions.get(run, []) if isinstance(self.versions, dict) else self.versions
        return PolicyVersionsPublic(data=data, count=len(data))

    def close(self) -> None:
        pass


class FakeEngine:
    """`events`: ("load", path) and ("generate", path of the weights held) in order; `broken`:
    paths whose load fails half-way."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.delay_s, self.error = delay_s, error
        self.loaded: list[str] = []
        self.calls: list[tuple[int, int]] = []
        self.samplings: list[SamplingConfig] = []
        self.events: list[tuple[str, str]] = []
        self.holding = "start"
        self.broken: set[str] = set()
        self._stats = GenerationStats()

    @property
    def last_stats(self) -> GenerationStats:
        return self._stats

    def load_weights(self, path: str) -> None:
        self.holding = "half-loaded"
        if path in self.broken:
            raise OSError(f"{path}: no safetensors")
        self.loaded.append(path)
        self.events.append(("load", path))
        self.holding = path

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        self.calls.append((len(prompts), sampling.n))
        self.samplings.append(sampling)
        self.events.append(("generate", self.holding))
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end:  # a busy engine call (interruptible between bytecodes)
            time.sleep(0.01)
        if self.error is not None:
            raise self.error
        ids = TOK(ANSWER, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        return [
            [
                Completion(token_ids=ids, logprobs=[-0.5] * len(ids), entropies=[0.25] * len(ids))
                for _ in range(sampling.n)
            ]
            for _ in prompts
        ]


def _worker(
    client: FakeClient, engine: FakeEngine, loaded: Weights | None = None, **overrides: Any
) -> RolloutWorker:
    settings: dict[str, Any] = {
        "pools": ["p"],
        "runs": ["r"],
        "worker_id": "w",
        "grader": "math_think",
        "idle_exit_s": 0.0,
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.01,
        "heartbeat_s": 0.05,
        "policy_poll_s": 0.0,
        **overrides,
    }
    return RolloutWorker(WorkerConfig(**settings), engine, TOK, client_factory=lambda: client, loaded=loaded)  # type: ignore[arg-type,return-value]  # fakes


# ------------------------------------------------------------------------------------- the loop
def test_completes_tasks_with_graded_rollouts() -> None:
    client = FakeClient([_task(1, 2), _task(2, 3), _task(3, 2)])
    worker = _worker(client, FakeEngine(), tasks_per_claim=3)
    assert worker.run() == 0
    done = dict(client.names("complete"))
    assert sorted(done) == [1, 2, 3] and worker.stats.completed_ids == [1, 2, 3]
    assert [len(done[i]) for i in (1, 2, 3)] == [2, 3, 2]
    r = done[2][0]
    assert r.reward == 1.0 and r.finish_reason == "stop" and r.entropy == pytest.approx(0.25)
    assert r.token_ids_b64 and r.logprobs_b64
    assert sorted(worker.engine.calls) == [(1, 3), (2, 2)]  # type: ignore[attr-defined]  # one call per sample count
    assert worker.stats.grading_calls == 1 and worker.stats.samples == 7


def test_lost_lease_drops_the_result() -> None:
    client = FakeClient([_task(1), _task(2)])
    client.lost.add(1)
    worker = _worker(client, FakeEngine())
    worker.run()
    assert worker.stats.tasks_lost == 1 and worker.stats.completed_ids == [2]
    assert not client.names("fail")  # nothing to give back: another worker owns task 1 now


def test_renewals_keep_leases_and_notice_a_lost_one() -> None:
    client = FakeClient([_task(1)])
    client.lost.add(1)
    worker = _worker(client, FakeEngine(), lease_seconds=0.15, test_delay_s=0.4)
    worker.run()
    assert len(client.names("renew")) >= 1
    assert worker.stats.tasks_lost == 1 and not client.names("complete")  # dropped before completing


def test_engine_errors_fail_tasks_back_then_give_up() -> None:
    client = FakeClient([_task(i) for i in range(1, 6)])
    worker = _worker(client, FakeEngine(error=RuntimeError("cuda oom")), max_consecutive_errors=3)
    with pytest.raises(RuntimeError, match="3 engine failures in a row"):
        worker.run()
    fails = client.names("fail")
    assert [f[0] for f in fails] == [1, 2, 3] and all(f[2] is True and "cuda oom" in f[1] for f in fails)
    assert worker.stats.tasks_failed == 3


def test_request_stop_releases_the_task_in_flight() -> None:
    client = FakeClient([_task(1), _task(2)])
    worker = _worker(client, FakeEngine(), test_delay_s=30.0, idle_exit_s=None)
    threading.Timer(0.3, worker.request_stop).start()
    start = time.monotonic()
    assert worker.run() == 0 and time.monotonic() - start < 10
    assert client.names("fail") == [(1, "worker stopped", True)]
    assert worker.stats.tasks_released == 1 and not client.names("complete")
    assert [t.id for t in client.queue] == [2]  # stopped claiming


def test_sigterm_interrupts_generation_and_releases() -> None:
    client = FakeClient([_task(1)])
    worker = _worker(client, FakeEngine(delay_s=30.0), idle_exit_s=None)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    worker.install_signal_handlers()
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    try:
        start = time.monotonic()
        assert worker.run() == 0
        assert time.monotonic() - start < 10  # the 30 s engine call was cut short
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert client.names("fail") == [(1, "worker stopped", True)] and worker.stopping


def test_exact_task_without_uri_loads_its_version_from_the_run_list() -> None:
    versions = _versions((1, "file:///models/v1"), (3, "file:///models/v%203"), (4, "file:///models/v4"))
    client = FakeClient([_task(1, policy_version=3)], versions)
    engine = FakeEngine()
    worker = _worker(client, engine, policy_poll_s=60.0)
    worker.run()
    assert engine.loaded == ["/models/v 3"] and worker.stats.loaded_version == 3  # not the newest, 4
    assert worker.stats.policy_reloads == 1 and client.names("version") == [(1, 3)]


# ------------------------------------------------------------------ task groups and policy choice
def _group(run: str = "r", version: int = 2, exact: bool = True, uri: str | None = None) -> TaskGroup:
    return TaskGroup(
        "p", run, version, exact, None, [_task(1, policy_version=version, run=run, exact=exact, uri=uri)]
    )


def test_claimed_tasks_are_grouped_by_run_version_exactness_and_sampling() -> None:
    hot = SamplingParams(temperature=0.7, max_tokens=64)
    tasks = [
        _task(1, run="a", policy_version=1),
        _task(2, run="b", policy_version=1),
        _task(3, run="a", policy_version=1),
        _task(4, run="a", policy_version=2),
        _task(5, run="a", policy_version=1, exact=False),
        _task(6, run="a", policy_version=1, sampling=hot),
        _task(7, run="a", policy_version=1, sampling=SamplingParams(temperature=0.7, max_tokens=64)),
    ]
    groups = group_tasks("p", tasks)
    assert [[t.id for t in g.tasks] for g in groups] == [[1, 3], [2], [4], [5], [6, 7]]
    assert [(g.run, g.policy_version, g.policy_exact) for g in groups][:4] == [
        ("a", 1, True),
        ("b", 1, True),
        ("a", 2, True),
        ("a", 1, False),
    ]
    assert groups[4].sampling == hot and groups[0].sampling is None and groups[0].pool == "p"


def test_exact_group_gets_exactly_its_version() -> None:
    published = _versions((1, "file:///v1"), (2, "file:///v2"), (3, "file:///v3"))
    held = Weights("p", "r", 2, "file:///v2")
    assert choose_policy(_group(version=2), held, None).action == "keep"
    # the same version number of another run, or of another pool, is other weights
    for other in (Weights("p", "r2", 2, "file:///x"), Weights("q", "r", 2, "file:///y")):
        choice = choose_policy(_group(version=2, uri="file:///v2"), other, None)
        assert choice.action == "load" and choice.weights == held
    # newer weights of the run do not serve an exact task either; the uri comes from the list
    choice = choose_policy(_group(version=1), Weights("p", "r", 3, "file:///v3"), published)
    assert choice.action == "load" and choice.weights == Weights("p", "r", 1, "file:///v1")
    # not published (yet): refused, never served with another version
    for loaded in (Weights("p", "r", 3, "file:///v3"), None, Weights(None, None, -1, "/base")):
        refused = choose_policy(_group(version=4), loaded, published, start=Weights(None, None, -1, "/base"))
        assert refused.action == "refuse" and refused.weights is None
        assert "policy version 4 of run p/r is not published (newest: 3)" in refused.error
    unknown = choose_policy(_group(version=2), None, None)
    assert unknown.action == "refuse" and "could not be listed" in unknown.error


def test_asynchronous_group_keeps_recent_enough_weights_of_its_run() -> None:
    published = _versions((1, "file:///v1"), (2, "file:///v2"), (5, "file:///v5"))
    assert (
        choose_policy(_group(version=2, exact=False), Weights("p", "r", 3, "u3"), published).action == "keep"
    )
    assert choose_policy(_group(version=3, exact=False), Weights("p", "r", 3, "u3"), None).action == "keep"
    # too old, or another run's weights (whatever their number): the run's newest version
    for loaded in (Weights("p", "r", 1, "u1"), Weights("p", "other", 9, "u9"), None):
        choice = choose_policy(_group(version=2, exact=False), loaded, published)
        assert choice.action == "load" and choice.weights == Weights("p", "r", 5, "file:///v5")
    # the list could not be read: the task's own (oldest allowed) version
    choice = choose_policy(_group(version=2, exact=False, uri="file:///v2"), None, None)
    assert choice.weights == Weights("p", "r", 2, "file:///v2")
    refused = choose_policy(_group(version=6, exact=False), Weights("p", "r", 5, "u"), published)
    assert refused.action == "refuse" and "no published policy version >= 6 (newest: 5)" in refused.error


def test_run_that_published_nothing_is_served_with_the_start_model() -> None:
    start = Weights(None, None, -1, "/models/base")
    assert choose_policy(_group(version=0), start, [], start).action == "keep"
    reload = choose_policy(_group(version=0), Weights("p", "other", 3, "u3"), [], start)
    assert reload.action == "load" and reload.weights == start
    gone = choose_policy(_group(version=0), Weights("p", "other", 3, "u3"), [], None)
    assert gone.action == "refuse" and "published no policy version" in gone.error


def test_two_runs_each_get_their_own_weights_in_order() -> None:
    tasks = [
        _task(1, run="a", policy_version=1, uri="file:///a/v1"),
        _task(2, run="b", policy_version=1, uri="file:///b/v1"),
        _task(3, run="a", policy_version=1, uri="file:///a/v1"),
        _task(4, run="a", policy_version=2, uri="file:///a/v2"),
    ]
    client = FakeClient([], pools={"p": tasks})
    engine = FakeEngine()
    worker = _worker(client, engine, runs=None, tasks_per_claim=4)
    worker.run()
    assert client.names("pool_claim")[0] == ("p", None, [1, 2, 3, 4])
    assert engine.events == [
        ("load", "/a/v1"),
        ("generate", "/a/v1"),  # tasks 1 and 3 together
        ("load", "/b/v1"),
        ("generate", "/b/v1"),
        ("load", "/a/v2"),
        ("generate", "/a/v2"),
    ]
    assert sorted(client.names("version")) == [(1, 1), (2, 1), (3, 1), (4, 2)]
    assert worker.stats.generated_with == {1: 1, 3: 1, 2: 1, 4: 2}
    assert worker.stats.completed_by_run == {"p/a": 3, "p/b": 1}
    assert not client.names("versions")  # every task named its uri: no listing needed


def test_exact_task_whose_version_cannot_be_loaded_is_failed_back_not_served() -> None:
    tasks = [
        _task(1, policy_version=1, uri="file:///v1"),
        _task(2, policy_version=2, uri="file:///broken"),
        _task(3, policy_version=3),  # not published (yet)
        _task(4, policy_version=1, uri="file:///v1"),
    ]
    client = FakeClient(tasks, _versions((1, "file:///v1"), (2, "file:///broken")))
    engine = FakeEngine()
    engine.broken.add("/broken")
    worker = _worker(client, engine)
    worker.run()
    fails = {f[0]: f for f in client.names("fail")}
    assert sorted(fails) == [2, 3] and all(f[2] is True for f in fails.values())
    assert "loading p/r@v2 from file:///broken failed: OSError" in fails[2][1]
    assert "policy version 3 of run p/r is not published (newest: 2)" in fails[3][1]
    # the failed load left weights of no known version: task 4 reloads v1 before generating
    assert engine.events == [("load", "/v1"), ("generate", "/v1"), ("load", "/v1"), ("generate", "/v1")]
    assert sorted(client.names("version")) == [(1, 1), (4, 1)]
    assert worker.stats.tasks_failed == 2 and worker.stats.completed_ids == [1, 4]


def test_asynchronous_tasks_reload_only_below_their_minimum() -> None:
    tasks = [_task(i, policy_version=v, exact=False) for i, v in ((1, 1), (2, 2), (3, 1), (4, 4))]
    client = FakeClient(tasks, _versions((1, "file:///v1"), (2, "file:///v2")))
    engine = FakeEngine()
    worker = _worker(client, engine, loaded=Weights("p", "r", 1, "file:///v1"), policy_poll_s=60.0)

    def publish_v4() -> None:  # published while task 4 waits: the stale list is asked again
        client.versions = _versions((1, "file:///v1"), (2, "file:///v2"), (4, "file:///v4"))

    engine_generate = engine.generate

    def generate(prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        if len(engine.calls) == 2:
            publish_v4()
        return engine_generate(prompts, sampling)

    engine.generate = generate  # type: ignore[method-assign]  # hooks the fake
    worker.run()
    assert engine.loaded == ["/v2", "/v4"]
    assert client.names("version") == [(1, 1), (2, 2), (3, 2), (4, 4)]


def test_task_sampling_settings_win_over_the_worker_flags() -> None:
    asked = SamplingParams(temperature=0.6, top_p=0.9, max_tokens=32, min_tokens=48)
    tasks = [_task(1, sampling=asked), _task(2), _task(3, sampling=SamplingParams(temperature=0.0))]
    worker = _worker(FakeClient(tasks), engine := FakeEngine(), temperature=1.3, max_new_tokens=20)
    worker.run()
    first, second = engine.samplings
    assert (first.temperature, first.top_p, first.max_new_tokens, first.min_new_tokens) == (0.6, 0.9, 32, 32)
    assert (second.temperature, second.top_p, second.max_new_tokens) == (1.3, 1.0, 20)
    (fail,) = worker.client.names("fail")  # type: ignore[attr-defined]  # a FakeClient
    assert fail[0] == 3 and fail[2] is False and "temperature must be > 0" in fail[1]


def test_pools_are_claimed_in_turn() -> None:
    pools = {"p": [_task(1), _task(2)], "q": [_task(3)]}
    client = FakeClient([], pools=pools)
    worker = _worker(client, FakeEngine(), pools=["p", "q"], runs=["r", "r2"])
    worker.run()
    claims = [(pool, ids) for pool, _, ids in client.names("pool_claim")]
    assert claims[:3] == [("p", [1]), ("q", [3]), ("p", [2])]
    assert all(runs == ["r", "r2"] for _, runs, _ in client.names("pool_claim"))


# --------------------------------------------------------------------------------- pool outages
def test_worker_rides_through_an_outage() -> None:
    client = FakeClient([_task(1), _task(2)])
    client.outage = {"claim": 3, "versions": 2, "complete": 2, "renew": 100}
    worker = _worker(
        client, FakeEngine(), idle_exit_s=0.3, lease_seconds=0.15, test_delay_s=0.1, policy_poll_s=60.0
    )
    assert worker.run() == 0
    assert worker.stats.completed_ids == [1, 2] and worker.stats.tasks_lost == worker.stats.tasks_failed == 0
    tries = client.names("complete_try")
    assert tries[:3] == [(1, "tok1")] * 3  # the same lease token each time
    # the run published nothing (learnt once the pool answered): the start model, no version named
    assert client.names("versions") == ["r"] * 3 and client.names("version") == [(1, None), (2, None)]


def _sigterm_after(worker: RolloutWorker, *delays: float, when: Any = None) -> float:
    """Run the worker with SIGTERM sent after each delay (counted from when `when()` holds);
    the seconds `run()` took."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    worker.install_signal_handlers()

    def send() -> None:
        start = time.monotonic()
        while when is not None and not when() and time.monotonic() - start < 60:
            time.sleep(0.01)
        for d in delays:
            time.sleep(d)
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True).start()
    try:
        start = time.monotonic()
        assert worker.run() == 0
        return time.monotonic() - start
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_sigterm_cuts_a_completion_riding_through_an_outage_short() -> None:
    client = FakeClient([_task(1)])
    client.stall = {"complete": 60.0}
    worker = _worker(client, FakeEngine(), idle_exit_s=None)
    assert _sigterm_after(worker, 0.2, when=lambda: client.names("complete_try")) < 30
    assert client.names("complete_try") == [(1, "tok1")] and not client.names("complete")
    assert client.names("fail") == [(1, "worker stopped", True)]  # given back, not left to expire


def test_a_second_sigterm_abandons_giving_tasks_back_through_an_outage() -> None:
    client = FakeClient([_task(1), _task(2)])
    client.stall = {"fail": 60.0}
    worker = _worker(client, FakeEngine(delay_s=60.0), idle_exit_s=None, tasks_per_claim=2)
    # the first stops the engine call, the second the release stuck in the outage
    assert _sigterm_after(worker, 0.2, 1.0, when=lambda: worker.engine.calls) < 30  # type: ignore[attr-defined]  # a FakeEngine
    assert not client.names("fail") and worker.stats.tasks_released == 0  # their leases will expire


def test_refusals_no_retry_can_change_stop_the_worker() -> None:
    client = FakeClient([_task(1)])
    client.claim_error = NotFound(404, "Not Found", "run 'r' does not exist in pool 'p'")
    with pytest.raises(NotFound):
        _worker(client, FakeEngine()).run()
    client.claim_error = ServerError(500, "Internal Server Error", "boom")  # logged, not fatal
    assert _worker(client, FakeEngine(), idle_exit_s=0.05).run() == 0


def test_completion_refused_while_the_lease_is_held_fails_the_task_back() -> None:
    client = FakeClient([_task(1)])
    client.refused.add(1)
    worker = _worker(client, FakeEngine())
    worker.run()
    (fail,) = client.names("fail")
    assert fail[0] == 1 and "completion refused" in fail[1] and fail[2] is True
    assert worker.stats.tasks_failed == 1 and worker.stats.tasks_lost == 0


# -------------------------------------------------------------------------------- small parts
def test_policy_uris() -> None:
    assert path_from_uri("file:///srv/out/published/v000010") == "/srv/out/published/v000010"
    assert path_from_uri("file://localhost/a%20b") == "/a b"
    assert path_from_uri("/plain/path") == "/plain/path"
    with pytest.raises(ValueError, match="not supported"):
        path_from_uri("s3://bucket/model")
    with pytest.raises(ValueError, match="host"):
        path_from_uri("file://otherhost/x")


def test_config_refusals() -> None:
    with pytest.raises(ValueError, match="lease_seconds"):
        WorkerConfig(pools=["p"], runs=["r"], lease_seconds=0)
    with pytest.raises(ValueError, match="temperature"):
        WorkerConfig(pools=["p"], temperature=0)
    with pytest.raises(ValueError, match="min_new_tokens"):
        WorkerConfig(pools=["p"], runs=["r"], max_new_tokens=4, min_new_tokens=8)
    with pytest.raises(ValueError, match="pools"):
        WorkerConfig(pools=[])
    with pytest.raises(ValueError, match="pools"):
        WorkerConfig(pools=["p", "p"])
    with pytest.raises(ValueError, match="runs"):
        WorkerConfig(pools=["p"], runs=[])
    with pytest.raises(ValueError, match="retry_budget_s"):
        WorkerConfig(pools=["p"], retry_budget_s=-1)


def test_json_log_lines() -> None:
    stream = io.StringIO()
    configure_json_logging("INFO", stream)
    try:
        logging.getLogger("exgrpo_rollout.test").info("task_completed", extra=fields(task=3, event="x"))
        logging.getLogger("other").warning("plain %s", "message")
    finally:
        logging.getLogger().handlers.clear()
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["event"] == "task_completed" and first["task"] == 3 and first["field_event"] == "x"
    assert (
        first["level"] == "info"
        and first["logger"] == "exgrpo_rollout.test"
        and first["ts"].endswith("+00:00")
    )
    assert second["event"] == "plain message" and second["level"] == "warning"
    assert isinstance(JsonFormatter().format(logging.makeLogRecord({"msg": "m"})), str)


def test_prometheus_metrics_are_served() -> None:
    metrics = WorkerMetrics()
    metrics.tokens_per_second.set(1234.5)
    metrics.grading_seconds.observe(0.2)
    metrics.tasks_completed.inc(2)
    metrics.serve(0, addr="127.0.0.1")
    try:
        port = metrics._server.server_address[1]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        metrics.close()
    assert "exgrpo_worker_tokens_per_second 1234.5" in text
    assert 'exgrpo_worker_grading_seconds_bucket{le="0.25"} 1.0' in text
    assert "exgrpo_worker_tasks_completed_total 2.0" in text
    assert "exgrpo_worker_policy_version -1.0" in text


# ------------------------------------------------------------------------------- vLLM, faked
class _FakeLLM:
    instances: list[_FakeLLM] = []
    refuse_logprobs_mode = False

    def __init__(self, **kwargs: Any) -> None:
        if "logprobs_mode" in kwargs and self.refuse_logprobs_mode:
            raise TypeError("__init__() got an unexpected keyword argument 'logprobs_mode'")
        self.kwargs = kwargs
        self.rpc: list[tuple[str, tuple[Any, ...]]] = []
        self.resets = 0
        self.requests: list[Any] = []
        hf_config = types.SimpleNamespace(eos_token_id=TOK.eos_token_id)
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf_config))
        _FakeLLM.instances.append(self)

    def get_tokenizer(self) -> Any:
        return TOK

    def generate(self, requests: list[dict[str, Any]], params: Any, use_tqdm: bool = True) -> list[Any]:
        self.requests.append((requests, params))
        eos = TOK.eos_token_id
        outs = []
        for _ in requests:
            samples = []
            for j in range(params.n):
                ids = [10, 11, eos, 12] if j == 0 else [13, 14, 15]  # vLLM normally stops at the EOS
                steps = [{t: types.SimpleNamespace(logprob=-0.1 * (k + 1))} for k, t in enumerate(ids)]
                samples.append(types.SimpleNamespace(
                    token_ids=ids, logprobs=steps, finish_reason="stop" if j == 0 else "length",
                ))  # fmt: skip
            outs.append(types.SimpleNamespace(outputs=samples))
        return outs

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[int]:
        self.rpc.append((method, args))
        return [7]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type[_FakeLLM]:
    module = types.ModuleType("vllm")
    module.LLM = _FakeLLM  # type: ignore[attr-defined]  # a stand-in vllm module
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]  # stand-in
    monkeypatch.setitem(sys.modules, "vllm", module)
    _FakeLLM.instances.clear()
    _FakeLLM.refuse_logprobs_mode = False
    return _FakeLLM


def test_vllm_engine_converts_outputs(fake_vllm: type[_FakeLLM]) -> None:
    from exgrpo_rollout.engines.vllm import EXTENSION, VLLMEngine

    engine = VLLMEngine("/m", seed=5, tensor_parallel_size=1)
    llm = fake_vllm.instances[-1]
    assert llm.kwargs["worker_extension_cls"] == EXTENSION == "exgrpo_rollout.engines.vllm_ext.WeightReloader"
    assert llm.kwargs["seed"] == 5 and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert not engine.logprobs_are_raw and engine.eos_ids == {TOK.eos_token_id}
    out = engine.generate(
        [[1, 2], [3]], SamplingConfig(n=2, temperature=0.7, max_new_tokens=4, min_new_tokens=1)
    )
    requests, params = llm.requests[-1]
    assert requests == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert (params.n, params.temperature, params.max_tokens, params.min_tokens, params.logprobs) == (
        2,
        0.7,
        4,
        1,
        0,
    )
    assert params.detokenize is False
    first, second = out[0]
    assert first.token_ids == [10, 11, TOK.eos_token_id] and first.logprobs == pytest.approx(
        [-0.1, -0.2, -0.3]
    )
    assert first.finish_reason == "stop" and first.entropies is None
    assert first.text == TOK.decode([10, 11, TOK.eos_token_id], skip_special_tokens=False)
    assert second.token_ids == [13, 14, 15] and second.finish_reason == "length"
    assert engine.last_stats.generated_tokens == 12 and engine.last_stats.completions == 4

    engine.load_weights("/published/v2")
    assert llm.rpc == [("exgrpo_reload_weights", ("/published/v2",))] and llm.resets == 1


def test_vllm_engine_without_logprobs_mode(fake_vllm: type[_FakeLLM]) -> None:
    from exgrpo_rollout.engines.vllm import VLLMEngine, completion_from_output

    fake_vllm.refuse_logprobs_mode = True
    engine = VLLMEngine("/m")
    assert engine.logprobs_are_raw and "logprobs_mode" not in fake_vllm.instances[-1].kwargs
    with pytest.raises(RuntimeError, match="logprobs=0"):
        completion_from_output(
            types.SimpleNamespace(token_ids=[1], logprobs=None, finish_reason="stop"), set()
        )


def test_weight_reloader_reads_every_shard(tmp_path: Path) -> None:
    from exgrpo_rollout.engines.vllm_ext import WeightReloader, safetensors_files

    save_file(
        {"a.weight": torch.ones(2, 2), "b.bias": torch.zeros(3)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file({"c.weight": torch.full((1,), 4.0)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    seen: dict[str, torch.Tensor] = {}

    class Model:
        def load_weights(self, weights: Any) -> set[str]:
            seen.update(weights)
            return set(seen)

    reloader = WeightReloader()
    reloader.model_runner = types.SimpleNamespace(model=Model())
    assert reloader.exgrpo_reload_weights(str(tmp_path)) == 3
    assert sorted(seen) == ["a.weight", "b.bias", "c.weight"] and float(seen["c.weight"]) == 4.0
    one = tmp_path / "model-00002-of-00002.safetensors"
    assert safetensors_files(one) == [one]
    with pytest.raises(ValueError, match="safetensors"):
        safetensors_files(tmp_path / "config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        safetensors_files(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no such"):
        safetensors_files(tmp_path / "missing")


# ------------------------------------------------------------------------------------- the command
def _rollout_params(*args: str) -> dict[str, Any]:
    """The `exgrpo rollout` options as parsed (and checked) by the CLI's own parser, not run."""
    import typer

    from exgrpo_cli.main import app

    group: Any = typer.main.get_command(app)
    ctx = group.make_context("exgrpo", ["rollout", *args])
    name, cmd, rest = group.resolve_command(ctx, ["rollout", *args])
    return dict(cmd.make_context(name, rest, parent=ctx).params)


def test_rollout_command_takes_pools_and_runs_or_all_runs() -> None:
    import typer

    one = _rollout_params("--pool", "p", "--run", "r")
    assert (one["pool"], one["run"], one["all_runs"], one["retry_budget"]) == (["p"], ["r"], False, 600.0)
    fleet = _rollout_params("--pool", "p", "--pool", "q", "--all-runs", "--retry-budget-s", "30")
    assert (fleet["pool"], fleet["all_runs"], fleet["retry_budget"]) == (["p", "q"], True, 30.0)
    assert not fleet["run"]
    assert _rollout_params("--run", "a", "--pool", "p", "--run", "b")["run"] == ["a", "b"]
    for bad, says in (
        (["--pool", "p"], "give --run R (repeatable) or --all-runs"),
        (["--pool", "p", "--run", "r", "--all-runs"], "not both"),
        (["--all-runs", "--pool", "p", "--run", "r"], "not both"),
    ):
        with pytest.raises(typer.BadParameter, match=re.escape(says)):
            _rollout_params(*bad)
