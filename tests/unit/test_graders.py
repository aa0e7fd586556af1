"""Graders: training reward (spec 7, TV11), evaluation boxed/choice graders (spec 9.1), arithmetic
grader, registry, in-process grade_one and robustness against bad model output."""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import pytest
from shared_data import ARC_C, GPQA, TEST_ID, needs

from exgrpo_rollout.graders import BUILTIN_GRADERS, Grade, get_grader, grade_one
from exgrpo_rollout.graders.arithmetic import arithmetic, parse_integer
from exgrpo_rollout.graders.base import cap_inputs, coerce_grade, external_deadline, math_verify_timeout
from exgrpo_rollout.graders.boxed import answers_equivalent, boxed, choice, normalize_answer, normalize_choice
from exgrpo_rollout.graders.examples import exact_match, misbehaving
from exgrpo_rollout.graders.extract import (
    after_first_think_close,
    extract_last_boxed,
    strip_trailing_eos,
    think_solution,
)
from exgrpo_rollout.graders.math_think import grade_math_think, math_think, math_think_strip_eos

# --------------------------------------------------------------------------------------------
# TV11 (spec section 11): reward v3 with the installed Math-Verify
# --------------------------------------------------------------------------------------------

TV11 = [
    ("Let me think.\n</think>\n\nThe answer is \\boxed{204}.<|im_end|>", "204", 1.0),
    ("Let me think. The answer is \\boxed{204}.<|im_end|>", "204", 0.0),
    ("thinking </think> so x = 3, and \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("thinking </think> \\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("a </think> b </think> \\boxed{5}", "5", 0.0),
    ("a </think> The answer is 204", "204", 1.0),
    ("a </think> \\boxed{205}", "204", 0.0),
]
TV11_REASONS = ["correct", "no_think_close", "correct", "correct", "no_answer", "correct", "wrong_answer"]


@pytest.mark.parametrize(("row", "case"), list(enumerate(TV11)))
@pytest.mark.parametrize("strip_eos", [False, True])
def test_tv11_training_reward(row: int, case: tuple[str, str, float], strip_eos: bool) -> None:
    response, gold, expected = case
    grade = grade_math_think(response, gold, strip_eos=strip_eos)
    assert grade.reward == expected
    assert grade.reason == TV11_REASONS[row]


@pytest.mark.parametrize(("response", "gold", "expected"), TV11)
def test_tv11_through_registry_and_grade_one(response: str, gold: str, expected: float) -> None:
    assert get_grader("math_think")(response, gold).reward == expected
    assert get_grader("math_think_strip_eos")(response, gold).reward == expected
    assert grade_one("math_think", response, gold, timeout_s=10.0).reward == expected


def test_math_think_extracted_and_eos_handling() -> None:
    grade = math_think("ok </think> so \\boxed{204}<|im_end|>", "204")
    assert grade == Grade(1.0, "correct", "204")
    assert math_think_strip_eos("ok </think> \\boxed{7}</s>", "7").reward == 1.0
    assert strip_trailing_eos("x<|im_end|>  ") == "x"
    assert strip_trailing_eos("x<|endoftext|><|im_end|>") == "x"
    assert strip_trailing_eos("no eos") == "no eos"


def test_math_think_gold_formats_from_the_benchmarks() -> None:
    # AIME keeps leading zeros, AMC golds are floats, OlympiadBench golds are wrapped in $...$
    assert math_think("x </think> \\boxed{25}", "025").reward == 1.0
    assert math_think("x </think> \\boxed{142}", "142.0").reward == 1.0
    assert math_think("x </think> \\boxed{143}", "142.0").reward == 0.0
    assert math_think("x </think> \\boxed{\\frac{1}{2n+2}}", "$\\frac{1}{2 n+2}$").reward == 1.0
    assert math_think("x </think> \\boxed{\\frac{1}{2n+3}}", "$\\frac{1}{2 n+2}$").reward == 0.0
    assert math_think("x </think> \\boxed{3\\sqrt{13}}", "3\\sqrt{13}").reward == 1.0


def test_think_split_helpers() -> None:
    assert think_solution("no close tag") is None
    assert think_solution("a </think> b </think> c") == " b "
    assert think_solution("a </think>") == ""
    assert after_first_think_close("a </think> b </think> c") == " b </think> c"
    assert after_first_think_close("no think at all") == "no think at all"


# --------------------------------------------------------------------------------------------
# boxed extraction
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{5}", "5"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 42 and more", "42"),
        ("$\\boxed{x}$ and then \\fbox{y}", "y"),
        ("\\boxed{12", None),
        ("no box", None),
        ("\\boxedx{3}", None),
        ("\\boxed{}", ""),
    ],
)
def test_extract_last_boxed(text: str, expected: str | None) -> None:
    assert extract_last_boxed(text) == expected


