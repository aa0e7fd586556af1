"""The trainer with `rollout.engine=remote`: it plans batches with generation tasks, and two real
`exgrpo rollout` worker processes claim, generate, grade and complete them against the live
service. Synchronous mode (the default): the trainer publishes its initial weights as version 0 at
attach and its weights after every step, every batch names the trainer's current version and
sampling settings, and every fresh rollout is generated with exactly that version; by the third
step the run is mixed and a replayed question gets its K-1 fresh rollouts from the workers.
Asynchronous mode (`rollout.max_policy_lag=1`): each batch is planned before the previous step's
update, and no rollout is more than one version older than the weights that learn from it.

The workers sample without fixed seeds, so the run is not reproducible; the settings make the
path the assertions need all but certain: about half of the tiny model's samples pass the parity
grader, so the first step's solved share is above the 0.05 threshold and the mixed step stores
some partly solved question."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from exgrpo_client import Client
from exgrpo_client import schemas as s
from exgrpo_rollout.worker import TEST_DELAY_ENV
from exgrpo_trainer.config import TrainConfig
from exgrpo_trainer.trainer import run_training

from ._helpers import RecordingClient, child_env, make_pool, read_metrics, run_config

STEPS = 3
WORKERS = ("w1", "w2")
LOGPROB_GAP_TOL = 1e-4
"""The worker's engine (incremental decoding with a KV cache) and the trainer's scoring (one
forward over prompt and response) in float32 on CPU agree per token to about 1e-6; 1e-4 is the
per-token tolerance the comparison below uses. The tests sample with rollout.min_new_tokens=0: the
sampler's EOS mask over the first min_new_tokens positions is a real difference between the two
distributions (about 3e-3 on average for the tiny model with 4 such positions)."""


def _worker_command(url: str, cfg: TrainConfig, worker_id: str) -> list[str]:
    """`exgrpo rollout` for the trainer's run, sampling and rendering prompts as its config says."""
    r = cfg.rollout
    return [
        sys.executable, "-m", "exgrpo_cli.main", "--url", url, "rollout",
        "--pool", cfg.run.pool, "--run", cfg.run.name, "--model", str(cfg.model.path),
        "--worker-id", worker_id, "--grader", r.grader, "--grading-workers", "0",
        "--temperature", str(r.temperature), "--top-p", str(r.top_p),
        "--max-new-tokens", str(r.max_new_tokens), "--min-new-tokens", str(r.min_new_tokens),
        "--max-prompt-len", str(cfg.model.max_prompt_len),
        *(["--drop-system"] if cfg.model.drop_system_prompt else []),
        "--lease-seconds", "30", "--backoff-max", "0.2", "--policy-poll", "0.5", "--heartbeat", "5",
        "--device", "cpu", "--torch-threads", "1",
    ]  # fmt: skip


def _wait_started(
    procs: dict[str, subprocess.Popen[bytes]],
    logs: dict[str, Path],
    events: Callable[[Path], list[dict[str, Any]]],
) -> None:
    """Until every worker has its engine loaded and serves (a worker that exits fails the test)."""
    end = time.monotonic() + 120
    waiting = set(procs)
    while waiting:
        for name in sorted(waiting):
            assert procs[name].poll() is None, logs[name].read_text()[-3000:]
            if any(e["event"] == "worker_started" for e in events(logs[name])):
                waiting.discard(name)
        assert time.monotonic() < end, f"workers {sorted(waiting)} did not start"
        time.sleep(0.2)


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, int]:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            codes[name] = p.wait()
    return codes


