"""Rollout workers against a real pool service, with the transformers engine and a tiny model:
two workers share a batch, a killed worker's task is redone after its lease expires, SIGTERM fails
the in-flight task back; one worker serves two runs of a pool, each task generated with exactly the
policy version of its own run (checked on the sampler's log-probs against each version's weights),
and an exact task whose version cannot be loaded is failed back, never served with other weights;
a worker without a model folder starts from a policy published over HTTP."""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_client import Client
from exgrpo_client.schemas import BatchPlan, SamplingParams, decode_ids, decode_logprobs
from exgrpo_onebox.tiny import build_tiny_model
from exgrpo_rollout.engines.factory import load_engine
from exgrpo_rollout.graders import GradingPool
from exgrpo_rollout.prompts import render_prompt
from exgrpo_rollout.worker import TEST_DELAY_ENV, RolloutWorker, Weights, WorkerConfig
from exgrpo_trainer.publisher import HttpPublisher

pytestmark = pytest.mark.timeout(300)

K, B = 4, 4
RUN = "r1"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # two workers generate in parallel threads here: one intra-op thread each avoids oversubscription
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def grading() -> Iterator[GradingPool]:
    with GradingPool(1) as pool:
        yield pool


@pytest.fixture
def client(live_server: Any) -> Iterator[Client]:
    with Client(live_server.url) as c:
        yield c


def _questions(n: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": [
                {"role": "system", "content": "Think, then put the answer in \\boxed{}."},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "ground_truth": str(2 * i),
            "data_source": "arith",
        }
        for i in range(n)
    ]


def _pool_with_run(client: Client, pool: str, *runs: str) -> None:
    client.create_pool(pool, {"k": K, "batch_size": B})
    client.import_questions(pool, _questions(B + 2))
    for run in runs or (RUN,):
        client.create_run(pool, run)


def _plan(client: Client, pool: str) -> BatchPlan:
    plan = client.plan_batch(pool, RUN, create_tasks=True)
    assert len(plan.fresh) == B and client.batch_status(pool, plan.id).num_tasks == B
    return plan


def _worker(url: str, model: Path, pool: str, worker_id: str, **overrides: Any) -> RolloutWorker:
    engine, tokenizer = load_engine("transformers", str(model), device="cpu", seed=hash(worker_id) % 1000)
    settings: dict[str, Any] = {
        "pools": [pool],
        "runs": [RUN],
        "worker_id": worker_id,
        "lease_seconds": 5.0,
        "grader": "math_think",
        "max_new_tokens": 12,
        "min_new_tokens": 4,
        "max_prompt_len": 256,
        "policy_poll_s": 0.2,
        "heartbeat_s": 1.0,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.2,
        **overrides,
    }
    return RolloutWorker(
        WorkerConfig(**settings),
        engine,
        tokenizer,
        client_factory=lambda: Client(url),
        loaded=Weights(None, None, -1, str(model)),
    )


def _start(worker: RolloutWorker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, name=f"worker-{worker.cfg.worker_id}", daemon=True)
    thread.start()
    return thread


def _stop(*pairs: tuple[RolloutWorker, threading.Thread]) -> None:
    for w, _ in pairs:
        w.request_stop()
    for _, t in pairs:
        t.join(timeout=60)
        assert not t.is_alive()