# --------------------------------------------------------------------------------------------
# boxed evaluation grader: golds from test.id.parquet
# --------------------------------------------------------------------------------------------

BOXED_CORRECT = [
    # (data_source, gold, boxed answer written by a model)
    ("aime", "025", "25"),
    ("aime", "073", "073"),
    ("aime", "204", "204"),
    ("aime25", "336^\\circ", "336"),
    ("amc", "142.0", "142"),
    ("amc", "-4.0", "-4"),
    ("amc", "0.0", "0"),
    ("math", "\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("math", "\\frac{14}{3}", "\\dfrac{14}{3}"),
    ("math", "\\frac{14}{3}", "14/3"),
    ("math", "3\\sqrt{13}", "3 \\sqrt{13}"),
    ("math", "11\\sqrt2", "11\\sqrt{2}"),
    ("math", "90^\\circ", "90^{\\circ}"),
    ("math", "\\text{Evelyn}", "\\text{Evelyn}"),
    ("math", "x=5", "5"),
    ("math", "6 - 5i", "6-5i"),
    ("math", "p - q", "p-q"),
    ("math", "1,-2", "1, -2"),
    ("math", "3, 5, 7", "3,5,7"),
    ("math", "\\frac{243}{625}", "0.3888"),
    ("math", "52_8", "52_8"),
    ("math", "\\frac 34", "\\frac{3}{4}"),
    ("math", "\\frac9{19}", "9/19"),
    ("math", "\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
    ("math", "137 \\frac{1}{2}", "137\\frac{1}{2}"),
    ("math", "(3,4]", "(3, 4]"),
    ("math", "(-\\infty, 0]", "(-\\infty,0]"),
    ("math", "(2,12) \\cup (12,102)", "(2, 12) \\cup (12, 102)"),
    ("olympiad_bench", "$\\frac{1}{2 n+2}$", "\\frac{1}{2n+2}"),
    ("olympiad_bench", "$2^{1009}$", "2^{1009}"),
    ("olympiad_bench", "$(2,4)$", "(2, 4)"),
    ("olympiad_bench", "$1003$", "1003"),
    ("olympiad_bench", "$k=1$", "1"),
    ("olympiad_bench", "$69$,$84$", "69, 84"),
    ("olympiad_bench", "$\\binom{2n}{n}$", "\\binom{2n}{n}"),
    ("minerva", "1.6", "1.60"),
]

BOXED_WRONG = [
    ("aime", "025", "52"),
    ("aime", "204", "205"),
    ("amc", "142.0", "142.5"),
    ("math", "\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{3})"),
    ("math", "\\frac{14}{3}", "\\frac{3}{14}"),
    ("math", "3\\sqrt{13}", "3\\sqrt{31}"),
    ("math", "90^\\circ", "45^\\circ"),
    ("math", "\\text{Evelyn}", "\\text{Evan}"),
    ("math", "p - q", "q - p"),
    ("math", "(3,4]", "(3,4)"),
    ("math", "(-\\infty, 0]", "(-\\infty, 0)"),
    ("olympiad_bench", "$\\frac{1}{2 n+2}$", "\\frac{1}{2n+1}"),
    ("olympiad_bench", "$2^{1009}$", "2^{1010}"),
    ("olympiad_bench", "$(2,4)$", "(4, 2)"),
]


def _response(answer: str) -> str:
    return (
        "Let me think about the problem step by step. If $x = 2$ then ... wait, "
        "\\boxed{999} was only a guess.\n</think>\n\n"
        f"Putting everyhing together, the final answer is $\\boxed{{{answer}}}$.<|im_end|>"
    )


@pytest.mark.parametrize(("source", "gold", "answer"), BOXED_CORRECT)
def test_boxed_correct_answers(source: str, gold: str, answer: str) -> None:
    grade = boxed(_response(answer), gold)
    assert grade.reward == 1.0, (source, gold, answer, grade)
    assert grade.reason == "correct"
    assert grade.extracted == answer


@pytest.mark.parametrize(("source", "gold", "answer"), BOXED_WRONG)
def test_boxed_wrong_answers(source: str, gold: str, answer: str) -> None:
    grade = boxed(_response(answer), gold)
    assert grade == Grade(0.0, "wrong_answer", answer), (source, gold)


def test_boxed_eval_rules() -> None:
    # the box inside the think block does not count when </think> is present
    assert boxed("\\boxed{204} </think> no final box", "204") == Grade(0.0, "no_answer", None)
    # without </think> the whole output is graded (no format gate at evaluation)
    assert boxed("no think tags, answer \\boxed{204}", "204").reward == 1.0
    # the LAST box wins
    assert boxed("</think> \\boxed{204} or rather \\boxed{205}", "204").reward == 0.0
    # unboxed answers score 0
    assert boxed("</think> The answer is 204.", "204") == Grade(0.0, "no_answer", None)
    assert boxed("</think> \\fbox{204}", "204").reward == 1.0
    assert boxed("</think> \\boxed{}", "204").reason == "no_answer"
    assert boxed("</think> \\boxed{5}", "\\boxed{5}").reward == 1.0
    assert boxed("</think> \\boxed{5}", "$$").reason == "bad_gold"


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("025", "25"),
        ("142.0", "142"),
        ("-4.0", "-4"),
        ("1,234", "1234"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("$\\frac{1}{2 n+2}$", "\\frac{1}{2n+2}"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("\\tfrac{3}{4}", "\\frac{3}{4}"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("90^\\circ", "90"),
        ("45^{\\circ}", "45"),
        ("25\\%", "25"),
        ("10\\text{ cm}", "10"),
        ("5 \\text{ inches}", "5"),
        ("12 dollars", "12"),
        ("\\text{Evelyn}", "Evelyn"),
        ("x = 5", "5"),
        ("f(x)=2 x", "f(x)=2x"),
        ("3/4", "\\frac{3}{4}"),
        ("\\!1,\\!000", "1000"),
        ("2\\pi r", "2\\pi r"),
        ("5.", "5"),
    ],
)
def test_normalize_answer(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


def test_answers_equivalent_fallbacks() -> None:
    assert answers_equivalent("0.5", "\\frac{1}{2}")  # sympy (numeric)
    assert answers_equivalent("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")  # sympy (exact)
    assert answers_equivalent("2(n+1)", "2n+2")  # sympy (symbolic)
    assert answers_equivalent("-2, 1", "1,-2")  # Math-Verify: unordered solution sets
    assert not answers_equivalent("0.333", "\\frac{1}{3}")
    assert not answers_equivalent("2^{10000}", "2^{10001}", use_math_verify=False)  # sympy skipped


@needs(TEST_ID)
def test_boxed_on_benchmark_golds() -> None:
    import pyarrow.parquet as pq

    rows = pq.read_table(TEST_ID, columns=["data_source", "reward_model"]).to_pylist()
    golds_by_source: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        gold = row["reward_model"]["ground_truth"]
        if gold not in golds_by_source[row["data_source"]]:
            golds_by_source[row["data_source"]].append(gold)
    all_golds = {g for golds in golds_by_source.values() for g in golds}
    for _, gold, _ in BOXED_CORRECT + BOXED_WRONG:
        assert gold in all_golds, gold
    # every gold, boxed as written (minus a $...$ wrapper), grades as correct
    for golds in golds_by_source.values():
        for gold in golds:
            inner = (
                gold[1:-1] if gold.startswith("$") and gold.endswith("$") and gold.count("$") == 2 else gold
            )
            assert boxed(_response(inner), gold).reward == 1.0, gold
    # a different gold of the same benchmark grades as wrong (a small sample per benchmark)
    for golds in golds_by_source.values():
        for gold, other in list(itertools.pairwise(golds))[:8]:
            if normalize_answer(other) != normalize_answer(gold):
                assert boxed(_response(other.strip("$")), gold).reward == 0.0, (gold, other)


# --------------------------------------------------------------------------------------------
# choice grader (ARC-c, GPQA)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        "C",
        "(C)",
        "C)",
        "c",
        "\\text{C}",
        "\\textbf{(C)}",
        "C. Planetary days will become shorter.",
        "Option C",
    ],
)
def test_choice_correct(answer: str) -> None:
    grade = choice(f"reasoning </think> The answer is \\boxed{{{answer}}}", "C")
    assert grade == Grade(1.0, "correct", "C")


def test_choice_wrong_and_missing() -> None:
    assert choice("</think> \\boxed{B}", "C") == Grade(0.0, "wrong_answer", "B")
    assert choice("</think> The answer is C", "C") == Grade(0.0, "no_answer", None)
    assert choice("</think> \\boxed{Apple}", "A").reason == "no_answer"
    assert choice("\\boxed{C} </think> \\boxed{D}", "C").reward == 0.0
    # ARC-c rows whose options are numbered have numeric golds
    assert choice("</think> \\boxed{2}", "2").reward == 1.0
    assert choice("</think> \\boxed{B}", "2").reward == 0.0
    assert choice("</think> \\boxed{B}", "").reason == "bad_gold"
    assert normalize_choice("(d)") == "D"
    assert normalize_choice("the answer is: A") == "A"


@needs(ARC_C, GPQA)
def test_choice_on_ood_golds() -> None:
    import pyarrow.parquet as pq

    for path in (ARC_C, GPQA):
        golds = {
            r["ground_truth"] for r in pq.read_table(path, columns=["reward_model"]).column(0).to_pylist()
        }
        assert golds <= {"A", "B", "C", "D", "1", "2", "3", "4"}
        for gold in golds:
            assert choice(f"</think> \\boxed{{{gold}}}", gold).reward == 1.0
            other = "B" if gold != "B" else "A"
            assert choice(f"</think> \\boxed{{{other}}}", gold).reward == 0.0


# --------------------------------------------------------------------------------------------
# arithmetic grader
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1234", 1234),
        ("1,234", 1234),
        ("1{,}234", 1234),
        ("1\\,234", 1234),
        ("-5", -5),
        ("+5", 5),
        ("\u22125", -5),
        (" $42$ ", 42),
        ("\\text{7}", 7),
        ("12,34", None),
        ("12.5", None),
        ("1e3", None),
        ("", None),
        ("9" * 2000, None),
    ],
)
def test_parse_integer(text: str, value: int | None) -> None:
    assert parse_integer(text) == value


