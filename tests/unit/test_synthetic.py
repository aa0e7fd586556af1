"""The synthetic arithmetic task: determinism, difficulty control, train/held-out partition, the
verl/ExGRPO parquet layout through the project's question reader, and reference solutions that the
graders score 1.0."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from shared_data import VALID, needs

from exgrpo_client.io import read_questions
from exgrpo_onebox.synthetic import (
    CALIBRATED_LEVELS,
    CALIBRATED_MIX,
    FAMILIES,
    LEVELS,
    Problem,
    get_family,
    is_heldout,
    make_problems,
    make_questions,
    make_splits,
    parse_mix,
    problem_stream,
    reference_response,
    write_parquet,
)
from exgrpo_rollout.graders import grade_one


def _value(p: Problem) -> int:
    """The expression's value under the usual precedence (the text contains digits, + - * ( ))."""
    assert set(p.expression) <= set("0123456789+-*()")
    return int(eval(p.expression))


def test_same_seed_same_problems_other_seed_others() -> None:
    a = make_problems(60, seed=3)
    assert a == make_problems(60, seed=3)
    assert [p.expression for p in a] != [p.expression for p in make_problems(60, seed=4)]
    s1, s2 = problem_stream(5), problem_stream(5)
    assert [next(s1) for _ in range(30)] == [next(s2) for _ in range(30)]


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_level_sets_operations_and_sizes(level: int) -> None:
    spec = LEVELS[level]
    problems = make_problems(40, seed=1, mix=level)
    assert len({p.expression for p in problems}) == 40
    for p in problems:
        assert p.difficulty == level and p.data_source == f"arith_d{level}"
        assert len(p.steps) == spec.num_ops
        assert _value(p) == p.answer, p.expression  # the brackets follow the evaluation order
        for i, (a, op, b, c) in enumerate(p.steps):
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op]
            assert 0 <= c <= spec.max_value
            assert (2 <= b <= spec.max_factor) if op == "*" else (1 <= b <= spec.max_operand)
            if i:
                assert a == p.steps[i - 1][3]


def test_harder_levels_have_longer_solutions() -> None:
    mean_len = [
        sum(len(reference_response(p)) for p in make_problems(50, 0, level)) / 50 for level in (1, 2, 3, 4)
    ]
    assert mean_len == sorted(mean_len) and mean_len[0] < mean_len[-1] - 20


def test_mix_sets_the_level_counts() -> None:
    counts = Counter(p.difficulty for p in make_problems(100, 0, {2: 1, 3: 3}))
    assert counts == {2: 25, 3: 75}
    assert Counter(p.difficulty for p in make_problems(40, 0, [1, 4])) == {1: 20, 4: 20}
    assert parse_mix(None) == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    with pytest.raises(ValueError, match="unknown difficulty"):
        parse_mix({9: 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        parse_mix({1: 0.0})


def test_a_used_up_level_passes_its_share_on() -> None:
    # level 1 has 286 problems in all, 213 of them in the training partition
    problems = make_problems(600, 0, [1, 2])
    counts = Counter(p.difficulty for p in problems)
    assert len({p.expression for p in problems}) == 600
    assert 190 <= counts[1] <= 213 and counts[1] + counts[2] == 600
    with pytest.raises(ValueError, match="not enough distinct problems"):
        make_problems(300, 0, 1)


def test_train_and_heldout_never_overlap() -> None:
    train, heldout = make_splits(600, 200, seed=0)
    assert not {p.expression for p in train} & {p.expression for p in heldout}
    assert not any(is_heldout(p.expression) for p in train)
    assert all(is_heldout(p.expression) for p in heldout)
    # independent of sizes and seeds: another draw's held-out set never meets this training set
    _, other = make_splits(10, 300, seed=7)
    assert not {p.expression for p in train} & {p.expression for p in other}
    stream = problem_stream(0, split="train")
    assert not any(is_heldout(next(stream).expression) for _ in range(500))
    share = sum(is_heldout(p.expression) for p in make_problems(2000, 0, 3, split=None)) / 2000
    assert 0.2 < share < 0.3


@pytest.mark.parametrize("grader", ["arithmetic", "math_think"])
def test_reference_solutions_grade_one(grader: str) -> None:
    problems = make_problems(40, seed=2, mix=[1, 2, 3, 4, 5])
    for p in problems:
        response = reference_response(p)
        assert response.count("</think>") == 1 and response.endswith(f"\\boxed{{{p.answer}}}")
        for text in (response, response + "<|eos|>"):  # the trainer grades the text with its EOS
            assert grade_one(grader, text, str(p.answer), timeout_s=None).reward == 1.0
        wrong = response.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{p.answer + 1}}}")
        assert grade_one(grader, wrong, str(p.answer), timeout_s=None).reward == 0.0


def test_reference_trace_format() -> None:
    p = Problem(
        expression="(7+5)*3-8", steps=((7, "+", 5, 12), (12, "*", 3, 36), (36, "-", 8, 28)), difficulty=3
    )
    assert _value(p) == 28
    assert reference_response(p) == "7+5=12, 12*3=36, 36-8=28\n</think> \\boxed{28}"