def _wait(what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _check_results(client: Client, pool: str, plan: BatchPlan) -> None:
    res = client.batch_results(pool, plan.id)
    assert res.complete and len(res.groups) == B
    assert sorted(g.question_id for g in res.groups) == sorted(q.question_id for q in plan.fresh)
    for g in res.groups:
        assert len(g.rollouts) == K
        for r in g.rollouts:
            assert r.token_ids_b64 and r.logprobs_b64 and r.reward in (0.0, 1.0)
            assert r.finish_reason in ("stop", "length") and r.entropy is not None and r.entropy >= 0
    committed = client.commit_batch(pool, plan.id, res.groups)  # what a trainer does with them
    assert committed.step == 1


# ---------------------------------------------------------------------------------------------
def test_two_workers_complete_every_task_exactly_once(
    client: Client, live_server: Any, tiny_model: Path, pool_name: str, grading: GradingPool
) -> None:
    _pool_with_run(client, pool_name)
    plan = _plan(client, pool_name)
    # a short pause after each claim makes the two workers interleave on the 4 tasks
    w1 = _worker(live_server.url, tiny_model, pool_name, "w1", test_delay_s=0.3)
    w2 = _worker(live_server.url, tiny_model, pool_name, "w2", test_delay_s=0.3)
    w2.grading = grading  # one grades in a process pool, the other in process
    pairs = [(w1, _start(w1)), (w2, _start(w2))]
    try:
        _wait("the batch", lambda: client.batch_status(pool_name, plan.id).tasks_completed == B)
    finally:
        _stop(*pairs)

    status = client.batch_status(pool_name, plan.id)
    assert (status.tasks_completed, status.tasks_pending, status.tasks_leased, status.tasks_failed) == (
        B,
        0,
        0,
        0,
    )
    done = w1.stats.completed_ids + w2.stats.completed_ids
    assert len(done) == B and len(set(done)) == B  # each task completed once, by one worker
    assert w1.stats.completed_ids and w2.stats.completed_ids
    assert w1.stats.tasks_lost == w2.stats.tasks_lost == 0
    assert all(a == 1 for a in {**w1.stats.attempts, **w2.stats.attempts}.values())
    assert w1.stats.generated_tokens > 0 and w1.stats.tokens_per_second > 0
    assert w2.stats.grading_calls >= 1
    _check_results(client, pool_name, plan)


# ---------------------------------------------------------------------------------------------
def _spawn(url: str, model: Path, pool: str, worker_id: str, log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "exgrpo_cli.main", "--url", url, "rollout",
        "--pool", pool, "--run", RUN, "--model", str(model), "--worker-id", worker_id,
        "--lease-seconds", "2", "--grading-workers", "0", "--max-new-tokens", "12",
        "--min-new-tokens", "4", "--max-prompt-len", "256", "--backoff-max", "0.2", "--heartbeat", "1",
        "--device", "cpu", "--torch-threads", "1",
    ]  # fmt: skip
    env = {**os.environ, TEST_DELAY_ENV: "300", "TRANSFORMERS_VERBOSITY": "error"}
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def _claimed(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events if e["event"] == "tasks_claimed" for t in e["tasks"]]


def test_killed_worker_task_is_redone_and_sigterm_fails_back(
    client: Client,
    live_server: Any,
    tiny_model: Path,
    pool_name: str,
    tmp_path: Path,
    json_events: Callable[[Path], list[dict[str, Any]]],
) -> None:
    _pool_with_run(client, pool_name)
    plan = _plan(client, pool_name)
    logs = {name: tmp_path / f"{name}.log" for name in ("victim", "quitter")}
    procs = {name: _spawn(live_server.url, tiny_model, pool_name, name, path) for name, path in logs.items()}
    try:
        # both sit on their claimed task (test delay), renewing its 2 s lease
        _wait("two leases", lambda: client.batch_status(pool_name, plan.id).tasks_leased == 2, timeout=180)
        _wait("claim logs", lambda: all(_claimed(json_events(p)) for p in logs.values()))
        held = {name: _claimed(json_events(path)) for name, path in logs.items()}
        assert all(len(ids) == 1 for ids in held.values()), held
        time.sleep(2.5)  # longer than the lease: only the renewals keep the two tasks held
        probe = client.claim_tasks(pool_name, RUN, "probe", max_tasks=B, lease_seconds=60).data
        assert len(probe) == B - 2 and not {t.id for t in probe} & {i for ids in held.values() for i in ids}
        for t in probe:
            assert t.lease_token is not None
            client.fail_task(pool_name, t.id, t.lease_token, "probe", retry=True)

        procs["victim"].kill()  # SIGKILL: nothing is released, the lease just stops being renewed
        procs["victim"].wait(timeout=30)
        procs["quitter"].send_signal(signal.SIGTERM)
        assert procs["quitter"].wait(timeout=60) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    quitter = json_events(logs["quitter"])
    failed_back = [e for e in quitter if e["event"] == "task_failed_back"]
    assert [e["task"] for e in failed_back] == held["quitter"] and failed_back[0]["retry"] is True
    assert quitter[-1]["event"] == "worker_stopped" and quitter[-1]["tasks_released"] == 1
    status = client.batch_status(pool_name, plan.id)
    # the quitter's task is pending again at once; the victim's stays leased until its lease runs out
    assert (status.tasks_pending, status.tasks_leased, status.tasks_completed) == (B - 1, 1, 0)

    rescuer = _worker(live_server.url, tiny_model, pool_name, "rescuer", lease_seconds=2.0)
    pair = (rescuer, _start(rescuer))
    try:
        _wait("the batch", lambda: client.batch_status(pool_name, plan.id).tasks_completed == B)
    finally:
        _stop(pair)
    victim_task, quitter_task = held["victim"][0], held["quitter"][0]
    assert (
        sorted(rescuer.stats.completed_ids) == sorted(rescuer.stats.attempts)
        and len(rescuer.stats.attempts) == B
    )
    # every task's second attempt (victim, quitter, probe), and the killed task's after its lease ran out
    assert rescuer.stats.attempts == {t: 2 for t in rescuer.stats.completed_ids}
    assert {victim_task, quitter_task} <= set(rescuer.stats.completed_ids)
    _check_results(client, pool_name, plan)


# ---------------------------------------------------------------------------------------------
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=10, min_tokens=3)