def test_arithmetic_grader() -> None:
    assert arithmetic("17 * 3 = 51 </think> \\boxed{51}", "51") == Grade(1.0, "correct", "51")
    assert arithmetic("</think> \\boxed{1,234}", "1234").reward == 1.0
    assert arithmetic("</think> \\boxed{-5}", "-5").reward == 1.0
    assert arithmetic("</think> \\boxed{-5}", "5") == Grade(0.0, "wrong_answer", "-5")
    assert arithmetic("</think> \\boxed{5.0}", "5") == Grade(0.0, "not_integer", "5.0")
    assert arithmetic("</think> the answer is 51", "51") == Grade(0.0, "no_answer", None)
    assert arithmetic("no think close \\boxed{51}", "51") == Grade(0.0, "no_think_close", None)
    assert arithmetic("a </think> b </think> \\boxed{51}", "51").reason == "no_answer"
    assert arithmetic("</think> \\boxed{51}", "fifty-one").reason == "bad_gold"


# --------------------------------------------------------------------------------------------
# bad model output: reward 0 and a reason, never an exception
# --------------------------------------------------------------------------------------------

GARBAGE_UNICODE = "".join(chr(c) for c in range(0x2000, 0x2400)) + "\ud800\udfff\U0001f600" * 50
CONTROL_CHARS = "".join(chr(c) for c in range(32)) + "\x7f\x1b[31m"