def test_parquet_round_trip_through_the_question_reader(tmp_path: Path) -> None:
    rows = make_questions(30, seed=0, split="heldout")
    path = write_parquet(tmp_path / "q.parquet", rows)
    questions = [q for chunk in read_questions(path) for q in chunk]
    assert len(questions) == 30
    for row, q in zip(rows, questions, strict=True):
        assert [(m.role, m.content) for m in q.prompt] == [("user", row["prompt"][0]["content"])]
        assert q.ground_truth == row["reward_model"]["ground_truth"]
        assert q.data_source == row["data_source"]
        assert q.metadata == {"index": row["extra_info"]["index"], "split": "heldout"}
        assert q.external_id == str(row["extra_info"]["index"])
    table = pq.read_table(path)
    assert table.column("ability").to_pylist() == ["arithmetic"] * 30
    assert {r["style"] for r in table.column("reward_model").to_pylist()} == {"rule"}


@needs(VALID)
def test_parquet_columns_match_the_exgrpo_files(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "q.parquet", make_questions(3))
    ours, theirs = pq.read_schema(path), pq.read_schema(VALID)
    assert {f.name: f.type for f in ours} == {f.name: f.type for f in theirs}


# ------------------------------------------------------------------------- the calibrated family
def test_calibrated_family_is_deterministic_and_differs_from_arithmetic() -> None:
    a = make_problems(50, seed=3, family="calibrated")
    assert a == make_problems(50, seed=3, family="calibrated")
    assert [p.expression for p in a] != [p.expression for p in make_problems(50, seed=4, family="calibrated")]
    s1, s2 = problem_stream(5, family="calibrated"), problem_stream(5, family="calibrated")
    assert [next(s1) for _ in range(30)] == [next(s2) for _ in range(30)]
    # the arithmetic family draws exactly what it drew before families existed
    assert make_problems(50, seed=3) == make_problems(50, seed=3, family="arithmetic")
    assert all(p.family == "arithmetic" and p.data_source.startswith("arith_d") for p in make_problems(9))


@pytest.mark.parametrize("level", sorted(CALIBRATED_LEVELS))
def test_calibrated_levels_chain_the_known_facts(level: int) -> None:
    spec = CALIBRATED_LEVELS[level]
    problems = make_problems(30, seed=1, mix=level, family="calibrated")
    assert len({p.expression for p in problems}) == 30
    for p in problems:
        assert p.family == "calibrated" and p.data_source == f"calib_d{level}"
        assert len(p.steps) == spec.num_ops
        assert _value(p) == p.answer, p.expression
        for a, op, b, c in p.steps:
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op] and 0 <= c <= 20
            assert (2 <= b <= 3) if op == "*" else (1 <= b <= 9)
    # difficulty is the chain length: 3..7 operations, one more per level
    assert [CALIBRATED_LEVELS[k].num_ops for k in sorted(CALIBRATED_LEVELS)] == [3, 4, 5, 6, 7]


def test_calibrated_mix_sets_the_level_distribution() -> None:
    problems = make_problems(400, seed=0, family="calibrated")
    counts = Counter(p.difficulty for p in problems)
    total = sum(CALIBRATED_MIX.values())
    for level, weight in CALIBRATED_MIX.items():
        assert abs(counts[level] - 400 * weight / total) <= 1
    assert set(counts) == set(CALIBRATED_MIX)
    assert parse_mix(None, "calibrated") == {k: float(v) for k, v in CALIBRATED_MIX.items()}
    with pytest.raises(ValueError, match="unknown difficulty"):
        parse_mix({6: 1.0}, "calibrated")
    with pytest.raises(ValueError, match="unknown task family 'geometry'"):
        get_family("geometry")
    assert set(FAMILIES) == {"arithmetic", "calibrated"}


def test_calibrated_train_and_heldout_never_overlap() -> None:
    train, heldout = make_splits(500, 200, seed=0, family="calibrated")
    assert len(train) == 500 and len(heldout) == 200
    assert not {p.expression for p in train} & {p.expression for p in heldout}
    assert all(is_heldout(p.expression) for p in heldout)
    assert not any(is_heldout(p.expression) for p in train)


@pytest.mark.parametrize("grader", ["arithmetic", "math_think"])
def test_calibrated_reference_solutions_grade_one(grader: str) -> None:
    for p in make_problems(25, seed=2, family="calibrated"):
        response = reference_response(p)
        assert grade_one(grader, response + "<|eos|>", str(p.answer), timeout_s=None).reward == 1.0
        wrong = response.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{p.answer + 1}}}")
        assert grade_one(grader, wrong, str(p.answer), timeout_s=None).reward == 0.0
    row = make_questions(1, seed=0, family="calibrated")[0]
    assert row["data_source"].startswith("calib_d") and row["ability"] == "arithmetic"
