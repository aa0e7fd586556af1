"""Replay diagnostics of the one-box job (exgrpo_onebox.diagnostics): the trainer names the replayed
trajectory of each group on commit, and the recorder turns plan + commit into per-step bucket, level,
staleness and repeat counts."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from exgrpo_client import rollout
from exgrpo_client import schemas as s
from exgrpo_onebox.diagnostics import Replay, StepDiagnostics, replay_count_histogram, replays_of
from exgrpo_rollout.engines.base import Completion
from exgrpo_trainer.batch import commit_groups, graded_rows, prepare_batch

K = 3


def _trajectory(tid: int, qid: int, step: int) -> s.TrajectoryPublic:
    packed = rollout(1.0, [1, 2], [-0.5, -0.5])
    return s.TrajectoryPublic(
        id=tid,
        question_id=qid,
        source_run="r",
        policy_version=0,
        step=step,
        reward=1.0,
        entropy=0.5,
        num_tokens=2,
        created_at=datetime.now(UTC),
        token_ids_b64=packed.token_ids_b64,
        logprobs_b64=packed.logprobs_b64,
    )


def _plan(step: int, replays: dict[int, tuple[int, str, list[s.TrajectoryPublic]]]) -> s.BatchPlan:
    msg = [s.ChatMessage(role="user", content="q")]
    replay = [
        s.ReplayItem(
            question_id=q,
            prompt=msg,
            ground_truth="1",
            data_source=source,
            num_samples=K - 1,
            bucket=bucket,
            probability=0.5,
            candidates=candidates,
        )
        for q, (bucket, source, candidates) in replays.items()
    ]
    fresh = [s.FreshItem(question_id=5, prompt=msg, ground_truth="5", data_source="calib_d1", num_samples=K)]
    return s.BatchPlan(
        id=f"b{step}",
        run="r",
        pool="p",
        step=step,
        phase="mixed",
        status="planned",
        policy_version=0,
        k=K,
        fresh=fresh,
        replay=replay,
        num_eligible=len(replay),
        skipped_fresh=0,
        epoch=0,
        created_at=datetime.now(UTC),
    )


def _commit(plan: s.BatchPlan, chosen: dict[int, s.TrajectoryPublic]) -> list[s.GroupResult]:
    """The trainer's commit groups for `plan` with `chosen` replayed (no model needed)."""
    prompts = {
        q: [100] for q in [*(i.question_id for i in plan.fresh), *(i.question_id for i in plan.replay)]
    }
    batch = prepare_batch(plan, prompts, chosen)
    samples = [
        [Completion(token_ids=[10], logprobs=[-0.1], text="x") for _ in range(q.num_generations(K))]
        for q in batch.questions
    ]
    n = sum(len(x) for x in samples) + len(chosen)
    rows, finish = graded_rows(batch, samples, [0.0] * n, max_response_len=8)
    return commit_groups(
        batch, rows, finish, [[-0.2] * len(r.response_ids) for r in rows], [None] * len(rows)
    )


def test_the_trainer_names_the_replayed_trajectory_and_the_recorder_reads_it(tmp_path: Path) -> None:
    old, new = _trajectory(11, 7, step=2), _trajectory(12, 7, step=9)
    plan = _plan(12, {7: (3, "calib_d4", [old, new]), 8: (6, "calib_d2", [_trajectory(13, 8, step=10)])})
    groups = _commit(plan, {7: old, 8: plan.replay[1].candidates[0]})
    assert [(g.question_id, g.replay_trajectory_id) for g in groups] == [(7, 11), (8, 13), (5, None)]

    replays = replays_of(plan, groups)
    assert replays == [
        Replay(step=12, question_id=7, bucket=3, level=4, age=10, candidates=2),
        Replay(step=12, question_id=8, bucket=6, level=2, age=2, candidates=1),
    ]
    # groups as plain data (what a client may send) read the same
    assert replays_of(plan, [g.model_dump() for g in groups]) == replays


def test_step_lines_count_buckets_levels_staleness_and_repeats(tmp_path: Path) -> None:
    class Recorded:
        replays: list[Replay] = []

    client = Recorded()
    diag = StepDiagnostics(client, tmp_path / "diagnostics.jsonl")  # type: ignore[arg-type]
    assert diag.on_step(1) == {
        "step": 1.0,
        "replay/questions": 0.0,
        "replay/distinct": 0.0,
        "replay/total": 0.0,
    }
    client.replays += [Replay(2, 7, 3, 4, 1, 2), Replay(2, 8, 6, 2, 1, 1)]
    client.replays += [Replay(3, 7, 5, 4, 5, 3)]  # a later step, committed before the next call
    line = diag.on_step(3)
    assert line["replay/questions"] == 3 and line["replay/bucket_3"] == 1 and line["replay/bucket_6"] == 1
    assert line["replay/level_4"] == 2 and line["replay/level_2"] == 1
    assert line["replay/age_mean"] == pytest.approx(7 / 3) and line["replay/age_max"] == 5
    assert line["replay/times_mean"] == pytest.approx((1 + 1 + 2) / 3)
    assert line["replay/distinct"] == 2 and line["replay/total"] == 3
    lines = [json.loads(x) for x in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 3]
    assert replay_count_histogram(client.replays) == {2: 1, 1: 1}