@contextmanager
def _workers(
    url: str, cfg: TrainConfig, tmp_path: Path, json_events: Callable[[Path], list[dict[str, Any]]]
) -> Iterator[tuple[dict[str, Path], dict[str, int]]]:
    """Two `exgrpo rollout` processes serving the trainer's run (which must exist); yields their
    log files and, once the block is left, their exit codes (filled in after SIGTERM)."""
    logs = {w: tmp_path / f"{w}.log" for w in WORKERS}
    codes: dict[str, int] = {}
    # a short pause after each claim lets the two workers share every batch
    env = {**child_env(), TEST_DELAY_ENV: "0.2"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for w, log in logs.items():
            with open(log, "wb") as f:
                procs[w] = subprocess.Popen(
                    _worker_command(url, cfg, w), stdout=f, stderr=subprocess.STDOUT, env=env
                )
        _wait_started(procs, logs, json_events)
        yield logs, codes
    finally:
        codes.update(_stop(procs))


def _shape(groups: list[s.GroupResult]) -> Counter[tuple[int, int]]:
    return Counter((g.question_id, len(g.rollouts)) for g in groups)


def _payload(r: s.RolloutResult) -> tuple[list[int], list[float]]:
    return s.unpack_ids(r.token_ids_b64 or ""), s.unpack_logprobs(r.logprobs_b64 or "")


@dataclass
class _Outcome:
    """What a remote run left: the client that recorded its plans and commits, the pool's view of
    each batch and of the run, the workers' logs and exit codes."""

    client: RecordingClient
    k: int
    statuses: list[s.BatchStatusPublic]
    results: list[s.BatchResults]
    stats: s.RunStats
    run: s.RunPublic
    versions: list[int]
    logs: dict[str, Path]
    codes: dict[str, int]


def _train_with_workers(
    url: str, pool: str, cfg: TrainConfig, tmp_path: Path, json_events: Callable[[Path], list[dict[str, Any]]]
) -> _Outcome:
    """A pool that switches early, two workers, and the trainer's run to its end."""
    with RecordingClient(url) as client:
        make_pool(client, pool, start_threshold=0.05)
        # workers stop at once when their run does not exist: create it as the trainer would
        client.create_run(pool, cfg.run.name, seed=cfg.run.seed)
        with _workers(url, cfg, tmp_path, json_events) as (logs, codes):
            run_training(cfg, client=client)
        return _Outcome(
            client=client,
            k=client.get_pool(pool).config.k,
            statuses=[client.batch_status(pool, p.id) for p in client.plans],
            results=[client.batch_results(pool, p.id) for p in client.plans],
            stats=client.run_stats(pool, cfg.run.name),
            run=client.get_run(pool, cfg.run.name),
            versions=[v.version for v in client.list_policy_versions(pool, cfg.run.name).data],
            logs=logs,
            codes=codes,
        )


def _remote_config(url: str, pool: str, model: Path, out: Path, steps: int, *extra: str) -> TrainConfig:
    """A remote run of `steps` steps, sampled without an EOS mask (see LOGPROB_GAP_TOL)."""
    return run_config(
        url,
        pool,
        model,
        out,
        "rollout.engine=remote",
        "rollout.results_timeout_s=120",
        "rollout.min_new_tokens=0",
        f"run.steps={steps}",
        "schedule.checkpoint_every=0",
        *extra,
    )


@pytest.mark.timeout(300)
def test_trainer_learns_from_two_rollout_workers(
    live_server: Any,
    pool_name: str,
    tiny_model: Path,
    tmp_path: Path,
    json_events: Callable[[Path], list[dict[str, Any]]],
) -> None:
    out = tmp_path / "run"
    # remote workers: the trainer publishes every step, whatever schedule.publish_every says
    cfg = _remote_config(live_server.url, pool_name, tiny_model, out, STEPS, "schedule.publish_every=10")
    done_run = _train_with_workers(live_server.url, pool_name, cfg, tmp_path, json_events)
    client, k, statuses, results = done_run.client, done_run.k, done_run.statuses, done_run.results
    stats, run, logs, codes = done_run.stats, done_run.run, done_run.logs, done_run.codes

    # the workers exit cleanly on SIGTERM, holding nothing
    events = {w: json_events(log) for w, log in logs.items()}
    assert codes == dict.fromkeys(WORKERS, 0), {w: logs[w].read_text()[-3000:] for w in WORKERS}
    for w in WORKERS:
        stopped = events[w][-1]
        assert stopped["event"] == "worker_stopped", events[w][-3:]
        assert (stopped["tasks_released"], stopped["tasks_failed"], stopped["tasks_lost"]) == (0, 0, 0)

    # every planned task was completed by a worker, once, with the group sizes the plan asks for
    assert [p.step for p in client.plans] == list(range(1, STEPS + 1))
    assert [p.phase for p in client.plans] == ["on_policy", "mixed", "mixed"]
    done = {w: [e for e in events[w] if e["event"] == "task_completed"] for w in WORKERS}
    assert all(done.values()), "both workers took part"
    completed = sorted((e for w in WORKERS for e in done[w]), key=lambda e: e["task"])
    assert len({e["task"] for e in completed}) == len(completed) == sum(st.num_tasks for st in statuses)
    first = 0
    for plan, status, res in zip(client.plans, statuses, results, strict=True):
        # a replayed question's task asks for the K-1 fresh samples beside its stored trajectory
        expected = Counter(
            [(q.question_id, k) for q in plan.fresh] + [(q.question_id, k - 1) for q in plan.replay]
        )
        assert status.status == "committed" and status.num_tasks == len(plan.fresh) + len(plan.replay)
        assert (status.tasks_completed, status.tasks_pending, status.tasks_leased, status.tasks_failed) == (
            status.num_tasks,
            0,
            0,
            0,
        )
        assert res.complete and _shape(res.groups) == expected
        # a batch's tasks are created together, after the previous batch was committed
        mine = completed[first : first + status.num_tasks]
        first += status.num_tasks
        assert Counter((e["question"], e["samples"]) for e in mine) == expected
        # ... and generated with exactly the trainer's current version, which the batch names
        # (v0, the initial weights, published at attach; then the weights after each step)
        assert plan.policy_version == plan.step - 1
        assert {e["policy_version"] for e in mine} == {plan.policy_version}
        assert {g.policy_version for g in res.groups} == {plan.policy_version}
    loaded = {w: [e["version"] for e in events[w] if e["event"] == "policy_loaded"] for w in WORKERS}
    assert all(v == sorted(set(v)) and set(v) <= {0, 1, 2, 3} for v in loaded.values()), loaded
    assert any(STEPS - 1 in v for v in loaded.values()), loaded

    # the third step replays: the trainer's groups put the stored trajectory first, then the workers' K-1
    assert client.plans[1].replay == [] and client.plans[2].replay, "the mixed step's pool is replayed"
    compared_steps = set()
    for plan, res, committed in zip(client.plans, results, client.commits, strict=True):
        by_question = {(g.question_id, len(g.rollouts) == k - 1): g for g in res.groups}
        planned = [(q.question_id, False) for q in plan.fresh] + [(q.question_id, True) for q in plan.replay]
        assert Counter((g.question_id, any(r.replayed for r in g.rollouts)) for g in committed) == Counter(
            planned
        )
        for g in committed:
            marks = [r.replayed for r in g.rollouts]
            is_replay = any(marks)
            assert marks == ([True] + [False] * (k - 1) if is_replay else [False] * k)
            generated = g.rollouts[1:] if is_replay else g.rollouts
            source = by_question[(g.question_id, is_replay)]
            # the trainer grades the workers' samples itself and gets the same rewards
            assert [r.reward for r in generated] == [r.reward for r in source.rollouts]
            for ours, theirs in zip(generated, source.rollouts, strict=True):
                if ours.token_ids_b64 is None:
                    continue  # only solved samples are sent with their tokens
                ids, lps = _payload(ours)
                worker_ids, worker_lps = _payload(theirs)
                assert ids == worker_ids
                # the trainer's log-probs (before its update) and the worker's agree: same weights
                np.testing.assert_allclose(lps, worker_lps, atol=1e-4)
                compared_steps.add(plan.step)
    assert compared_steps == set(range(1, STEPS + 1))

    # the trainer's metrics count the workers' rollouts; trajectories and versions are stored
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m, plan in zip(metrics, client.plans, strict=True):
        assert m["batch/rows"] == k * (len(plan.fresh) + len(plan.replay))
        assert m["batch/generated"] == m["batch/rows"] - len(plan.replay)
        assert m["batch/replayed_questions"] == len(plan.replay)
        assert m["response/length_mean"] >= cfg.rollout.min_new_tokens and m["timing/generate"] > 0
    assert metrics[2]["tokens/replay"] > 0 and "is/w_mean" in metrics[2]
    assert stats.trajectories > 0 and metrics[-1]["experience/trajectories"] == stats.trajectories
    assert run.step == STEPS and run.policy_version == STEPS
    assert done_run.versions == [0, 1, 2, 3]
    # on-policy by construction: no lag, and the sampler's log-probs are the trainer's pi_old up to
    # the engines' float32 numerics (and the EOS mask of the first min_new_tokens positions)
    assert [m["rollout/policy_lag_max"] for m in metrics] == [0.0] * STEPS
    assert all(0 <= m["rollout/logprob_gap"] < LOGPROB_GAP_TOL for m in metrics), metrics


# ---------------------------------------------------------------------------------------------
ASYNC_STEPS = 4
MAX_LAG = 1


@pytest.mark.timeout(300)
def test_asynchronous_generation_stays_within_its_lag(
    live_server: Any,
    pool_name: str,
    tiny_model: Path,
    tmp_path: Path,
    json_events: Callable[[Path], list[dict[str, Any]]],
) -> None:
    out = tmp_path / "run"
    cfg = _remote_config(
        live_server.url, pool_name, tiny_model, out, ASYNC_STEPS, f"rollout.max_policy_lag={MAX_LAG}"
    )
    done_run = _train_with_workers(live_server.url, pool_name, cfg, tmp_path, json_events)
    client, k, statuses, results = done_run.client, done_run.k, done_run.statuses, done_run.results
    logs, codes = done_run.logs, done_run.codes
    assert codes == dict.fromkeys(WORKERS, 0), {w: logs[w].read_text()[-3000:] for w in WORKERS}

    # one plan per step, each committed once; the last step plans nothing beyond the run
    assert [p.step for p in client.plans] == list(range(1, ASYNC_STEPS + 1))
    assert [st.status for st in statuses] == ["committed"] * ASYNC_STEPS
    assert [r.step for r in client.commit_results] == list(range(1, ASYNC_STEPS + 1))
    assert done_run.run.step == ASYNC_STEPS and done_run.versions == list(range(ASYNC_STEPS + 1))
    # batch t+1 is planned before the update of step t: the newest version then is t-1
    assert [p.policy_version for p in client.plans] == [0, *range(ASYNC_STEPS - 1)]
    assert "mixed" in {p.phase for p in client.plans} and any(p.replay for p in client.plans)

    # the weights that learn from step t's rollouts are version t-1; no rollout is older than N before
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, ASYNC_STEPS + 1))
    for plan, res, m in zip(client.plans, results, metrics, strict=True):
        used = [plan.policy_version if g.policy_version is None else g.policy_version for g in res.groups]
        assert all(0 <= plan.step - 1 - v <= MAX_LAG for v in used), (plan.step, used)
        assert m["rollout/policy_lag_max"] == plan.step - 1 - min(used)
        assert 0 <= m["rollout/policy_lag_max"] <= MAX_LAG
        assert m["rollout/logprob_gap"] >= 0 and "loss/total" in m and "actor/old_entropy" in m
    assert metrics[0]["rollout/policy_lag_max"] == 0  # the first batch is generated with v0

    # collected trajectories store the sampler's log-probs as pi_past, and its entropies
    stored = 0
    for res, committed in zip(results, client.commits, strict=True):
        by_question = {(g.question_id, len(g.rollouts) == k - 1): g for g in res.groups}
        for g in committed:
            is_replay = any(r.replayed for r in g.rollouts)
            generated = g.rollouts[1:] if is_replay else g.rollouts
            source = by_question[(g.question_id, is_replay)]
            for ours, theirs in zip(generated, source.rollouts, strict=True):
                assert ours.entropy == theirs.entropy
                if ours.token_ids_b64 is not None:
                    ids, lps = _payload(ours)
                    worker_ids, worker_lps = _payload(theirs)
                    assert ids == worker_ids and lps == [min(x, 0.0) for x in worker_lps]
                    stored += 1
    assert stored > 0


