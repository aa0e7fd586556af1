"""The trainer reconciles with the pool's view of its run, never guessing: a commit refused because
its batch is already committed takes the pool's result of that commit, and a trainer resumed from a
checkpoint older than the pool's step continues from the pool's step, naming the lost updates in one
log line and recording their count once as `run/lost_updates`; with remote workers it publishes its
own weights as the pool's version, so the workers generate with what the trainer holds."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from exgrpo_client import Client, rollout
from exgrpo_client import schemas as s
from exgrpo_client.errors import Conflict
from exgrpo_trainer.config import RunSection
from exgrpo_trainer.pool_session import PoolSession
from exgrpo_trainer.trainer import Trainer, run_training

from ._helpers import make_pool, read_metrics, run_config


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _groups(plan: s.BatchPlan, reward: float) -> list[s.GroupResult]:
    return [
        s.GroupResult(question_id=q.question_id, rollouts=[rollout(reward, None, None)] * plan.k)
        for q in plan.fresh
    ]


def test_a_commit_of_a_committed_batch_takes_the_pools_result(
    live_server: Any, pool_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with Client(live_server.url) as client:
        make_pool(client, pool_name)
        session = PoolSession(
            RunSection(pool_url=live_server.url, pool=pool_name), s.RunOverrides(), client=client
        )
        try:
            session.attach()
            plan = session.plan(create_tasks=False)
            # an earlier attempt of this commit went through, but its answer never came back
            first = client.commit_batch(pool_name, plan.id, _groups(plan, 0.0), policy_version=0)
            with caplog.at_level(logging.WARNING, logger="exgrpo.trainer"):
                # other groups: the service refuses them (409), the session reads the batch's status
                again = session.commit(plan, _groups(plan, 1.0), 0, {})
            assert (again.batch_id, again.step, again.solved_fraction) == (plan.id, 1, 0.0)
            assert (again.stored_trajectories, again.retired) == (first.stored_trajectories, first.retired)
            assert f"batch {plan.id} (step 1) was already committed" in caplog.text
            assert client.get_run(pool_name, "run-1").step == 1

            # a refusal for another reason is not taken for a commit: an abandoned batch
            open_plan = session.plan(create_tasks=False)
            client.plan_batch(pool_name, "run-1", replan=True)
            with pytest.raises(Conflict, match="abandoned"):
                session.commit(open_plan, _groups(open_plan, 0.0), 0, {})
        finally:
            session.close()


@pytest.mark.timeout(300)
def test_resuming_behind_the_pool_names_the_lost_updates(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    settings = ("schedule.checkpoint_every=2", "schedule.publish_every=1")
    with Client(live_server.url) as client:
        make_pool(client, pool_name)
    run_training(run_config(live_server.url, pool_name, tiny_model, out, "run.steps=3", *settings))
    # the trainer died after committing step 3 but before its checkpoint was written
    ckpts = out / "checkpoints" / pool_name / "run-1"
    shutil.rmtree(ckpts / "step-000003")
    (ckpts / "latest").write_text("step-000002")
    published = out / "published" / pool_name / "run-1"
    assert not _same_weights(published / "v000003", published / "v000002")

    # a trainer with remote workers publishes its weights as the pool's version at attach: after
    # lost updates the version its first plan names holds the checkpoint's weights, not the lost ones
    remote = Trainer(
        run_config(live_server.url, pool_name, tiny_model, out, "rollout.engine=remote", *settings)
    )
    try:
        remote.attach()
        assert (remote.step, remote.policy_version, remote.lost_updates) == (3, 3, 1)
    finally:
        remote.close()
    assert _same_weights(published / "v000003", published / "v000002")
    caplog.clear()

    with caplog.at_level(logging.WARNING, logger="exgrpo.trainer"):
        run_training(run_config(live_server.url, pool_name, tiny_model, out, "run.steps=5", *settings))
    lines = [r.getMessage() for r in caplog.records if "are lost" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "the pool has committed step 3" in lines[0] and "holds the weights after step 2" in lines[0]
    assert "the updates of step 3 are lost" in lines[0]

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]  # the pool's step wins
    assert [m.get("run/lost_updates") for m in metrics] == [None, None, None, 1.0, None]
    with Client(live_server.url) as client:
        assert client.get_run(pool_name, "run-1").step == 5


def test_the_sessions_own_client_retries_for_the_configured_budget() -> None:
    """A pool restart of minutes is ridden through: the client the session opens retries each call
    for `run.retry_budget_s`, not a count of attempts."""
    session = PoolSession(RunSection(retry_budget_s=900.0), s.RunOverrides())
    try:
        assert session.client is not None and session.client.retry_policy.budget_s == 900.0
    finally:
        session.close()