# case -> (response, expected reason for math_think, boxed, choice, arithmetic)
BAD_OUTPUTS: dict[str, tuple[str, tuple[str, str, str, str]]] = {
    "empty": ("", ("empty", "empty", "empty", "empty")),
    "whitespace": ("  \n\t ", ("empty", "empty", "empty", "empty")),
    "truncated_in_think": (
        "Let me think about x^2 + ",
        ("no_think_close", "no_answer", "no_answer", "no_think_close"),
    ),
    "truncated_in_box": ("ok </think> the answer is \\boxed{12", ("no_answer",) * 4),
    "no_answer": ("ok </think> I cannot solve this.", ("no_answer",) * 4),
    "garbage_unicode": ("</think>" + GARBAGE_UNICODE, ("no_answer",) * 4),
    "control_chars": (
        "</think>" + CONTROL_CHARS + "\\boxed{\x00\x01}",
        ("wrong_answer", "wrong_answer", "no_answer", "not_integer"),
    ),
    "huge_answer": (
        "ok </think> \\boxed{" + "9" * 100_000 + "}",
        ("wrong_answer", "wrong_answer", "no_answer", "not_integer"),
    ),
    "huge_text": ("x" * 100_000 + " </think> " + "y" * 1000, ("no_answer",) * 4),
    "nested_boxes": ("</think>" + "\\boxed{" * 2000, ("no_answer",) * 4),
}
BAD_OUTPUT_GRADERS = ("math_think", "boxed", "choice", "arithmetic")


