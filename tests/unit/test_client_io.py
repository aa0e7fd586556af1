"""Reading question files: the real ExGRPO validation parquet, JSON Lines, JSON arrays, bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shared_data import VALID, needs

from exgrpo_client.io import (
    QuestionFileError,
    count_rows,
    question_from_row,
    read_jsonl_questions,
    read_parquet_questions,
    read_questions,
)

needs_valid = needs(VALID)


@needs_valid
def test_reads_the_whole_validation_set_in_batches() -> None:
    batches = list(read_questions(VALID, batch_size=1000))
    assert [len(batch) for batch in batches] == [1000, 1000, 259]
    assert count_rows(VALID) == 2259
    first = batches[0][0]
    assert [m.role for m in first.prompt] == ["system", "user"]
    assert first.prompt[1].content.startswith("Every morning Aya goes for a $9$-kilometer-long walk")
    assert first.ground_truth == "204"
    assert first.data_source == "aime"
    assert first.external_id == "0"
    assert first.metadata == {"index": 0, "split": "default"}
    sources = {q.data_source for batch in batches for q in batch}
    assert sources == {"aime", "aime25", "amc", "math", "minerva", "olympiad_bench"}


@needs_valid
def test_limit_stops_early() -> None:
    batches = list(read_parquet_questions(VALID, batch_size=64, limit=150))
    assert [len(batch) for batch in batches] == [64, 64, 22]
    assert list(read_questions(VALID, limit=0)) == []


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_jsonl_accepts_the_common_shapes(tmp_path: Path) -> None:
    rows = [
        {"prompt": "What is 2+2?", "answer": 4},
        {"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": "2", "data_source": "toy"},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*3?"}],
            "reward_model": {"ground_truth": "9", "style": "rule"},
            "extra_info": {"index": 12, "split": "train"},
            "metadata": {"level": 1},
        },
        {"prompt": "x?", "ground_truth": "x", "external_id": "custom-7"},
    ]
    path = _jsonl(tmp_path / "q.jsonl", rows)
    (batch,) = list(read_questions(path))
    assert [q.ground_truth for q in batch] == ["4", "2", "9", "x"]
    assert batch[0].prompt[0].role == "user" and batch[0].prompt[0].content == "What is 2+2?"
    assert batch[1].data_source == "toy"
    assert batch[2].external_id == "12"
    assert batch[2].metadata == {"level": 1, "index": 12, "split": "train"}
    assert batch[3].external_id == "custom-7"
    assert count_rows(path) == 4


def test_jsonl_batches_skip_blank_lines_and_honour_limit(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(5)]
    path.write_text("\n\n".join(lines) + "\n", encoding="utf-8")
    assert [len(b) for b in read_jsonl_questions(path, batch_size=2)] == [2, 2, 1]
    assert [len(b) for b in read_jsonl_questions(path, batch_size=2, limit=3)] == [2, 1]
    assert count_rows(path) == 5


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"answer": "1"}, "no `prompt`"),
        ({"prompt": "q"}, "no ground truth"),
        ({"prompt": 5, "answer": "1"}, "prompt must be a string or a list"),
        ({"prompt": [{"role": "robot", "content": "q"}], "answer": "1"}, r"prompt\.0\.role"),
        ({"prompt": "q", "answer": ["a", "b"]}, "ground truth must be a string or a number"),
        ({"prompt": "q", "answer": True}, "ground truth must be a string or a number"),
        ([1, 2], "expected a JSON object"),
    ],
    ids=["no-prompt", "no-truth", "prompt-type", "role", "truth-list", "truth-bool", "not-object"],
)
def test_bad_rows_name_the_file_and_line(tmp_path: Path, row: object, message: str) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(QuestionFileError, match=message) as info:
        list(read_questions(path))
    assert str(info.value).startswith(f"{path}, row 2: ")
    assert info.value.row == 2 and info.value.path == str(path)


def test_invalid_json_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(QuestionFileError, match=r"row 2: invalid JSON"):
        list(read_questions(path))


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps([{"prompt": f"q{i}", "answer": i} for i in range(3)]), encoding="utf-8")
    assert [len(b) for b in read_questions(path, batch_size=2)] == [2, 1]
    assert [len(b) for b in read_questions(path, limit=1)] == [1]
    assert count_rows(path) == 3
    path.write_text(json.dumps({"prompt": "q"}), encoding="utf-8")
    with pytest.raises(QuestionFileError, match="expected a JSON array"):
        list(read_questions(path))


def test_parquet_bad_row_is_numbered_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "a"}], None],
            "reward_model": [{"ground_truth": "1", "style": "rule"}, {"ground_truth": "2", "style": "rule"}],
        }
    )
    pq.write_table(table, path)
    with pytest.raises(QuestionFileError, match=r"bad\.parquet, row 1: no `prompt`"):
        list(read_questions(path))


def test_parquet_without_prompt_column(tmp_path: Path) -> None:
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(QuestionFileError, match="no `prompt` column"):
        list(read_questions(path))


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(QuestionFileError, match="no such file"):
        read_questions(tmp_path / "missing.parquet")
    (tmp_path / "q.csv").write_text("prompt,answer\n", encoding="utf-8")
    with pytest.raises(QuestionFileError, match=r"unknown file type \.csv"):
        read_questions(tmp_path / "q.csv")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(QuestionFileError, match="not a readable parquet file"):
        list(read_questions(tmp_path / "broken.parquet"))
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(QuestionFileError, match="not UTF-8"):
        list(read_questions(tmp_path / "latin.jsonl"))
    with pytest.raises(ValueError, match="batch_size"):
        list(read_questions(tmp_path / "latin.jsonl", batch_size=0))


def test_question_from_row_drops_extra_message_fields() -> None:
    q = question_from_row({"prompt": [{"role": "user", "content": "hi", "name": "x"}], "answer": 1.5})
    assert q.prompt[0].model_dump() == {"role": "user", "content": "hi"}
    assert q.ground_truth == "1.5"
