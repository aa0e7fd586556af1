"""The trainer with `rollout.engine=remote`: it plans batches with generation tasks, and two real
`exgrpo rollout` worker processes claim, generate, grade and complete them against the live
service. The trainer publishes after every step and the workers must generate each batch with
the policy it was planned with; by the third step the run is mixed and a replayed question gets
its K-1 fresh rollouts from the workers.

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
from collections.abc import Callable
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


def _shape(groups: list[s.GroupResult]) -> Counter[tuple[int, int]]:
    return Counter((g.question_id, len(g.rollouts)) for g in groups)


def _payload(r: s.RolloutResult) -> tuple[list[int], list[float]]:
    return s.unpack_ids(r.token_ids_b64 or ""), s.unpack_logprobs(r.logprobs_b64 or "")


@pytest.mark.timeout(300)
def test_trainer_learns_from_two_rollout_workers(
    live_server: Any,
    pool_name: str,
    tiny_model: Path,
    tmp_path: Path,
    json_events: Callable[[Path], list[dict[str, Any]]],
) -> None:
    out = tmp_path / "run"
    cfg = run_config(
        live_server.url,
        pool_name,
        tiny_model,
        out,
        "rollout.engine=remote",
        "rollout.results_timeout_s=120",
        f"run.steps={STEPS}",
        "schedule.publish_every=1",
        "schedule.checkpoint_every=0",
    )
    logs = {w: tmp_path / f"{w}.log" for w in WORKERS}
    with RecordingClient(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.05)
        k = client.get_pool(pool_name).config.k
        # workers stop at once when their run does not exist: create it as the trainer would
        client.create_run(pool_name, cfg.run.name, seed=cfg.run.seed)
        # a short pause after each claim lets the two workers share every batch
        env = {**child_env(), TEST_DELAY_ENV: "0.2"}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for w, log in logs.items():
                with open(log, "wb") as f:
                    command = _worker_command(live_server.url, cfg, w)
                    procs[w] = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env)
            _wait_started(procs, logs, json_events)
            run_training(cfg, client=client)
        finally:
            codes = _stop(procs)
        statuses = [client.batch_status(pool_name, p.id) for p in client.plans]
        results = [client.batch_results(pool_name, p.id) for p in client.plans]
        stats = client.run_stats(pool_name, cfg.run.name)
        run = client.get_run(pool_name, cfg.run.name)
        versions = client.list_policy_versions(pool_name, cfg.run.name)

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
        # ... and generated with the policy the batch was planned with (published after each step)
        assert plan.policy_version == plan.step - 1
        assert {e["policy_version"] for e in mine} == {plan.policy_version if plan.step > 1 else -1}
    loaded = {w: [e["version"] for e in events[w] if e["event"] == "policy_loaded"] for w in WORKERS}
    assert all(v == sorted(set(v)) and set(v) <= {1, 2, 3} for v in loaded.values()), loaded
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
                # the trainer's log-probs (before its update) and the worker's agree: same weights.
                # The first min_new_tokens positions differ a little (the worker masks EOS there).
                tail = cfg.rollout.min_new_tokens
                np.testing.assert_allclose(lps[tail:], worker_lps[tail:], atol=1e-4)
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
    assert [v.version for v in versions.data] == [1, 2, 3]


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
