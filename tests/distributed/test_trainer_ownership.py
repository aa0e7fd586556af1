"""Run ownership: a trainer holds its run's writer lease while it trains. A second trainer with the
same run name is refused with an error naming the holder and how to take over; an explicit
take-over fences the first one out at its next write; a trainer that stops cleanly gives the run
back, so the next one resumes it; the lease is renewed in the background while a step runs; a
trainer of two ranks that is fenced out stops on both (rank 0's refusal reaches rank 1)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from exgrpo_client import Client
from exgrpo_client.errors import Conflict
from exgrpo_trainer.config import TrainConfig
from exgrpo_trainer.ownership import RunOwnershipError
from exgrpo_trainer.trainer import Trainer, run_training

from ._helpers import (
    HELD_PARITY,
    HOLD_ENV,
    child_env,
    make_pool,
    read_metrics,
    run_config,
    run_overrides,
    torchrun,
)


def _config(url: str, pool: str, model: Path, out: Path, *overrides: str) -> TrainConfig:
    return run_config(
        url, pool, model, out, "run.name=shared", "schedule.publish_every=0", "schedule.checkpoint_every=1",
        *overrides,
    )  # fmt: skip


def _lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "exgrpo-run-lease" and t.is_alive()]


def test_a_second_trainer_is_refused_and_a_takeover_fences_the_first(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    url = live_server.url
    with Client(url) as client:
        make_pool(client, pool_name)
    first = Trainer(_config(url, pool_name, tiny_model, tmp_path / "first", "run.steps=5"))
    try:
        first.attach()
        first.attach()  # again (as train() does): the same lease, one renewal thread
        assert len(_lease_threads()) == 1
        holder = first.session.holder

        # the same run name again: refused at attach, told who holds the run and how to take over
        second = Trainer(_config(url, pool_name, tiny_model, tmp_path / "second", "run.steps=5"))
        try:
            with pytest.raises(RunOwnershipError) as refused:
                second.attach()
        finally:
            second.close()
        message = str(refused.value)
        assert holder in message and "generation 1" in message
        assert "--takeover" in message and "run.lease_ttl_s" in message

        # an explicit take-over: the new trainer trains, the first is fenced out at its next write
        out = tmp_path / "taker"
        taker = run_training(_config(url, pool_name, tiny_model, out, "run.steps=2", "run.takeover=true"))
        with pytest.raises(RunOwnershipError) as fenced:
            first.train_step()
        assert holder in str(fenced.value) and "no longer owns" in str(fenced.value)
        assert taker.session.holder in str(fenced.value), "names the new owner"
        with pytest.raises(RunOwnershipError):  # and stays out
            first.train_step()
    finally:
        first.close()  # the lost lease is not released: the owner's stays
    assert _lease_threads() == [], "every renewal thread ends with its trainer"

    with Client(url) as client:
        # the run's steps and curve are the new owner's alone
        assert client.get_run(pool_name, "shared").step == 2
        stored = {m.step: m.metrics for m in client.run_metrics(pool_name, "shared").data}
        local = read_metrics(out)
        assert sorted(stored) == [1, 2]
        for m in local:
            assert stored[int(m["step"])]["batch/solved"] == m["batch/solved"]

        # the taker stopped cleanly and gave the run back: the next trainer resumes without take-over
        resumed = run_training(_config(url, pool_name, tiny_model, out, "run.steps=3"))
        assert resumed.step == 3 and resumed.policy_version == 0
        assert client.get_run(pool_name, "shared").step == 3
        assert client.acquire_run_lease(pool_name, "shared", "someone-else", ttl_s=5).generation > 3


def test_the_lease_is_renewed_while_a_step_runs(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    url = live_server.url
    # a lifetime of 3 s, renewed every second: the service shares this process and a busy CI
    # machine with other tests, and a lifetime of 1 s once lapsed there between two renewals
    refusals: list[str] = []
    with Client(url) as client:
        make_pool(client, pool_name)

        def slow_hook(trainer: Trainer, metrics: dict[str, float]) -> bool:
            time.sleep(6.5)  # over two lease lifetimes: only renewals keep the run owned
            try:
                client.acquire_run_lease(pool_name, "shared", "intruder", ttl_s=5)
            except Conflict as e:
                refusals.append(e.detail)
            return False

        cfg = _config(url, pool_name, tiny_model, tmp_path / "out", "run.steps=2", "run.lease_ttl_s=3")
        trainer = run_training(cfg, on_step=slow_hook)
        assert trainer.step == 2
        assert len(refusals) == 2 and all(trainer.session.holder in r for r in refusals)
        # given back at the end: free for anyone
        assert client.acquire_run_lease(pool_name, "shared", "intruder", ttl_s=5).holder == "intruder"


@pytest.mark.timeout(300)
def test_a_fenced_trainer_of_two_ranks_stops_on_both(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    url = live_server.url
    hold = tmp_path / "hold"
    hold.touch()
    with Client(url) as client:
        make_pool(client, pool_name)
        settings = run_overrides(
            url, pool_name, tiny_model, tmp_path / "out", "run.name=shared", "run.steps=3",
            f"rollout.grader={HELD_PARITY}",
        )  # fmt: skip
        env = {**child_env(), HOLD_ENV: str(hold)}
        command = torchrun(2, "-m", "exgrpo_trainer", *settings)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not Path(f"{hold}.reached").exists():  # rank 0 grades its first step
                assert proc.poll() is None and time.monotonic() < deadline, "the trainer never reached a step"
                time.sleep(0.1)
            client.acquire_run_lease(pool_name, "shared", "operator", ttl_s=60, takeover=True)
            hold.unlink()
            output, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = output.decode(errors="replace")
        assert proc.returncode != 0, text[-3000:]
        assert text.count("error: this trainer") == 1, "rank 0 says it, once"
        assert "no longer owns run shared" in text and "operator" in text
        assert client.get_run(pool_name, "shared").step == 0, "the fenced step was not committed"
