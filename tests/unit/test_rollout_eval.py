"""Evaluation (spec 9.1): avg@k aggregation over duplicated rows, grader choice, row loading, and
the generate-grade pipeline with a scripted engine."""

from __future__ import annotations

import pytest
from shared_data import VALID, needs
from transformers import PreTrainedTokenizerFast

from exgrpo_onebox.tiny import build_tokenizer
from exgrpo_rollout.engines.base import Completion, GenerationStats, SamplingConfig
from exgrpo_rollout.evaluate import (
    EvalRow,
    SampleRecord,
    aggregate,
    evaluate,
    grader_for,
    load_rows,
)


def _record(source: str, index: int, reward: float) -> SampleRecord:
    return SampleRecord(source, index, f"q{index}", "", "1", reward, "x", "boxed", "stop", 1)


def test_avg_at_k_from_duplicated_rows() -> None:
    rewards = {0: [1, 0, 1, 1], 1: [0, 1, 0, 1]}  # two questions, four copies each
    records = [_record("aime", q, r) for q, rs in rewards.items() for r in rs]
    records += [_record("math", i, r) for i, r in enumerate([1, 0, 0])]
    summary = aggregate(records)
    aime, math = summary.benchmarks
    assert (aime.data_source, aime.num_rows, aime.num_questions, aime.metric) == ("aime", 8, 2, "avg@4")
    assert aime.accuracy == pytest.approx(5 / 8)  # mean over rows = mean over questions of avg@4
    assert (math.num_rows, math.num_questions, math.metric) == (3, 3, "pass@1")
    assert math.accuracy == pytest.approx(1 / 3)
    assert summary.average == pytest.approx((5 / 8 + 1 / 3) / 2)  # unweighted over benchmarks
    assert summary.to_dict()["benchmarks"][0] == {
        "data_source": "aime", "metric": "avg@4", "rows": 8, "questions": 2, "accuracy": 0.625,
    }  # fmt: skip
    with pytest.raises(ValueError):
        aggregate([])


def test_grader_for_sources() -> None:
    assert [grader_for(s) for s in ("aime", "math", "arc_c", "gpqa", "mmlu_pro")] == [
        "boxed", "boxed", "choice", "choice", "choice",
    ]  # fmt: skip
    assert grader_for("arc_c", "boxed") == "boxed"


@needs(VALID)
def test_load_rows_limit_per_source() -> None:
    rows = load_rows(VALID, limit=3)
    sources = [r.data_source for r in rows]
    assert len(rows) == 18 and all(sources.count(s) == 3 for s in set(sources))
    aime = [r for r in rows if r.data_source == "aime"]
    assert [r.index for r in aime] == [0, 0, 0]  # the file stores each AIME question's 8 copies in a row
    assert [m["role"] for m in aime[0].messages] == ["system", "user"]


class ScriptedEngine:
    """Answers each prompt with a fixed text chosen by a substring of the prompt."""

    name = "scripted"

    def __init__(self, tok: PreTrainedTokenizerFast, answers: dict[str, str]) -> None:
        self.tok, self.answers = tok, answers
        self.eos_ids = {tok.eos_token_id}
        self.calls: list[tuple[int, int]] = []
        self._stats = GenerationStats()

    @property
    def last_stats(self) -> GenerationStats:
        return self._stats

    def load_weights(self, path: str) -> None:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        self.calls.append((len(prompts), sampling.n))
        assert sampling.temperature == 0.6 and sampling.top_p == 1.0
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            answer = next(a for key, a in self.answers.items() if key in text)
            ids = self.tok(answer, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append([Completion(token_ids=ids, logprobs=[0.0] * len(ids)) for _ in range(sampling.n)])
        return out


def test_evaluate_pipeline_with_a_scripted_engine() -> None:
    tok = build_tokenizer()
    system = {"role": "system", "content": "SYSTEM"}
    rows = [
        EvalRow("aime", 0, [system, {"role": "user", "content": "one plus one"}], "2"),
        EvalRow("aime", 0, [system, {"role": "user", "content": "one plus one"}], "2"),
        EvalRow("math", 7, [system, {"role": "user", "content": "two times two"}], "4"),
        EvalRow("arc_c", 3, [system, {"role": "user", "content": "pick a letter"}], "B"),
    ]
    engine = ScriptedEngine(tok, {
        "one plus one": "so </think> the answer is \\boxed{2}",
        "two times two": "</think> it is 4",  # unboxed: 0 under the boxed grader
        "pick a letter": "</think> \\boxed{(B)}",
    })  # fmt: skip
    records = evaluate(
        engine, tok, rows, sampling=SamplingConfig(temperature=0.6, max_new_tokens=8), grading=None
    )
    assert sorted(engine.calls) == [(1, 2), (2, 1)]  # duplicated rows share one prompt with n = 2
    assert [r.data_source for r in records] == ["aime", "aime", "math", "arc_c"]
    assert [r.grader for r in records] == ["boxed", "boxed", "boxed", "choice"]
    assert [r.reward for r in records] == [1.0, 1.0, 0.0, 1.0]
    assert records[2].reason == "no_answer"
    assert all("SYSTEM" not in r.prompt and r.prompt.endswith("<think>\n") for r in records)
    assert records[0].response == "so </think> the answer is \\boxed{2}"  # EOS removed
    assert records[0].num_tokens == len(tok(records[0].response)["input_ids"]) + 1
    summary = aggregate(records)
    assert [(b.data_source, b.accuracy) for b in summary.benchmarks] == [
        ("aime", 1.0), ("arc_c", 1.0), ("math", 0.0),
    ]  # fmt: skip
