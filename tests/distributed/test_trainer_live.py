"""The trainer against the real pool service: a tiny random model on synthetic questions, with a
grader it passes about half the time, so a short run switches to the mixed phase and replays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from transformers import AutoTokenizer

from exgrpo_client import decode_trajectory
from exgrpo_trainer.trainer import run_training

from ._helpers import RecordingClient, make_pool, read_metrics, run_config

SPEC_METRICS = (
    "batch/solved",
    "batch/replayed_questions",
    "experience/eligible",
    "experience/retired",
    "experience/trajectories",
    "experience/replay_share",
    "loss/total",
    "loss/pg",
    "loss/pg_fresh",
    "loss/pg_replay",
    "loss/entropy",
    "actor/entropy",
    "response/length_mean",
    "optim/grad_norm",
    "timing/generate",
    "timing/update",
    "timing/step",
    "phase/mixed",
)
IS_METRICS = ("is/w_mean", "is/w_max", "is/w_min", "is/fw_mean")


def test_exgrpo_run_switches_to_mixed_and_replays(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    with RecordingClient(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.2)
        cfg = run_config(
            live_server.url,
            pool_name,
            tiny_model,
            out,
            "run.steps=4",
            "schedule.publish_every=3",
            "schedule.checkpoint_every=2",
        )
        run_training(cfg, client=client)
        run = client.get_run(pool_name, "run-1")
        versions = client.list_policy_versions(pool_name, "run-1")
        stats = client.run_stats(pool_name, "run-1")
        stored = [
            t
            for q in client.iter_questions(pool_name)
            for t in client.question(pool_name, q.id, True).trajectories
        ]

    # every stored trajectory is readable: the text the trainer decoded from its token ids
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert stored and all(t.text is not None for t in stored)
    for t in stored:
        ids, _ = decode_trajectory(t)
        assert t.text == tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        missing = [k for k in SPEC_METRICS if k not in m]
        assert not missing, f"step {m['step']} lacks {missing}"

    # delayed start: the first batch solves more than the threshold, the run switches after it
    assert metrics[0]["batch/solved"] > 0.2
    assert metrics[0]["phase/mixed"] == 0.0 and metrics[0]["phase/switched"] == 1.0
    assert run.phase == "mixed" and run.switched_at_step == 1
    assert [p.phase for p in client.plans] == ["on_policy", "mixed", "mixed", "mixed"]
    assert all(m["phase/mixed"] == 1.0 for m in metrics[1:])

    # the first mixed step has an empty pool and collects; later steps replay what it stored
    assert client.plans[1].replay == []
    replay_steps = [i for i, p in enumerate(client.plans) if p.replay]
    assert replay_steps and replay_steps[0] == 2
    stored_before: set[int] = set()
    for i, (plan, groups) in enumerate(zip(client.plans, client.commits, strict=True)):
        replayed_ids = {r.question_id for r in plan.replay}
        assert replayed_ids <= stored_before, f"step {i + 1} replays questions never stored"
        for g in groups:
            marks = [r.replayed for r in g.rollouts]
            assert len(marks) == plan.k
            is_replay_group = any(marks)
            if is_replay_group:
                assert marks == [True] + [False] * (plan.k - 1), "the replayed row is row 0, marked"
                assert g.question_id in replayed_ids
            elif plan.phase == "mixed" and 0 < sum(r.reward for r in g.rollouts) < plan.k:
                stored_before.add(g.question_id)
        assert sum(any(r.replayed for r in g.rollouts) for g in groups) == len(plan.replay)
        assert metrics[i]["batch/replayed_questions"] == len(plan.replay)
        if plan.replay:
            assert all(k in metrics[i] for k in IS_METRICS), "importance-weight stats when replaying"
            assert metrics[i]["experience/replay_share"] > 0
        else:
            assert not any(k in metrics[i] for k in IS_METRICS)
    assert stats.trajectories > 0 and stats.eligible + stats.retired > 0

    # published weights (step 3, and the final step 4) are registered with the service
    assert [v.version for v in versions.data] == [3, 4]
    assert run.policy_version == 4
    for v in versions.data:
        folder = out / "published" / pool_name / "run-1" / f"v{v.version:06d}"
        assert v.uri == folder.resolve().as_uri()
        assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
        assert load_file(str(folder / "model.safetensors"))
    # checkpoints every 2 steps, the last two kept
    ckpt = out / "checkpoints" / pool_name / "run-1"
    assert (ckpt / "latest").read_text().strip() == "step-000004"
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000002", "step-000004"]
    assert (ckpt / "step-000004" / "extra-rank0.pt").is_file()
    assert "pool_url" in (out / "config.yaml").read_text()


def test_grpo_never_replays_and_stays_on_policy(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    with RecordingClient(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.0)
        cfg = run_config(
            live_server.url,
            pool_name,
            tiny_model,
            out,
            "run.name=grpo",
            "run.steps=3",
            "experience.enabled=false",
            "schedule.publish_every=0",
            "schedule.checkpoint_every=0",
        )
        run_training(cfg, client=client)
        run = client.get_run(pool_name, "grpo")
        stats = client.run_stats(pool_name, "grpo")
        versions = client.list_policy_versions(pool_name, "grpo")

    metrics = read_metrics(out)
    assert len(metrics) == 3
    assert any(m["batch/solved"] > 0 for m in metrics), "solved > threshold would switch ExGRPO"
    assert run.phase == "on_policy" and run.switched_at_step is None
    assert all(p.phase == "on_policy" and p.replay == [] for p in client.plans)
    assert all(not r.replayed for groups in client.commits for g in groups for r in g.rollouts)
    assert all(m["phase/mixed"] == 0.0 and m["batch/replayed_questions"] == 0.0 for m in metrics)
    assert all(m["tokens/replay"] == 0.0 and "is/w_mean" not in m for m in metrics)
    assert stats.trajectories == 0
    assert versions.count == 0 and not (out / "published").exists()
    assert (out / "checkpoints" / pool_name / "grpo" / "latest").read_text().strip() == "step-000003"


def test_late_metrics_reach_the_service_once_each_in_step_order(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    """The run's stats come back on each commit's answer (no run-stats request), and every step's
    timings and `experience/*` numbers are posted from the background sender, once, in step order,
    all of them on the service by the time training returns."""
    out = tmp_path / "run"
    with RecordingClient(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.0)
        cfg = run_config(
            live_server.url,
            pool_name,
            tiny_model,
            out,
            "run.name=late",
            "run.steps=5",
            "schedule.publish_every=0",
            "schedule.checkpoint_every=0",
        )
        run_training(cfg, client=client)
        assert client.stats_requests == 0
        posted = list(client.metric_posts)
        stored = client.run_metrics(pool_name, "late").data
        final = client.run_stats(pool_name, "late")

    local = read_metrics(out)
    steps = [m["step"] for m in local]
    assert steps == [1, 2, 3, 4, 5]
    assert [step for step, _thread, _late in posted] == steps, "each step once, in step order"
    assert {thread for _step, thread, _late in posted} == {"exgrpo-run-metrics"}
    assert [row.step for row in stored] == steps
    for m, (_step, _thread, late), row in zip(local, posted, stored, strict=True):
        assert {"timing/step", "timing/commit", "experience/eligible", "phase/switched"} <= late.keys()
        assert all(row.metrics[k] == v == m[k] for k, v in late.items()), m["step"]
        assert row.metrics["batch/solved"] == m["batch/solved"]  # sent with the commit
    for m, result in zip(local, client.commit_results, strict=True):
        st = result.stats
        assert st is not None and st.step == m["step"]
        assert (m["experience/eligible"], m["experience/retired"]) == (st.eligible, st.retired)
        assert (m["experience/seen"], m["experience/trajectories"]) == (st.seen, st.trajectories)
        assert {k for k in m if k.startswith("experience/bucket_")} == {
            f"experience/bucket_{b.bucket}" for b in st.buckets
        }
    assert client.commit_results[-1].stats == final and final.trajectories > 0
