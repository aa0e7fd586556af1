"""The stages of one step's batch (exgrpo_trainer.batch): plan -> slots -> graded rows -> commit
groups, on a hand-made plan, without a model or a service."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from exgrpo_client import rollout
from exgrpo_client import schemas as s
from exgrpo_rollout.engines.base import Completion
from exgrpo_trainer.batch import (
    choose_replays,
    commit_groups,
    graded_rows,
    grading_items,
    mean_entropies,
    prepare_batch,
)
from exgrpo_trainer.config import ExperienceSection

K = 3


def _trajectory(tid: int, qid: int, ids: list[int], lps: list[float]) -> s.TrajectoryPublic:
    packed = rollout(1.0, ids, lps)
    return s.TrajectoryPublic(
        id=tid,
        question_id=qid,
        source_run="r",
        policy_version=0,
        step=1,
        reward=1.0,
        entropy=0.5,
        num_tokens=len(ids),
        created_at=datetime.now(UTC),
        token_ids_b64=packed.token_ids_b64,
        logprobs_b64=packed.logprobs_b64,
    )


def _plan() -> s.BatchPlan:
    msg = [s.ChatMessage(role="user", content="q")]
    replay = s.ReplayItem(
        question_id=7,
        prompt=msg,
        ground_truth="7",
        data_source="d",
        num_samples=K - 1,
        bucket=2,
        probability=0.5,
        candidates=[
            _trajectory(1, 7, [1, 2], [-0.5, -0.25]),
            _trajectory(2, 7, [3, 4, 5], [-1.0, -1.0, -1.0]),
        ],
    )
    fresh = [
        s.FreshItem(question_id=q, prompt=msg, ground_truth=str(q), data_source="d", num_samples=K)
        for q in (7, 9)  # question 7 also fresh: two independent groups
    ]
    return s.BatchPlan(
        id="b1",
        run="r",
        pool="p",
        step=4,
        phase="mixed",
        status="planned",
        policy_version=0,
        k=K,
        fresh=fresh,
        replay=[replay],
        num_eligible=1,
        skipped_fresh=0,
        epoch=0,
        created_at=datetime.now(UTC),
    )


def test_entropy_choice_then_slots_rows_and_commit_groups() -> None:
    plan = _plan()
    prompts = {7: [100, 101], 9: [102]}
    seen: list[list[list[int]]] = []

    def score(p: list[list[int]], r: list[list[int]], *, with_entropy: bool) -> tuple[list, list]:
        assert with_entropy
        seen.append(r)
        return [[0.0] * len(x) for x in r], [[0.9, 0.9], [0.1, 0.2, 0.3]]  # second is lower

    chosen = choose_replays(plan, prompts, score, ExperienceSection(), rng_seed=0)
    assert seen == [[[1, 2], [3, 4, 5]]] and chosen[7].id == 2
    batch = prepare_batch(plan, prompts, chosen)
    assert [(q.question_id, q.replayed) for q in batch.questions] == [(7, True), (7, False), (9, False)]
    assert batch.mixed and batch.k == K and batch.step == 4

    samples = [
        [Completion(token_ids=[10 + i], logprobs=[-0.1], text=f"s{i}") for i in range(q.num_generations(K))]
        for q in batch.questions
    ]
    items = grading_items(batch, samples, decode=lambda ids: "+".join(map(str, ids)))
    # generated samples slot by slot, then the replayed trajectory's text
    assert [t for t, _ in items] == ["s0", "s1", "s0", "s1", "s2", "s0", "s1", "s2", "3+4+5"]
    assert [g for _, g in items][-1] == "7"
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # the replayed one re-grades as wrong
    rows, finish = graded_rows(batch, samples, rewards, max_response_len=2)
    assert len(rows) == 3 * K and [r.group for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert rows[0].replayed and rows[0].response_ids == [3, 4] and rows[0].reward == 0.0  # truncated
    assert rows[0].behaviour_logprobs == [-1.0, -1.0] and finish[0] is None
    assert rows[1].behaviour_logprobs == [-0.1]  # the sampler's log-probs are kept

    old_lp = [[-0.2] * len(r.response_ids) for r in rows]
    old_ent = [[0.4] * len(r.response_ids) for r in rows]
    groups = commit_groups(
        batch, rows, finish, old_lp, mean_entropies(old_ent), decode=lambda ids: "+".join(map(str, ids))
    )
    assert [g.question_id for g in groups] == [7, 7, 9]
    assert [r.replayed for r in groups[0].rollouts] == [True, False, False]
    correct = [r for g in groups for r in g.rollouts if r.token_ids_b64 is not None]
    assert len(correct) == 2  # only correct generated rows carry a payload (pi_old log-probs)
    assert [r.text for r in correct] == ["10", "10"], "and their text, decoded"
    assert all(r.text is None for g in groups for r in g.rollouts if r.token_ids_b64 is None)
    assert all(r.entropy == pytest.approx(0.4) for g in groups for r in g.rollouts)


def test_random_choice_is_seeded_and_plan_without_candidates_replays_nothing() -> None:
    plan = _plan()
    prompts = {7: [1], 9: [2]}

    def no_score(*_a: object, **_k: object) -> tuple[list, list]:
        raise AssertionError("random choice scores nothing")

    exp = ExperienceSection(metric="random")
    picks = {choose_replays(plan, prompts, no_score, exp, rng_seed=seed)[7].id for seed in range(20)}
    assert picks == {1, 2}
    assert choose_replays(plan, prompts, no_score, exp, rng_seed=3) == choose_replays(
        plan, prompts, no_score, exp, rng_seed=3
    )
    empty = plan.model_copy(update={"replay": [plan.replay[0].model_copy(update={"candidates": []})]})
    batch = prepare_batch(empty, prompts, choose_replays(empty, prompts, no_score, exp, rng_seed=0))
    assert [q.replayed for q in batch.questions] == [False, False]
