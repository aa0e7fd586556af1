"""One step's batch through its stages, each a typed value:

    s.BatchPlan (from the pool)
      -> StepBatch     question slots with prompt token ids, the chosen replay trajectory, gold answers
      -> samples       per slot, the rollouts the rollout source generated (engine `Completion`s)
      -> list[Row]     graded training rows (`algo.build_rows`)
      -> list[s.GroupResult]   what the commit sends back

Slots are ordered replayed questions first, then fresh ones (a question can be both: two groups).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from exgrpo_client import decode_trajectory, rollout
from exgrpo_client import schemas as s
from exgrpo_rollout.engines.base import Completion
from exgrpo_trainer.algo import PlannedQuestion, Response, Row, build_rows, choose_trajectory
from exgrpo_trainer.config import ExperienceSection

Finish = Literal["stop", "length"]
"""Why a generated response ended (a replayed row has none)."""
Scorer = Callable[..., tuple[list[list[float]], list[list[float]]]]
"""`Learner.score(prompts, responses, with_entropy=...)`."""


@dataclass
class StepBatch:
    plan: s.BatchPlan
    questions: list[PlannedQuestion]
    """One per slot; a replayed slot carries its chosen trajectory (reward filled by grading)."""
    ground_truths: list[str]
    """Gold answer of each slot."""
    replay_ids: dict[int, int] = field(default_factory=dict)
    """The stored trajectory replayed, per replayed question (sent with its group on commit)."""

    @property
    def k(self) -> int:
        return self.plan.k

    @property
    def step(self) -> int:
        return self.plan.step

    @property
    def mixed(self) -> bool:
        return self.plan.phase == "mixed"

    @property
    def replayed_slots(self) -> list[bool]:
        return [q.replayed for q in self.questions]


def prepare_batch(
    plan: s.BatchPlan, prompt_ids: dict[int, list[int]], chosen: dict[int, s.TrajectoryPublic]
) -> StepBatch:
    """The step's question slots: replayed questions with a chosen trajectory, then fresh ones."""
    questions: list[PlannedQuestion] = []
    golds: list[str] = []
    for item in plan.replay:
        if item.question_id not in chosen:
            continue
        ids, lps = decode_trajectory(chosen[item.question_id])
        replay = Response(response_ids=ids.tolist(), reward=1.0, logprobs=lps.tolist())
        questions.append(
            PlannedQuestion(
                question_id=item.question_id, prompt_ids=prompt_ids[item.question_id], replay=replay
            )
        )
        golds.append(item.ground_truth)
    for fresh in plan.fresh:
        questions.append(
            PlannedQuestion(question_id=fresh.question_id, prompt_ids=prompt_ids[fresh.question_id])
        )
        golds.append(fresh.ground_truth)
    replay_ids = {q: t.id for q, t in chosen.items()}
    return StepBatch(plan=plan, questions=questions, ground_truths=golds, replay_ids=replay_ids)


def choose_replays(
    plan: s.BatchPlan,
    prompt_ids: dict[int, list[int]],
    score: Scorer,
    exp: ExperienceSection,
    rng_seed: int,
) -> dict[int, s.TrajectoryPublic]:
    """Per replayed question, the stored trajectory of lowest mean token entropy under the current
    policy (spec 4.2), or by the configured metric (`ppl`, `random`). Collective (scores on every
    rank)."""
    pairs = [(item, c) for item in plan.replay for c in item.candidates]
    if not pairs:
        return {}
    scores: list[float]
    if exp.metric == "random":
        scores = np.random.default_rng(rng_seed).random(len(pairs)).tolist()
    else:
        ids = [decode_trajectory(c)[0].tolist() for _, c in pairs]
        lp, ent = score(
            [prompt_ids[item.question_id] for item, _ in pairs], ids, with_entropy=exp.metric == "ent"
        )
        values = ent if exp.metric == "ent" else lp
        scores = [float(np.mean(e)) if exp.metric == "ent" else float(math.exp(-np.mean(e))) for e in values]
    chosen: dict[int, s.TrajectoryPublic] = {}
    start = 0
    for item in plan.replay:
        n = len(item.candidates)
        if n:
            best = choose_trajectory(scores[start : start + n], mode=exp.select_mode)
            chosen[item.question_id] = item.candidates[best]
        start += n
    return chosen


