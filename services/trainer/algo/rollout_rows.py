"""Turning a planned batch into training rows (spec 1 steps 2-3, 5.1-5.3).

A planned batch is a list of question slots. A fresh question gets K generated rows; a replayed
question gets one row holding its chosen stored trajectory (row 0 of the group, with the stored
behaviour log-probs, replayed tokens for the loss) followed by K - 1 generated rows. All rows of a slot
share a group id, so a question that appears twice in a batch (once replayed, once fresh) forms two
independent groups (quirk Q21). The replayed row is built directly, not forced through the inference
engine (quirk Q5), and is truncated to ``L_max`` like any response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .advantages import group_advantages


@dataclass(slots=True)
class Row:
    """One training sequence."""

    group: int
    """Advantage group (one per question slot of the batch)."""
    question_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    """Response token ids, EOS included when the response ended with one."""
    reward: float
    behaviour_logprobs: list[float] | None
    """Per-token log-probs of the policy that produced the response: the stored pi_past log-probs of a
    replayed row, the sampler's log-probs (if reported) of a generated one."""
    replayed: bool
    """Whether every response token is a replayed token (row 0 of a replayed question's group)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """A response with its reward: generated this step, or a stored trajectory chosen for replay."""

    response_ids: list[int]
    reward: float
    """Reward of this response; a stored trajectory is re-scored like any sequence (spec 5.2)."""
    logprobs: list[float] | None = None
    """Per-token behaviour log-probs, aligned with ``response_ids``; required for a replay."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedQuestion:
    """One question slot of a planned batch."""

    question_id: int
    prompt_ids: list[int]
    replay: Response | None = None
    """The stored trajectory chosen for replay (spec 4.2); ``None`` for a fresh question."""

    @property
    def replayed(self) -> bool:
        return self.replay is not None

    def num_generations(self, k: int) -> int:
        """Rollouts to generate for this slot: ``k`` for a fresh question, ``k - 1`` for a replayed one."""
        return k - 1 if self.replayed else k


def num_generations(questions: Sequence[PlannedQuestion], k: int) -> int:
    """Total rollouts to generate for a planned batch (``7 n_exp + 8 n_fresh`` with K = 8)."""
    _check_k(k)
    return sum(q.num_generations(k) for q in questions)


def build_rows(
    questions: Sequence[PlannedQuestion],
    generated: Sequence[Sequence[Response]],
    *,
    k: int,
    max_response_len: int | None = None,
    first_group: int = 0,
) -> list[Row]:
    """Training rows of a planned batch, slot by slot.

    Args:
        questions: the question slots, in batch order.
        generated: for each slot, its ``q.num_generations(k)`` generated completions.
        k: group size K.
        max_response_len: truncate every response (and its log-probs) to this many tokens.
        first_group: group id of the first slot; slot ``i`` gets ``first_group + i``.

    Returns:
        ``K`` rows per slot, the replayed row first in a replayed question's group.
    """
    _check_k(k)
    if len(generated) != len(questions):
        raise ValueError(
            f"generated must hold one list per question ({len(questions)}), got {len(generated)}"
        )
    if max_response_len is not None and max_response_len < 1:
        raise ValueError(f"max_response_len must be >= 1 or None, got {max_response_len}")
    rows: list[Row] = []
    for slot, (question, completions) in enumerate(zip(questions, generated, strict=True)):
        expected = question.num_generations(k)
        if len(completions) != expected:
            raise ValueError(
                f"question slot {slot} (id {question.question_id}) needs {expected} generated "
                f"completions, got {len(completions)}"
            )
        group = first_group + slot
        if question.replay is not None:
            if question.replay.logprobs is None:
                raise ValueError(
                    f"the replayed trajectory of question {question.question_id} has no log-probs"
                )
            rows.append(_row(group, question, question.replay, replayed=True, limit=max_response_len))
        rows.extend(_row(group, question, c, replayed=False, limit=max_response_len) for c in completions)
    return rows


def _row(
    group: int, question: PlannedQuestion, completion: Response, *, replayed: bool, limit: int | None
) -> Row:
    ids = list(completion.response_ids[:limit])
    logprobs = completion.logprobs
    if logprobs is not None:
        if len(logprobs) != len(completion.response_ids):
            raise ValueError(
                f"question {question.question_id}: {len(logprobs)} log-probs for "
                f"{len(completion.response_ids)} response tokens"
            )
        logprobs = [float(x) for x in logprobs[:limit]]
    return Row(
        group=group,
        question_id=question.question_id,
        prompt_ids=list(question.prompt_ids),
        response_ids=ids,
        reward=float(completion.reward),
        behaviour_logprobs=logprobs,
        replayed=replayed,
    )


def group_rewards(rows: Sequence[Row]) -> dict[int, list[float]]:
    """Rewards of each group, groups in order of first appearance, rows in input order."""
    groups: dict[int, list[float]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row.reward)
    return groups


def row_advantages(rows: Sequence[Row], use_std: bool = False, *, eps: float = 1e-6) -> list[float]:
    """Advantage of every row, in input order, from the rewards of its group (spec 5.3)."""
    per_group = {
        group: iter(group_advantages(rewards, use_std=use_std, eps=eps).tolist())
        for group, rewards in group_rewards(rows).items()
    }
    return [next(per_group[row.group]) for row in rows]


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ValueError(f"k must be an integer >= 2, got {k!r}")