def _perturbed_copy(model: Path, out: Path, seed: int) -> Path:
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    net.save_pretrained(out)
    return out


def _publish(client: Client, pool: str, run: str, version: int, folder: Path) -> None:
    client.add_policy_version(pool, run, version=version, uri=folder.resolve().as_uri(), step=version)


def _teacher_logprobs(
    net: Any, prompt: list[int], response: list[int], eos_ids: set[int], min_tokens: int
) -> torch.Tensor:
    """Log-probs of `response` after `prompt` under `net` at temperature 1, with the EOS masked
    before `min_tokens` as the sampler masks it."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = net(ids).logits[0, len(prompt) - 1 : -1].float()
    logits[:min_tokens, sorted(eos_ids)] = float("-inf")
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_one_worker_serves_two_runs_each_with_its_own_versions(
    client: Client, live_server: Any, tiny_model: Path, pool_name: str, tmp_path: Path
) -> None:
    _pool_with_run(client, pool_name, "ra", "rb")
    folders = {
        ("ra", 0): tiny_model,
        ("ra", 1): _perturbed_copy(tiny_model, tmp_path / "ra-v1", seed=1),
        ("rb", 0): _perturbed_copy(tiny_model, tmp_path / "rb-v0", seed=2),
        ("rb", 1): _perturbed_copy(tiny_model, tmp_path / "rb-v1", seed=3),
    }
    for (run, version), folder in folders.items():
        _publish(client, pool_name, run, version, folder)
    # run ra plans at its version 1, run rb at its version 0 (not its newest): exact tasks
    plans = {
        "ra": client.plan_batch(pool_name, "ra", create_tasks=True, policy_version=1, sampling=SAMPLING),
        "rb": client.plan_batch(pool_name, "rb", create_tasks=True, policy_version=0, sampling=SAMPLING),
    }
    wanted = {"ra": 1, "rb": 0}
    # every run of the pool, through the pool-wide claim; the tasks' sampling settings, not the flags
    worker = _worker(
        live_server.url, tiny_model, pool_name, "fleet", runs=None, tasks_per_claim=2, max_new_tokens=64
    )
    pair = (worker, _start(worker))
    try:
        for run, plan in plans.items():
            _wait(f"run {run}", lambda p=plan: client.batch_status(pool_name, p.id).tasks_completed == B)
    finally:
        _stop(pair)
    assert worker.stats.tasks_failed == worker.stats.tasks_lost == 0
    assert worker.stats.completed_by_run == {f"{pool_name}/ra": B, f"{pool_name}/rb": B}

    tokenizer = worker.tokenizer
    eos_ids: set[int] = worker.engine.eos_ids  # type: ignore[attr-defined]  # a TransformersEngine
    nets = {key: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32) for key, f in folders.items()}
    for run, plan in plans.items():
        res = client.batch_results(pool_name, plan.id)
        assert res.complete and len(res.groups) == B
        prompts = {q.question_id: q.prompt for q in plan.fresh}
        for g in res.groups:
            assert g.policy_version == wanted[run]  # what the worker reported, stored by the pool
            prompt = render_prompt(tokenizer, prompts[g.question_id], False, 256)
            for r in g.rollouts:
                assert r.token_ids_b64 and r.logprobs_b64
                response = decode_ids(r.token_ids_b64).tolist()
                sampled = torch.from_numpy(decode_logprobs(r.logprobs_b64).copy())
                assert SAMPLING.min_tokens <= len(response) <= SAMPLING.max_tokens  # the task's settings
                gaps = {
                    key: float(
                        (_teacher_logprobs(net, prompt, response, eos_ids, SAMPLING.min_tokens) - sampled)
                        .abs()
                        .mean()
                    )
                    for key, net in nets.items()
                }
                # generated with exactly the run's planned version, and with no other weights
                assert gaps[(run, wanted[run])] < 1e-3, gaps
                assert all(gap > 0.05 for key, gap in gaps.items() if key != (run, wanted[run])), gaps
        committed = client.commit_batch(pool_name, plan.id, res.groups)
        assert committed.step == 1


def test_exact_task_whose_version_cannot_be_loaded_is_failed_back(
    client: Client, live_server: Any, tiny_model: Path, pool_name: str, tmp_path: Path, caplog: Any
) -> None:
    _pool_with_run(client, pool_name)
    _publish(client, pool_name, RUN, 0, tiny_model)
    _publish(client, pool_name, RUN, 1, tmp_path / "never-written")  # registered, files missing
    plan = client.plan_batch(pool_name, RUN, create_tasks=True, policy_version=1, sampling=SAMPLING)
    worker = _worker(live_server.url, tiny_model, pool_name, "strict")
    caplog.set_level(logging.INFO, logger="exgrpo_rollout.worker")
    pair = (worker, _start(worker))
    try:
        # every attempt of every task is failed back, until the pool gives up on them
        _wait("the failed tasks", lambda: client.batch_status(pool_name, plan.id).tasks_failed == B)
    finally:
        _stop(pair)
    status = client.batch_status(pool_name, plan.id)
    assert (status.tasks_completed, status.tasks_failed) == (0, B)
    assert worker.stats.tasks_completed == 0 and worker.stats.samples == 0  # nothing generated at all
    assert worker.stats.tasks_failed == 3 * B  # the pool's task_max_attempts
    unavailable = [r for r in caplog.records if r.getMessage() == "policy_unavailable"]
    assert unavailable and all("never-written" in r.fields["error"] for r in unavailable)
    res = client.batch_results(pool_name, plan.id)
    assert not res.groups


# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_worker_rides_through_a_restart_of_the_pool(
    start_live_server: Callable[..., Any], tiny_model: Path, tmp_path: Path, caplog: Any
) -> None:
    db, port, pool = f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", _free_port(), "outage"
    url = f"http://127.0.0.1:{port}"
    # the SDK gives up after one quick retry here: what rides through the outage is the worker itself
    factory = functools.partial(Client, url, retries=1, backoff=0.05)
    engine, tokenizer = load_engine("transformers", str(tiny_model), device="cpu", seed=7)
    settings = WorkerConfig(
        pools=[pool],
        runs=[RUN],
        worker_id="steady",
        lease_seconds=60.0,
        tasks_per_claim=B,
        max_new_tokens=12,
        min_new_tokens=4,
        max_prompt_len=256,
        heartbeat_s=1.0,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
        test_delay_s=3.0,  # holds the claimed tasks while the pool goes down
    )
    worker = RolloutWorker(settings, engine, tokenizer, client_factory=factory)
    caplog.set_level(logging.INFO, logger="exgrpo_rollout.worker")
    with start_live_server(db, port=port), Client(url) as client:
        _pool_with_run(client, pool)
        _publish(client, pool, RUN, 0, tiny_model)  # the tasks name their uri: no listing needed
        plan = _plan(client, pool)
        pair = (worker, _start(worker))
        _wait("the claim", lambda: client.batch_status(pool, plan.id).tasks_leased == B)
    try:  # the pool is down: the worker generates, its completions and claims fail
        _wait("a failed completion", lambda: any(r.getMessage() == "complete_retry" for r in caplog.records))
        time.sleep(1.0)
        assert pair[1].is_alive() and worker.stats.tasks_completed == 0
        with start_live_server(db, port=port), Client(url) as client:  # the same pool, restarted
            _wait("the batch", lambda: client.batch_status(pool, plan.id).tasks_completed == B)
            _wait("the worker's count", lambda: worker.stats.tasks_completed == B)
            assert pair[1].is_alive()  # it never exited
            _stop(pair)
            _check_results(client, pool, plan)
    finally:
        if pair[1].is_alive():
            _stop(pair)
    # completed with the lease of the first claim: no task was redone
    assert worker.stats.attempts == {t: 1 for t in worker.stats.completed_ids}
    assert worker.stats.generated_with == {t: 0 for t in worker.stats.completed_ids}
    assert worker.stats.tasks_lost == worker.stats.tasks_failed == 0


def test_worker_without_a_model_starts_from_a_policy_published_over_http(
    live_server: Any, client: Client, tiny_model: Path
) -> None:
    """`exgrpo rollout` without --model builds its engine from the run's newest policy, here one the
    trainer serves from memory over HTTP, and completes the batch's tasks with that version."""
    pool = "http-start"
    _pool_with_run(client, pool)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    publisher = HttpPublisher(keep=1)
    try:
        uri = publisher.publish(model, tokenizer, pool, RUN, 0)
        client.add_policy_version(pool, RUN, 0, uri)
        plan = client.plan_batch(pool, RUN, create_tasks=True, policy_version=0)
        command = [
            sys.executable, "-m", "exgrpo_cli.main", "--url", live_server.url, "rollout",
            "--pool", pool, "--run", RUN, "--worker-id", "no-model", "--grader", "math_think",
            "--grading-workers", "0", "--max-new-tokens", "8", "--max-tasks", str(B),
            "--device", "cpu", "--torch-threads", "1", "--backoff-max", "0.2",
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        publisher.close()
    res = client.batch_results(pool, plan.id)
    assert res.complete and len(res.groups) == B
    assert {g.policy_version for g in res.groups} == {0}
