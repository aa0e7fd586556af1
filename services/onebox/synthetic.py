"""A synthetic, verifiable task family with controllable difficulty: multi-step integer arithmetic.

A problem is a chain of operations applied left to right to a starting number, written as one
expression with the brackets that precedence needs, e.g. ``(7+5)*3-8``. Its reference solution is
a think-then-answer trace, one step per operation, then the boxed result:

    <think>
    7+5=12, 12*3=36, 36-8=28
    </think> \\boxed{28}

The chat template's generation prompt already opens ``<think>\\n``, so the response (what
`reference_response` returns) starts inside the think block. Both the ``arithmetic`` grader and the
training reward ``math_think`` score a reference response 1.0.

Difficulty levels (`LEVELS`) set the number of operations and the sizes of operands and values:
every value of a chain stays in ``[1, max_value]``, so answers are positive integers. Level 1 (one
operation) has about 300 distinct problems, level 2 a few thousand, the others many more.

Train / held-out: every problem belongs to one of two fixed partitions of the problem space, chosen
by a hash of its expression (`is_heldout`, about a quarter held out). Training questions and
supervised traces are drawn from the training partition and evaluation problems from the held-out
one, so no held-out expression is ever trained on, whatever the sizes and seeds of the sets.

Task families (`FAMILIES`): ``arithmetic`` (levels 1-5 above, `LEVELS`) and ``calibrated``
(`CALIBRATED_LEVELS`): longer chains over the same table of facts, whose mix (`CALIBRATED_MIX`) is
chosen so that the main job's warm-started model solves a small share of the training questions at
the start of a run and the per-question solve rates spread over the whole range (see
`exgrpo_onebox.calibrate`, which measures the starting solve rate per level and picks the mix).
Functions that draw problems take `family=`; a family's data sources are ``<prefix>_d<level>``.

Questions are written in the verl/ExGRPO parquet layout of the evaluation files: ``prompt`` (a list
of ``{role, content}`` messages), ``reward_model`` (``{ground_truth, style="rule"}``),
``data_source`` (``arith_d<level>``), ``ability`` and ``extra_info`` (``{index, split}``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "ABILITY",
    "CALIBRATED_LEVELS",
    "CALIBRATED_MIX",
    "DEFAULT_MIX",
    "FAMILIES",
    "HELDOUT_SHARE",
    "LEVELS",
    "Family",
    "Level",
    "Mix",
    "Problem",
    "Split",
    "direct_response",
    "get_family",
    "is_heldout",
    "make_problems",
    "make_questions",
    "make_splits",
    "parse_mix",
    "problem_stream",
    "reference_response",
    "write_parquet",
]

ABILITY = "arithmetic"
HELDOUT_SHARE = 0.25
"""Share of the problem space in the held-out partition."""

Split = Literal["train", "heldout"]
Mix = Mapping[int, float] | Sequence[int] | int | None
"""A difficulty mix: {level: weight}, a list of levels (equal weights), one level, or None."""


@dataclass(frozen=True)
class Level:
    """One difficulty: `num_ops` operations with operands 1..`max_operand` and multipliers
    2..`max_factor`, every value of the chain in [0, `max_value`]."""

    num_ops: int
    max_operand: int
    max_value: int
    max_factor: int


LEVELS: dict[int, Level] = {
    1: Level(num_ops=1, max_operand=9, max_value=20, max_factor=3),
    2: Level(num_ops=2, max_operand=9, max_value=20, max_factor=3),
    3: Level(num_ops=3, max_operand=9, max_value=20, max_factor=3),
    4: Level(num_ops=5, max_operand=9, max_value=20, max_factor=3),
    5: Level(num_ops=5, max_operand=20, max_value=99, max_factor=5),
}
"""Difficulty levels. Levels 1-4 chain 1, 2, 3 and 5 operations over the same small table of
facts (values up to 20, operands up to 9): a model that gets a step right with probability p
solves a level-n problem with about p**n. Level 5 adds larger numbers (values up to 99)."""

DEFAULT_MIX: dict[int, float] = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
"""Equal shares of levels 1-4."""

CALIBRATED_LEVELS: dict[int, Level] = {
    level: Level(num_ops=ops, max_operand=9, max_value=20, max_factor=3)
    for level, ops in {1: 3, 2: 4, 3: 5, 4: 6, 5: 7}.items()
}
"""Levels of the calibrated family: chains of 3, 4, 5, 6 and 7 operations over the facts of levels
1-4 (values up to 20, operands up to 9), so every step is one the warm start was trained on and
difficulty comes from the length of the chain (the warm start saw chains of at most 5)."""

CALIBRATED_MIX: dict[int, float] = {1: 0.15, 2: 0.2, 3: 0.18, 4: 0.23, 5: 0.23}
"""The calibrated family's mix, picked by `exgrpo_onebox.calibrate` (target 0.2) from the starting
solve rates of the main job's warm start at temperature 1.0, measured on 40 training questions per
level, 4 samples each: 0.43, 0.21, 0.29, 0.09, 0.09 for levels 1-5 (docs/results.md, "Calibrated
setting"). The mix solves about 20% of its questions."""


@dataclass(frozen=True)
class Family:
    """A task family: its difficulty levels, default mix and data-source prefix."""

    name: str
    levels: Mapping[int, Level]
    mix: Mapping[int, float]
    prefix: str
    """Data sources are ``<prefix>_d<level>``."""


FAMILIES: dict[str, Family] = {
    "arithmetic": Family("arithmetic", LEVELS, DEFAULT_MIX, "arith"),
    "calibrated": Family("calibrated", CALIBRATED_LEVELS, CALIBRATED_MIX, "calib"),
}
"""Task families by name (`job.family` of the one-box job, `exgrpo experiment --family`)."""


def get_family(name: str) -> Family:
    """The family called `name`; ValueError naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown task family {name!r}: use one of {', '.join(FAMILIES)}") from None


@dataclass(frozen=True)
class Problem:
    expression: str
    """The question text, e.g. ``(7+5)*3-8``."""
    steps: tuple[tuple[int, str, int, int], ...]
    """(left, op, right, result) per operation, in evaluation order."""
    difficulty: int
    family: str = "arithmetic"

    @property
    def answer(self) -> int:
        return self.steps[-1][3]

    @property
    def data_source(self) -> str:
        return f"{FAMILIES[self.family].prefix}_d{self.difficulty}"

    def to_row(self, index: int, split: str) -> dict[str, Any]:
        """The question as one row of the verl/ExGRPO parquet layout."""
        return {
            "data_source": self.data_source,
            "prompt": [{"role": "user", "content": self.expression}],
            "ability": ABILITY,
            "reward_model": {"ground_truth": str(self.answer), "style": "rule"},
            "extra_info": {"index": index, "split": split},
        }


def reference_response(problem: Problem) -> str:
    """The think-then-answer solution, as the model should write it after the generation prompt
    (which opens the think block): ``7+5=12, 12*3=36, 36-8=28\\n</think> \\boxed{28}``."""
    trace = ", ".join(f"{a}{op}{b}={c}" for a, op, b, c in problem.steps)
    return f"{trace}\n</think> \\boxed{{{problem.answer}}}"


def direct_response(problem: Problem) -> str:
    """An answer without reasoning (an empty think block): ``</think> \\boxed{28}``. Only level-1
    problems are reliably solved this way by a small model."""
    return f"</think> \\boxed{{{problem.answer}}}"


def is_heldout(expression: str) -> bool:
    """Whether a problem lies in the held-out partition (a fixed hash of its expression)."""
    return hashlib.sha256(expression.encode()).digest()[0] < round(256 * HELDOUT_SHARE)


# ------------------------------------------------------------------------------- generation
def _draw_step(rng: random.Random, value: int, level: Level) -> tuple[str, int, int]:
    """One operation applied to `value`: (op, operand, result), the result in [1, max_value]."""
    choices = ["+", "-", "*"]
    while True:
        op = rng.choice(choices)
        if op == "+" and value < level.max_value:
            b = rng.randint(1, min(level.max_operand, level.max_value - value))
            return op, b, value + b
        if op == "-" and value >= 2:
            b = rng.randint(1, min(level.max_operand, value - 1))
            return op, b, value - b
        if op == "*":
            top = min(level.max_factor, level.max_value // value)
            if top >= 2:
                b = rng.randint(2, top)
                return op, b, value * b
        choices.remove(op)  # + fits unless value == max_value, - unless value == 1


def _draw(rng: random.Random, difficulty: int, family: Family) -> Problem:
    level = family.levels[difficulty]
    value = rng.randint(1, level.max_value)
    expr = str(value)
    loose = False  # the expression so far ends in + or - at its top level
    steps = []
    for _ in range(level.num_ops):
        op, b, result = _draw_step(rng, value, level)
        if op == "*" and loose:
            expr = f"({expr})"
        expr = f"{expr}{op}{b}"
        loose = op in "+-"
        steps.append((value, op, b, result))
        value = result
    return Problem(expression=expr, steps=tuple(steps), difficulty=difficulty, family=family.name)


def _draw_in(rng: random.Random, difficulty: int, split: Split | None, family: Family) -> Problem:
    """A problem of the level from one partition (None: either)."""
    while True:
        p = _draw(rng, difficulty, family)
        if split is None or is_heldout(p.expression) == (split == "heldout"):
            return p


def parse_mix(mix: Mix, family: str = "arithmetic") -> dict[int, float]:
    """A difficulty mix of the family as {level: weight} (positive weights only, level order); None:
    the family's default mix."""
    fam = get_family(family)
    if mix is None:
        out = dict(fam.mix)
    elif isinstance(mix, int):
        out = {mix: 1.0}
    elif isinstance(mix, Mapping):
        out = {int(k): float(v) for k, v in mix.items()}
    else:
        out = {int(k): 1.0 for k in mix}
    unknown = sorted(k for k in out if k not in fam.levels)
    if unknown:
        raise ValueError(f"unknown difficulty levels {unknown}: use levels {sorted(fam.levels)}")
    if any(w < 0 for w in out.values()) or sum(out.values()) <= 0:
        raise ValueError(f"difficulty weights must be >= 0 with a positive sum, got {out}")
    return {k: w for k, w in sorted(out.items()) if w > 0}


def _quotas(n: int, mix: dict[int, float]) -> dict[int, int]:
    """`n` split over the levels in the proportions of `mix` (largest remainders)."""
    total = sum(mix.values())
    exact = {k: n * w / total for k, w in mix.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def problem_stream(
    seed: int, mix: Mix = None, *, split: Split | None = "train", run: int = 1, family: str = "arithmetic"
) -> Iterator[Problem]:
    """An endless stream of problems of one partition (None: both), levels drawn from `mix`.
    Repeats are possible; deterministic in `seed`. With `run` > 1 the level is drawn once per `run`
    consecutive problems."""
    weights = parse_mix(mix, family)
    fam = get_family(family)
    levels, probs = list(weights), list(weights.values())
    rng = random.Random(f"stream-{seed}" if family == "arithmetic" else f"stream-{family}-{seed}")
    while True:
        level = rng.choices(levels, probs)[0]
        for _ in range(run):
            yield _draw_in(rng, level, split, fam)


def make_problems(
    n: int,
    seed: int = 0,
    mix: Mix = None,
    *,
    split: Split | None = "train",
    exclude: Iterable[str] = (),
    max_repeats: int = 200,
    family: str = "arithmetic",
) -> list[Problem]:
    """`n` distinct problems of one partition (None: both), shuffled, per-level counts in the
    proportions of `mix`, none with an expression in `exclude`. Deterministic in the arguments.

    A level with fewer distinct problems than its share (level 1 has about 300 in all; a level counts as
    used up after `max_repeats` draws in a row give nothing new) passes the rest of its share on to
    the next level of the mix (the last level to the one before it)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    weights = parse_mix(mix, family)
    fam = get_family(family)
    quotas = _quotas(n, weights)
    levels = list(weights)
    rng = random.Random(
        f"problems-{seed}-{split}" if family == "arithmetic" else f"problems-{family}-{seed}-{split}"
    )
    seen = set(exclude)
    out: list[Problem] = []
    exhausted: set[int] = set()
    order = levels + levels[::-1][1:]  # up the levels, then back down for what the top could not take
    for i, level in enumerate(order):
        want = quotas.get(level, 0)
        quotas[level] = 0
        repeats = 0
        while want > 0 and level not in exhausted:
            p = _draw_in(rng, level, split, fam)
            if p.expression in seen:
                repeats += 1
                if repeats >= max_repeats:
                    exhausted.add(level)
                continue
            repeats = 0
            seen.add(p.expression)
            out.append(p)
            want -= 1
        if want > 0:
            nxt = next((lv for lv in order[i + 1 :] if lv not in exhausted), None)
            if nxt is None:
                raise ValueError(f"not enough distinct problems for n={n} with mix {weights}")
            quotas[nxt] = quotas.get(nxt, 0) + want
    rng.shuffle(out)
    return out


def make_questions(
    n: int,
    seed: int = 0,
    mix: Mix = None,
    *,
    split: Split = "train",
    exclude: Iterable[str] = (),
    family: str = "arithmetic",
) -> list[dict[str, Any]]:
    """`n` distinct questions of one partition as rows of the verl/ExGRPO parquet layout
    (`extra_info.split` names the partition); see `make_problems`."""
    problems = make_problems(n, seed, mix, split=split, exclude=exclude, family=family)
    return [p.to_row(i, split) for i, p in enumerate(problems)]


def make_splits(
    num_train: int,
    num_heldout: int,
    seed: int = 0,
    mix: Mix = None,
    *,
    heldout_mix: Mix = None,
    family: str = "arithmetic",
) -> tuple[list[Problem], list[Problem]]:
    """A training set (levels from `mix`) and a held-out set (levels from `heldout_mix`, default
    `mix`), from the two partitions: they never share an expression."""
    train = make_problems(num_train, seed, mix, split="train", family=family)
    held_mix = mix if heldout_mix is None else heldout_mix
    heldout = make_problems(num_heldout, seed, held_mix, split="heldout", family=family)
    return train, heldout


# ----------------------------------------------------------------------------------- parquet
def write_parquet(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Rows (from `make_questions` or `Problem.to_row`) as a parquet file with the column types of
    the ExGRPO evaluation files."""
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
        ]
    )
    table = pa.Table.from_pylist([{name: row[name] for name in schema.names} for row in rows], schema=schema)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out