# ---------------------------------------------------------------------------------------------
def _fail_every_task(url: str, pool: str, run: str, stop: threading.Event) -> None:
    """A broken worker: every task it claims fails for good (as after its last attempt)."""
    with Client(url) as client:
        while not stop.is_set():
            for task in client.claim_tasks(pool, run, "broken", 10, 30.0).data:
                assert task.lease_token is not None
                client.fail_task(pool, task.id, task.lease_token, "engine crashed", retry=False)
            stop.wait(0.05)


@pytest.mark.timeout(120)
def test_a_task_that_fails_for_good_stops_the_trainer(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    cfg = run_config(
        live_server.url,
        pool_name,
        tiny_model,
        tmp_path / "run",
        "rollout.engine=remote",
        "rollout.results_timeout_s=600",
        "run.steps=1",
        "schedule.publish_every=0",
    )
    with Client(live_server.url) as client:
        make_pool(client, pool_name)
        client.create_run(pool_name, cfg.run.name, seed=cfg.run.seed)
    stop = threading.Event()
    broken = threading.Thread(target=_fail_every_task, args=(live_server.url, pool_name, cfg.run.name, stop))
    broken.start()
    start = time.monotonic()
    try:
        # no worker can finish the batch any more: the trainer says so at once, not after the timeout
        with pytest.raises(RuntimeError, match=r"4 generation tasks failed for good"):
            run_training(cfg)
    finally:
        stop.set()
        broken.join(timeout=30)
    assert time.monotonic() - start < 20
    with Client(live_server.url) as client:
        assert client.get_run(pool_name, cfg.run.name).step == 0  # nothing was committed