@pytest.mark.parametrize("grader_index", range(len(BAD_OUTPUT_GRADERS)), ids=BAD_OUTPUT_GRADERS)
@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
def test_bad_output_scores_zero(grader_index: int, case: str) -> None:
    name = BAD_OUTPUT_GRADERS[grader_index]
    response, reasons = BAD_OUTPUTS[case]
    gold = "C" if name == "choice" else "42"
    grade = get_grader(name)(response, gold)
    assert grade.reward == 0.0
    assert grade.reason == reasons[grader_index]
    # through the capped, time-limited in-process path (100k-character inputs are cut to their tail)
    assert grade_one(name, response, gold, timeout_s=20.0).reward == 0.0


def test_non_string_inputs() -> None:
    for name in BUILTIN_GRADERS:
        grader = get_grader(name)
        assert grader(None, "1") == Grade(0.0, "error:TypeError", None)  # type: ignore[arg-type]  # on purpose
        assert grader("1", 1) == Grade(0.0, "error:TypeError", None)  # type: ignore[arg-type]  # on purpose


# --------------------------------------------------------------------------------------------
# caps, coercion, grade_one
# --------------------------------------------------------------------------------------------


def test_cap_inputs_tail_and_reject() -> None:
    long = "x" * 60_000 + " </think> \\boxed{7}"
    capped = cap_inputs(long, "7", max_chars=50_000)
    assert isinstance(capped, tuple) and len(capped[0]) == 50_000 and capped[0].endswith("\\boxed{7}")
    assert cap_inputs(long, "7", max_chars=50_000, overlong="reject") == Grade(0.0, "too_long", None)
    assert cap_inputs("ok", "7" * 20_000) == Grade(0.0, "too_long", None)
    assert grade_one("boxed", long, "7").reward == 1.0  # graded on its tail
    assert grade_one("boxed", long, "7", overlong="reject") == Grade(0.0, "too_long", None)


