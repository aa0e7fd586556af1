"""Training rows of a planned batch (spec 5.1-5.3, TV4b, TV9)."""

from __future__ import annotations

import pytest

from exgrpo_trainer.algo import (
    PlannedQuestion,
    Response,
    build_rows,
    group_rewards,
    num_generations,
    row_advantages,
)

K = 8


def _gen(reward: float, n_tokens: int = 3) -> Response:
    return Response(response_ids=list(range(n_tokens)), reward=reward, logprobs=[-0.5] * n_tokens)


def _stored(n_tokens: int = 4) -> Response:
    return Response(
        response_ids=[7] * n_tokens, reward=1.0, logprobs=[-0.1 * (i + 1) for i in range(n_tokens)]
    )


def test_tv4b_replayed_row_is_first_and_gets_plus_0_625() -> None:
    question = PlannedQuestion(question_id=11, prompt_ids=[1, 2], replay=_stored())
    generated = [_gen(r) for r in (1, 1, 0, 0, 0, 0, 0)]
    rows = build_rows([question], [generated], k=K)
    assert len(rows) == K
    assert [r.replayed for r in rows] == [True] + [False] * 7
    assert {r.group for r in rows} == {0} and {r.question_id for r in rows} == {11}
    assert rows[0].response_ids == [7, 7, 7, 7]
    assert rows[0].behaviour_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert row_advantages(rows) == pytest.approx([0.625, 0.625, 0.625] + [-0.375] * 5)


def test_tv9_forty_replayed_questions_need_984_fresh_rollouts() -> None:
    questions = [PlannedQuestion(question_id=i, prompt_ids=[i], replay=_stored()) for i in range(40)]
    questions += [PlannedQuestion(question_id=100 + i, prompt_ids=[i]) for i in range(88)]
    assert num_generations(questions, K) == 984 == 40 * 7 + 88 * 8
    generated = [[_gen(0.0)] * q.num_generations(K) for q in questions]
    rows = build_rows(questions, generated, k=K)
    assert len(rows) == 1024
    assert sum(r.replayed for r in rows) == 40
    assert sum(not r.replayed for r in rows) == 984
    groups = group_rewards(rows)
    assert list(groups) == list(range(128)) and all(len(g) == K for g in groups.values())


def test_tv9_full_pool_composition() -> None:
    questions = [PlannedQuestion(question_id=i, prompt_ids=[i], replay=_stored()) for i in range(64)]
    questions += [PlannedQuestion(question_id=i, prompt_ids=[i]) for i in range(64)]
    assert num_generations(questions, K) == 960


def test_duplicate_question_forms_two_independent_groups() -> None:
    replayed = PlannedQuestion(question_id=5, prompt_ids=[9], replay=_stored())
    fresh = PlannedQuestion(question_id=5, prompt_ids=[9])
    rows = build_rows(
        [replayed, fresh],
        [[_gen(0.0)] * 7, [_gen(1.0)] * 4 + [_gen(0.0)] * 4],
        k=K,
        first_group=10,
    )
    assert group_rewards(rows) == {10: [1.0] + [0.0] * 7, 11: [1.0] * 4 + [0.0] * 4}
    adv = row_advantages(rows)
    assert adv[0] == pytest.approx(0.875) and adv[1] == pytest.approx(-0.125)
    assert adv[8:] == pytest.approx([0.5] * 4 + [-0.5] * 4)


def test_row_advantages_follow_rows_in_any_order_and_support_std() -> None:
    rows = build_rows(
        [PlannedQuestion(question_id=1, prompt_ids=[1]), PlannedQuestion(question_id=2, prompt_ids=[2])],
        [[_gen(1.0), _gen(0.0)], [_gen(0.0), _gen(0.0)]],
        k=2,
    )
    shuffled = [rows[2], rows[1], rows[3], rows[0]]
    assert row_advantages(shuffled) == [0.0, -0.5, 0.0, 0.5]
    std = row_advantages(rows, use_std=True)
    assert std[0] == pytest.approx(0.5 / (2**0.5 / 2 + 1e-6))


def test_truncation_applies_to_ids_and_logprobs() -> None:
    question = PlannedQuestion(question_id=3, prompt_ids=[1], replay=_stored(6))
    rows = build_rows([question], [[_gen(1.0, 5)]], k=2, max_response_len=4)
    assert [len(r.response_ids) for r in rows] == [4, 4]
    assert rows[0].behaviour_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert rows[1].behaviour_logprobs == [-0.5] * 4


def test_generated_rows_may_lack_logprobs_but_a_replay_may_not() -> None:
    fresh = PlannedQuestion(question_id=1, prompt_ids=[1])
    rows = build_rows([fresh], [[Response(response_ids=[1], reward=0.0)] * 2], k=2)
    assert all(r.behaviour_logprobs is None for r in rows)
    replay = PlannedQuestion(question_id=2, prompt_ids=[1], replay=Response(response_ids=[1], reward=1.0))
    with pytest.raises(ValueError, match="no log-probs"):
        build_rows([replay], [[_gen(0.0)]], k=2)


@pytest.mark.parametrize(
    ("questions", "generated", "kwargs", "match"),
    [
        ([PlannedQuestion(question_id=1, prompt_ids=[1])], [[_gen(0.0)]], {}, "needs 2 generated"),
        ([PlannedQuestion(question_id=1, prompt_ids=[1])], [], {}, "one list per question"),
        ([], [], {"k": 1}, "k must be"),
        ([], [], {"max_response_len": 0}, "max_response_len"),
        (
            [PlannedQuestion(question_id=1, prompt_ids=[1])],
            [[Response(response_ids=[1, 2], reward=0.0, logprobs=[0.0])] * 2],
            {},
            "1 log-probs for 2 response tokens",
        ),
    ],
    ids=["count", "slots", "k", "limit", "logprob-length"],
)
def test_build_rows_refuses_inconsistent_input(
    questions: list[PlannedQuestion], generated: list[list[Response]], kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        build_rows(questions, generated, **{"k": 2, **kwargs})
