"""`exgrpo eval` on slices of the real benchmark files with the tiny random model: the accuracy is
about 0, so this checks the structure (tables, counts, avg@k labels, per-sample file) and that the
grader ran on every sample."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from shared_data import ARC_C, VALID, needs
from typer.testing import CliRunner

from exgrpo_cli.main import app
from exgrpo_onebox.tiny import build_tiny_model

GRADER_REASONS = {"correct", "wrong_answer", "no_answer", "empty", "bad_gold", "timeout"}

pytestmark = needs(VALID)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("eval") / "tiny")


def _eval(model: Path, data: Path, out: Path, *extra: str) -> dict[str, Any]:
    args = ["--json", "eval", "--model", str(model), "--data", str(data), "--out", str(out)]
    args += ["--max-new-tokens", "8", "--min-new-tokens", "2", "--max-prompt-len", "128"]
    args += ["--grading-workers", "0", "--device", "cpu", "--torch-threads", "1", *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_eval_on_a_valid_slice(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "samples.jsonl"
    summary = _eval(tiny_model, VALID, out, "--limit", "3")
    benchmarks = {b["data_source"]: b for b in summary["benchmarks"]}
    assert set(benchmarks) == {"aime", "aime25", "amc", "math", "minerva", "olympiad_bench"}
    assert all(b["rows"] == 3 for b in benchmarks.values()) and summary["rows"] == 18
    # the first 3 rows of aime/aime25/amc are copies of one question: avg@3; the others pass@1
    assert {s: (b["questions"], b["metric"]) for s, b in benchmarks.items()} == {
        "aime": (1, "avg@3"), "aime25": (1, "avg@3"), "amc": (1, "avg@3"),
        "math": (3, "pass@1"), "minerva": (3, "pass@1"), "olympiad_bench": (3, "pass@1"),
    }  # fmt: skip
    mean = sum(b["accuracy"] for b in benchmarks.values()) / len(benchmarks)
    assert summary["average"] == pytest.approx(mean)

    samples = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(samples) == 18 and summary["samples_file"] == str(out)
    for s in samples:
        assert {"data_source", "index", "prompt", "response", "gold", "reward", "reason"} <= set(s)
        assert s["grader"] == "boxed" and s["reason"] in GRADER_REASONS and s["reward"] in (0.0, 1.0)
        assert "<|system|>" not in s["prompt"] and s["prompt"].endswith("<|assistant|><think>\n")
        assert 2 <= s["num_tokens"] <= 8
    assert [s["index"] for s in samples if s["data_source"] == "aime"] == [0, 0, 0]


@needs(ARC_C)
def test_eval_picks_the_choice_grader_for_arc(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "arc.jsonl"
    summary = _eval(tiny_model, ARC_C, out, "--limit", "2")
    assert [(b["data_source"], b["rows"], b["metric"]) for b in summary["benchmarks"]] == [
        ("arc_c", 2, "pass@1")
    ]
    samples = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [s["grader"] for s in samples] == ["choice", "choice"]
    assert all(s["gold"] in "ABCD" for s in samples)
