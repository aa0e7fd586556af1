"""Benchmark evaluation with the protocol of spec section 9.1.

- Data: a question file (parquet in the verl/ExGRPO layout, or JSON Lines), one row per sample.
  Benchmarks that report avg@k store each question k times (AIME24/25 and AMC: 32 copies in
  `test.id.parquet`), the others once (pass@1 = avg@1).
- Prompt: the system message is dropped and the model's own chat template is applied to the rest
  with the generation prompt (`drop_system=False` keeps it, as in-training validation does).
- Decoding: temperature 0.6, top_p 1.0, one sample per row. Rows whose prompts are identical are
  generated together as one prompt with `n` = their number of copies: the same independent samples
  as one request per row, with the prompt computed once.
- Scoring: the response is decoded with special tokens kept (a trailing EOS removed); when the
  templated prompt ends with ``<think>\\n`` that string is put in front of it. Graders: ``boxed``
  (last ``\\boxed{}`` answer, MATH normalisation, sympy, Math-Verify; no think-format gate) for math
  sources, ``choice`` for multiple-choice sources (ARC-c, GPQA, MMLU-Pro: data_source starting with
  ``arc``, ``gpqa`` or ``mmlu``); a named grader applies to every row.
- Metrics: accuracy per data_source = mean reward over its rows; the reported average is the
  unweighted mean over data sources. No pass@k with k > 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exgrpo_rollout.engines.base import Completion, GenerationEngine, SamplingConfig
from exgrpo_rollout.prompts import render_prompt_text

if TYPE_CHECKING:
    from exgrpo_rollout.graders import GradingPool

__all__ = [
    "CHOICE_SOURCE_PREFIXES",
    "BenchmarkScore",
    "EvalRow",
    "EvalSummary",
    "SampleRecord",
    "aggregate",
    "evaluate",
    "grader_for",
    "load_rows",
    "write_jsonl",
]

CHOICE_SOURCE_PREFIXES = ("arc", "gpqa", "mmlu")
THINK_OPEN = "<think>\n"


def grader_for(data_source: str, grader: str = "auto") -> str:
    """`choice` for multiple-choice sources and `boxed` otherwise when `grader` is auto."""
    if grader != "auto":
        return grader
    ds = data_source.strip().lower()
    return "choice" if ds.startswith(CHOICE_SOURCE_PREFIXES) else "boxed"


@dataclass(frozen=True)
class EvalRow:
    data_source: str
    index: Any
    """The row's question index within its benchmark (extra_info.index), or None."""
    messages: list[dict[str, str]]
    ground_truth: str


@dataclass
class SampleRecord:
    data_source: str
    index: Any
    prompt: str
    """The templated prompt text the model saw (before any left cut)."""
    response: str
    gold: str
    reward: float
    reason: str
    grader: str
    finish_reason: str
    num_tokens: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False, default=str)


@dataclass(frozen=True)
class BenchmarkScore:
    data_source: str
    num_rows: int
    num_questions: int
    accuracy: float

    @property
    def samples_per_question(self) -> float:
        return self.num_rows / self.num_questions if self.num_questions else 0.0

    @property
    def metric(self) -> str:
        k = self.samples_per_question
        if k == 1:
            return "pass@1"
        return f"avg@{round(k)}" if float(k).is_integer() else f"avg@{k:.2f}"