def test_coerce_grade() -> None:
    assert coerce_grade(True) == Grade(1.0, "user", None)
    assert coerce_grade(0) == Grade(0.0, "user", None)
    assert coerce_grade(float("nan")).reason == "error:BadReturn"
    assert coerce_grade("1").reason == "error:BadReturn"
    assert coerce_grade(Grade(1, "ok", "x" * 1000)).extracted is not None
    assert len(coerce_grade(Grade(1, "ok", "x" * 1000)).extracted or "") < 300


def test_grade_one_timeouts_and_errors() -> None:
    user = "exgrpo_rollout.graders.examples:misbehaving"
    assert grade_one(user, "HANG", "x", timeout_s=0.3) == Grade(0.0, "timeout", None)
    assert grade_one(user, "SPIN", "x", timeout_s=0.3) == Grade(0.0, "timeout", None)
    assert grade_one(user, "RAISE", "x") == Grade(0.0, "error:RuntimeError", None)
    assert grade_one(user, "GARBAGE", "x") == Grade(0.0, "error:BadReturn", None)
    assert grade_one(user, "ok", "ok").reward == 1.0
    assert grade_one(exact_match, "ok", "ok", timeout_s=None).reward == 1.0
    # a real pathological answer: a power tower makes Math-Verify/sympy run for a very long time
    tower = "a </think> \\boxed{2^{2^{2^{2^{2^{2}}}}}}"
    assert grade_one("math_think", tower, "5", timeout_s=0.5) == Grade(0.0, "timeout", None)
    with pytest.raises(ValueError):
        grade_one("math_think", "x", "1", timeout_s=0)


def test_grade_one_refuses_threads_with_a_timeout() -> None:
    errors: list[BaseException] = []
    results: list[Grade] = []

    def run() -> None:
        try:
            grade_one("arithmetic", "</think> \\boxed{1}", "1")
        except RuntimeError as exc:
            errors.append(exc)
        results.append(grade_one("arithmetic", "</think> \\boxed{1}", "1", timeout_s=None))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert results == [Grade(1.0, "correct", "1")]


def test_math_verify_timeout_setting() -> None:
    assert math_verify_timeout() == 5
    with external_deadline():
        assert math_verify_timeout() is None
    seen: list[int | None] = []
    thread = threading.Thread(target=lambda: seen.append(math_verify_timeout()))
    thread.start()
    thread.join()
    assert seen == [None]


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def test_registry_builtins() -> None:
    assert get_grader("math_think") is math_think
    assert get_grader("boxed") is boxed
    assert get_grader("choice") is choice
    assert get_grader("arithmetic") is arithmetic
    assert set(BUILTIN_GRADERS) >= {"math_think", "boxed", "choice", "arithmetic"}


def test_registry_dotted_paths() -> None:
    assert get_grader("exgrpo_rollout.graders.examples:exact_match") is exact_match
    assert get_grader("exgrpo_rollout.graders.examples.exact_match") is exact_match
    assert get_grader("exgrpo_rollout.graders.examples:misbehaving") is misbehaving
    assert get_grader("exgrpo_rollout.graders.examples:exact_match")(" 4 ", "4").reward == 1.0
    assert get_grader("exgrpo_rollout.graders.boxed:Grade") is Grade  # any callable is accepted


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "unknown grader"),
        ("", "non-empty"),
        ("no_such_pkg.mod:fn", "cannot import"),
        ("exgrpo_rollout.graders.examples:missing", "no attribute"),
        ("exgrpo_rollout.graders.examples:NOT_A_GRADER", "non-callable"),
        ("exgrpo_rollout.graders.examples.NOT_A_GRADER", "non-callable"),
        ("exgrpo_rollout.graders.examples:", "expected"),
        (":fn", "expected"),
        ("exgrpo_rollout.graders.examples:1bad", "attribute path"),
    ],
)
def test_registry_errors(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_grader(name)