def grading_items(
    batch: StepBatch, samples: Sequence[Sequence[Completion]], decode: Callable[[list[int]], str]
) -> list[tuple[str, str]]:
    """(response text, gold) of every generated sample, slot by slot, then of every replayed
    trajectory (stored trajectories are re-scored like any response, spec 5.2)."""
    items = [(c.text, gold) for gold, cs in zip(batch.ground_truths, samples, strict=True) for c in cs]
    for q, gold in zip(batch.questions, batch.ground_truths, strict=True):
        if q.replay is not None:
            items.append((decode(q.replay.response_ids), gold))
    return items


def graded_rows(
    batch: StepBatch, samples: Sequence[Sequence[Completion]], rewards: Sequence[float], max_response_len: int
) -> tuple[list[Row], list[Finish | None]]:
    """Training rows and one finish reason per row (None for a replayed row), from the rewards in
    `grading_items` order. Generated rows keep the sampler's log-probs when it reported them."""
    it = iter(rewards)
    generated = [
        [Response(response_ids=c.token_ids, reward=next(it), logprobs=c.logprobs or None) for c in cs]
        for cs in samples
    ]
    questions = [
        q
        if q.replay is None
        else PlannedQuestion(
            question_id=q.question_id,
            prompt_ids=q.prompt_ids,
            replay=Response(response_ids=q.replay.response_ids, reward=next(it), logprobs=q.replay.logprobs),
        )
        for q in batch.questions
    ]
    rows = build_rows(questions, generated, k=batch.k, max_response_len=max_response_len)
    finish: list[Finish | None] = []
    for q, cs in zip(questions, samples, strict=True):
        finish.extend(([None] if q.replayed else []) + [c.finish_reason for c in cs])
    return rows, finish


def mean_entropies(per_token: Sequence[Sequence[float]]) -> list[float | None]:
    """Each row's mean token entropy (None for a row without any)."""
    return [float(np.mean(e)) if len(e) else None for e in per_token]


def commit_groups(
    batch: StepBatch,
    rows: Sequence[Row],
    finish: Sequence[Finish | None],
    logprobs: Sequence[Sequence[float]],
    entropy: Sequence[float | None],
    decode: Callable[[list[int]], str] | None = None,
) -> list[s.GroupResult]:
    """One group per slot: every row's reward and mean entropy (`entropy`, one per row); a correct
    generated row also carries its tokens and `logprobs` (the behaviour policy stored with a
    collected trajectory as pi_past: the trainer's pi_old, or the sampler's own log-probs when
    generation is asynchronous) and, with `decode`, its text (stored with it for people to read)."""
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_group[row.group].append(i)
    groups: list[s.GroupResult] = []
    for g, q in enumerate(batch.questions):
        rollouts = []
        for i in by_group[g]:
            row = rows[i]
            ent = entropy[i]
            if row.replayed:
                rollouts.append(rollout(row.reward, None, None, entropy=ent, replayed=True))
            elif row.reward == 1.0 and row.response_ids:
                lps = np.minimum(logprobs[i], 0.0)
                text = decode(row.response_ids) if decode is not None else None
                rollouts.append(
                    rollout(
                        row.reward, row.response_ids, lps, entropy=ent, finish_reason=finish[i], text=text
                    )
                )
            else:
                rollouts.append(rollout(row.reward, None, None, entropy=ent, finish_reason=finish[i]))
        replay_id = batch.replay_ids.get(q.question_id) if q.replay is not None else None
        groups.append(
            s.GroupResult(question_id=q.question_id, rollouts=rollouts, replay_trajectory_id=replay_id)
        )
    return groups