@dataclass(frozen=True)
class EvalSummary:
    benchmarks: list[BenchmarkScore]
    average: float
    """Unweighted mean of the benchmarks' accuracies."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmarks": [
                {
                    "data_source": b.data_source,
                    "metric": b.metric,
                    "rows": b.num_rows,
                    "questions": b.num_questions,
                    "accuracy": b.accuracy,
                }
                for b in self.benchmarks
            ],
            "average": self.average,
        }


def load_rows(path: str | Path, limit: int | None = None) -> list[EvalRow]:
    """Rows of a question file, in file order; `limit` keeps the first N rows of each data_source."""
    from exgrpo_client.io import read_questions

    if limit is not None and limit < 1:
        raise ValueError("limit must be >= 1")
    seen: Counter[str] = Counter()
    rows: list[EvalRow] = []
    for chunk in read_questions(path):
        for q in chunk:
            if limit is not None and seen[q.data_source] >= limit:
                continue
            seen[q.data_source] += 1
            index = q.metadata.get("index", q.external_id)
            messages = [{"role": m.role, "content": m.content} for m in q.prompt]
            rows.append(EvalRow(q.data_source, index, messages, q.ground_truth))
    return rows


def aggregate(records: Iterable[SampleRecord]) -> EvalSummary:
    """Accuracy per data_source (mean reward over its rows; duplicated rows give avg@k) and the
    unweighted mean over data sources. Questions are told apart by index (prompt text if None)."""
    rewards: dict[str, list[float]] = {}
    questions: dict[str, set[Any]] = {}
    for r in records:
        rewards.setdefault(r.data_source, []).append(float(r.reward))
        questions.setdefault(r.data_source, set()).add(r.prompt if r.index is None else r.index)
    if not rewards:
        raise ValueError("nothing to aggregate: no evaluated rows")
    scores = [
        BenchmarkScore(ds, len(vals), len(questions[ds]), sum(vals) / len(vals))
        for ds, vals in sorted(rewards.items())
    ]
    return EvalSummary(scores, sum(b.accuracy for b in scores) / len(scores))


def _response_ids(c: Completion, eos_ids: set[int]) -> list[int]:
    ids = list(c.token_ids)
    if ids and ids[-1] in eos_ids:
        ids.pop()
    return ids


def _grade(
    items: Sequence[tuple[str, str, str]], grading: GradingPool | None, timeout_s: float
) -> list[tuple[float, str]]:
    """(reward, reason) per (grader, response, gold), graded in groups of one grader."""
    from exgrpo_rollout.graders import grade_items

    out: list[tuple[float, str] | None] = [None] * len(items)
    by_grader: dict[str, list[int]] = {}
    for i, (name, _, _) in enumerate(items):
        by_grader.setdefault(name, []).append(i)
    for name, idx in by_grader.items():
        grades = grade_items(name, [(items[i][1], items[i][2]) for i in idx], timeout_s, grading)
        for i, g in zip(idx, grades, strict=True):
            out[i] = (float(g.reward), g.reason)
    assert all(o is not None for o in out)
    return [o for o in out if o is not None]


def evaluate(
    engine: GenerationEngine,
    tokenizer: Any,
    rows: Sequence[EvalRow],
    *,
    sampling: SamplingConfig | None = None,
    grader: str = "auto",
    grading: GradingPool | None = None,
    grading_timeout_s: float = 5.0,
    drop_system: bool = True,
    max_prompt_len: int | None = None,
    prompts_per_call: int = 64,
    progress: Callable[[int], None] | None = None,
) -> list[SampleRecord]:
    """Generate one sample per row and grade it; records come back in row order.

    `sampling` defaults to temperature 0.6, top_p 1.0, 8192 new tokens (its `n` is ignored: each
    distinct prompt gets n = its number of rows). `grading` is a `GradingPool` or None (grade in
    process). `progress(rows_done)` is called after each engine call.
    """
    base = sampling or SamplingConfig(temperature=0.6, top_p=1.0, max_new_tokens=8192)
    texts = [render_prompt_text(tokenizer, r.messages, drop_system) for r in rows]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, text in enumerate(texts):
        ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            ids = ids[-max_prompt_len:]
        groups.setdefault(tuple(ids), []).append(i)
    completions: list[Completion | None] = [None] * len(rows)
    by_n: dict[int, list[tuple[int, ...]]] = {}
    for key, members in groups.items():
        by_n.setdefault(len(members), []).append(key)
    done = 0
    for n, keys in sorted(by_n.items()):
        for start in range(0, len(keys), prompts_per_call):
            chunk = keys[start : start + prompts_per_call]
            out = engine.generate([list(k) for k in chunk], dataclasses.replace(base, n=n))
            for key, cs in zip(chunk, out, strict=True):
                for i, completion in zip(groups[key], cs, strict=True):
                    completions[i] = completion
            done += n * len(chunk)
            if progress is not None:
                progress(done)
    eos_ids = set(getattr(engine, "eos_ids", set()))
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    responses: list[str] = []
    items: list[tuple[str, str, str]] = []
    for row, text, c in zip(rows, texts, completions, strict=True):
        assert c is not None
        response = str(tokenizer.decode(_response_ids(c, eos_ids), skip_special_tokens=False))
        responses.append(response)
        graded = (THINK_OPEN + response) if text.endswith(THINK_OPEN) else response
        items.append((grader_for(row.data_source, grader), graded, row.ground_truth))
    grades = _grade(items, grading, grading_timeout_s)
    records = []
    for row, text, c, response, item, (reward, reason) in zip(
        rows, texts, completions, responses, items, grades, strict=True
    ):
        assert c is not None
        records.append(
            SampleRecord(
                data_source=row.data_source,
                index=row.index,
                prompt=text,
                response=response,
                gold=row.ground_truth,
                reward=reward,
                reason=reason,
                grader=item[0],
                finish_reason=c.finish_reason,
                num_tokens=len(c.token_ids),
            )
        )
    return records


def write_jsonl(records: Iterable[SampleRecord], path: str | Path) -> int:
    """Write one JSON object per record; returns the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")
            n += 1
    return n


def format_accuracy(value: float) -> str:
    return "nan" if math.isnan(value) else f"{100 * value:.1f}"
