"""Reading files: questions in the verl/ExGRPO parquet layout, JSON Lines and JSON arrays.

A row becomes a `QuestionCreate` like this:

    prompt        a list of {role, content} messages, or a plain string (one user message)
    ground_truth  `ground_truth`, else `answer`, else `reward_model.ground_truth`
    data_source   `data_source` ("" when absent)
    metadata      `metadata` merged with `extra_info` (other columns are ignored)
    external_id   `external_id`, else `extra_info.index`

Readers yield lists of at most `batch_size` questions, so a large file never sits in memory as
one list. A row that cannot be read raises `QuestionFileError` naming the file and the row.

`read_export` reads the records of a pool export (`ExportFileError` on a bad line).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from exgrpo_client import exports
from exgrpo_client.schemas import (
    ExportHeader,
    ExportRecord,
    QuestionCreate,
    parse_export_record,
    validation_summary,
)

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_COLUMNS = (
    "prompt",
    "ground_truth",
    "answer",
    "reward_model",
    "data_source",
    "metadata",
    "extra_info",
    "external_id",
)

StrPath = str | os.PathLike[str]


class FileReadError(ValueError):
    """A file, or one of its rows, cannot be read."""

    def __init__(self, path: StrPath, message: str, *, row: int | None = None) -> None:
        where = f"{os.fspath(path)}" if row is None else f"{os.fspath(path)}, row {row}"
        super().__init__(f"{where}: {message}")
        self.path = os.fspath(path)
        self.row = row


class QuestionFileError(FileReadError):
    """A question file, or one of its rows, cannot be read."""


class ExportFileError(FileReadError):
    """A pool export, or one of its lines (`row`, from 1), cannot be read."""


# ------------------------------------------------------------------------------ row -> question
def _prompt(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list | tuple) and all(isinstance(m, Mapping) for m in value):
        # parquet structs may carry more fields than role and content; the contract has only these
        return [{"role": m.get("role"), "content": m.get("content")} for m in value]
    raise ValueError(
        f"prompt must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
    )


def _ground_truth(row: Mapping[str, Any]) -> str:
    value = row.get("ground_truth")
    if value is None:
        value = row.get("answer")
    if value is None and isinstance(row.get("reward_model"), Mapping):
        value = row["reward_model"].get("ground_truth")
    if value is None:
        raise ValueError("no ground truth: expected `ground_truth`, `answer` or `reward_model.ground_truth`")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"ground truth must be a string or a number, got {type(value).__name__}")
    return str(value)


def question_from_row(row: Mapping[str, Any]) -> QuestionCreate:
    """One question from a row of either layout (raises `ValueError` on a bad row)."""
    if "prompt" not in row or row["prompt"] is None:
        raise ValueError("no `prompt`")
    extra = row.get("extra_info")
    extra = dict(extra) if isinstance(extra, Mapping) else {}
    meta = row.get("metadata")
    metadata = {**(dict(meta) if isinstance(meta, Mapping) else {}), **extra}
    external_id = row.get("external_id")
    if external_id is None and extra.get("index") is not None:
        external_id = extra["index"]
    return QuestionCreate.model_validate(
        {
            "prompt": _prompt(row["prompt"]),
            "ground_truth": _ground_truth(row),
            "data_source": str(row.get("data_source") or ""),
            "external_id": None if external_id is None else str(external_id),
            "metadata": metadata,
        }
    )


def _convert(path: StrPath, row_number: int, row: Any) -> QuestionCreate:
    if not isinstance(row, Mapping):
        raise QuestionFileError(path, f"expected a JSON object, got {type(row).__name__}", row=row_number)
    try:
        return question_from_row(row)
    except ValidationError as e:
        raise QuestionFileError(path, validation_summary(e), row=row_number) from e
    except ValueError as e:
        raise QuestionFileError(path, str(e), row=row_number) from e


# ------------------------------------------------------------------------------------ readers
def _check_args(batch_size: int, limit: int | None) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")


def read_parquet_questions(
    path: StrPath, *, batch_size: int = 2000, limit: int | None = None
) -> Iterator[list[QuestionCreate]]:
    """Questions of a verl/ExGRPO parquet file (rows numbered from 0, as in pandas)."""
    import pyarrow.parquet as pq  # pyarrow is heavy; only the parquet reader needs it

    _check_args(batch_size, limit)
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:
        raise QuestionFileError(path, f"not a readable parquet file ({e})") from e
    columns = [c for c in _PARQUET_COLUMNS if c in pf.schema_arrow.names]
    if "prompt" not in columns:
        raise QuestionFileError(path, f"no `prompt` column (columns: {', '.join(pf.schema_arrow.names)})")
    row = 0
    for record_batch in pf.iter_batches(batch_size=batch_size, columns=columns):
        out = []
        for values in record_batch.to_pylist():
            if limit is not None and row >= limit:
                break
            out.append(_convert(path, row, values))
            row += 1
        if out:
            yield out
        if limit is not None and row >= limit:
            return


def read_jsonl_questions(
    path: StrPath, *, batch_size: int = 2000, limit: int | None = None
) -> Iterator[list[QuestionCreate]]:
    """Questions of a JSON Lines file, one object a line (rows numbered by line, from 1)."""
    _check_args(batch_size, limit)
    out: list[QuestionCreate] = []
    count = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if limit is not None and count >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise QuestionFileError(
                        path, f"invalid JSON ({e.msg} at column {e.colno})", row=lineno
                    ) from e
                out.append(_convert(path, lineno, obj))
                count += 1
                if len(out) == batch_size:
                    yield out
                    out = []
    except UnicodeDecodeError as e:
        raise QuestionFileError(path, f"not UTF-8 text ({e.reason})") from e
    if out:
        yield out


def read_json_questions(
    path: StrPath, *, batch_size: int = 2000, limit: int | None = None
) -> Iterator[list[QuestionCreate]]:
    """Questions of a JSON file holding one array of objects (rows numbered from 0)."""
    _check_args(batch_size, limit)
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QuestionFileError(path, f"not a JSON file ({e})") from e
    if not isinstance(rows, list):
        raise QuestionFileError(path, f"expected a JSON array of questions, got {type(rows).__name__}")
    rows = rows if limit is None else rows[:limit]
    for start in range(0, len(rows), batch_size):
        yield [_convert(path, start + i, row) for i, row in enumerate(rows[start : start + batch_size])]


def read_questions(
    path: StrPath, *, batch_size: int = 2000, limit: int | None = None
) -> Iterator[list[QuestionCreate]]:
    """Questions of a `.parquet`, `.jsonl` or `.json` file (by suffix), in lists of `batch_size`."""
    suffix = Path(path).suffix.lower()
    if not Path(path).is_file():
        raise QuestionFileError(path, "no such file")
    if suffix in PARQUET_SUFFIXES:
        return read_parquet_questions(path, batch_size=batch_size, limit=limit)
    if suffix in JSONL_SUFFIXES:
        return read_jsonl_questions(path, batch_size=batch_size, limit=limit)
    if suffix == ".json":
        return read_json_questions(path, batch_size=batch_size, limit=limit)
    raise QuestionFileError(path, f"unknown file type {suffix or '(none)'}: use .parquet, .jsonl or .json")


def count_rows(path: StrPath) -> int:
    """Number of rows of a question file (parquet metadata, non-empty lines, array length)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return sum(len(chunk) for chunk in read_json_questions(path))
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            return int(pq.ParquetFile(path).metadata.num_rows)
        except (OSError, ValueError) as e:
            raise QuestionFileError(path, f"not a readable parquet file ({e})") from e
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


# ------------------------------------------------------------------------------- pool exports
def read_export(path: StrPath) -> Iterator[ExportRecord]:
    """The records of a pool export (NDJSON or the binary form, which `export_pool` writes by
    default), each validated as the service validates an import. The first record is the
    `ExportHeader`; trajectories carry their payloads as base64 in both forms."""
    try:
        with open(path, "rb") as f:
            if exports.is_binary(f.read(1)):
                f.seek(0)
                try:
                    yield from exports.read(f)
                except exports.ExportFormatError as e:
                    raise ExportFileError(path, str(e)) from e
                return
            f.seek(0)
            first = True
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = parse_export_record(line)
                except ValidationError as e:
                    raise ExportFileError(path, validation_summary(e), row=lineno) from e
                if first and not isinstance(record, ExportHeader):
                    raise ExportFileError(path, "the first record is not the export header", row=lineno)
                first = False
                yield record
    except OSError as e:
        raise ExportFileError(path, f"cannot be read ({e.strerror or e})") from e
