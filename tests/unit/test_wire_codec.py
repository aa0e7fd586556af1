"""The shared wire pieces of `exgrpo_client.schemas`: the packed-array codec, the export records and
the stored batch plan."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from exgrpo_client import ExportFileError, read_export
from exgrpo_client import schemas as s

INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def _struct_ids(ids: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()


def _struct_floats(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


# ----------------------------------------------------------------------------------- codec
@given(st.lists(INT32, max_size=64))
def test_ids_pack_like_struct_and_round_trip(ids: list[int]) -> None:
    packed = s.pack_ids(ids)
    assert packed == _struct_ids(ids) == s.pack_ids(np.asarray(ids, dtype=np.int64))
    assert s.unpack_ids(packed) == ids
    assert s.decode_ids(packed).tolist() == ids


@given(st.lists(st.floats(-1e30, 0.0), max_size=64))
def test_logprobs_pack_like_struct(values: list[float]) -> None:
    """float64 values round to float32 exactly as struct's `f` does."""
    packed = s.pack_logprobs(values)
    assert packed == _struct_floats(values) == s.pack_logprobs(np.asarray(values))
    assert s.unpack_logprobs(packed) == list(struct.unpack(f"<{len(values)}f", base64.b64decode(packed)))


@given(st.lists(FLOAT32, max_size=64))
def test_float32_values_round_trip_exactly(values: list[float]) -> None:
    assert s.unpack_logprobs(s.pack_logprobs(values)) == values


def test_known_bytes() -> None:
    assert base64.b64decode(s.pack_ids([1, 256])) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert base64.b64decode(s.pack_logprobs([-1.0])) == b"\x00\x00\x80\xbf"
    assert s.pack_ids([]) == s.pack_logprobs([]) == ""
    assert s.encode_b64(b"\x01\x00\x00\x00") == s.pack_ids([1])
    assert s.decode_b64(s.pack_ids([1])) == b"\x01\x00\x00\x00"


def test_decoded_arrays_are_typed_read_only_views() -> None:
    ids = s.decode_ids(s.pack_ids([3, 4]))
    lps = s.decode_logprobs(s.pack_logprobs([-0.5, -0.25]))
    assert ids.dtype == np.int32 and lps.dtype == np.float32
    assert not ids.flags.writeable and not lps.flags.writeable
    assert lps.tolist() == [-0.5, -0.25]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([2**31], "fit in int32"),
        ([-(2**31) - 1], "fit in int32"),
        ([2**70], "fit in int32"),
        ([1.5], "must be integers"),
        (np.zeros((2, 2), dtype=np.int32), "one-dimensional"),
    ],
)
def test_ids_that_do_not_pack(ids: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        s.pack_ids(ids)  # type: ignore[arg-type]  # wrong inputs on purpose


@pytest.mark.parametrize("values", [[float("nan")], [float("-inf")], [-1e39], [0.0, float("inf")]])
def test_logprobs_that_do_not_pack(values: list[float]) -> None:
    with pytest.raises(ValueError, match="finite float32"):
        s.pack_logprobs(values)


@pytest.mark.parametrize(
    ("text", "message"),
    [("!!!!", "Non-base64|Only base64|Invalid"), (base64.b64encode(b"abc").decode(), "multiple of 4")],
)
def test_payloads_that_do_not_decode(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        s.decode_ids(text)
    with pytest.raises(ValueError, match=message):
        s.unpack_logprobs(text)


# ---------------------------------------------------------------------------- export records
HEADER = s.ExportHeader(
    pool=s.PoolCreate(name="p", config=s.PoolConfig(k=4)), num_questions=1, num_trajectories=1, num_runs=1
)
RECORDS: list[s.ExportRecord] = [
    HEADER,
    s.ExportRun(id=7, name="r1", seed=3, phase="mixed", switched_at_step=2, step=5, policy_version=4),
    s.ExportPolicyVersion(run=7, version=4, uri="file:///ckpt/4", step=5),
    s.ExportQuestion(
        id=11,
        prompt=[s.ChatMessage(role="user", content="1 + 1 = ? ünïcode")],
        ground_truth="2",
        metadata={"level": 3},
    ),
    s.ExportState(scope=7, question=11, last_k=2, bucket=2, retired=False, last_step=5),
    s.ExportTrajectory(
        question=11,
        source_run=7,
        policy_version=4,
        step=5,
        token_ids_b64=s.pack_ids([5, 6]),
        logprobs_b64=s.pack_logprobs([-0.5, -1.0]),
        reward=1.0,
        entropy=0.25,
    ),
]


def test_every_record_kind_round_trips() -> None:
    for record in RECORDS:
        line = s.export_line(record)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line)["type"] == record.type
        again = s.parse_export_record(line)
        assert type(again) is type(record) and again == record


def test_records_written_before_the_models_still_parse() -> None:
    """Lines as the service wrote them with json.dumps (ASCII escapes, key order, `1.0` spellings)."""
    header = {"type": "header", **HEADER.model_dump(exclude={"type"})}
    question = {
        "type": "question",
        "id": 11,
        "prompt": [{"role": "user", "content": "caf\u00e9"}],
        "ground_truth": "2",
        "data_source": "",
        "external_id": None,
        "metadata": {},
    }
    run = {
        "type": "run",
        "id": 1,
        "name": "r",
        "seed": 0,
        "phase": "on_policy",
        "switched_at_step": None,
        "step": 0,
        "policy_version": 0,
        "overrides": {
            "experience_ratio": None,
            "batch_size": None,
            "start_threshold": None,
            "experience": True,
        },
    }
    for obj, kind in ((header, s.ExportHeader), (question, s.ExportQuestion), (run, s.ExportRun)):
        parsed = s.parse_export_record(json.dumps(obj).encode())
        assert isinstance(parsed, kind)
    q = s.parse_export_record(json.dumps(question))
    assert isinstance(q, s.ExportQuestion) and q.prompt[0].content == "café"


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ('{"type": "mystery"}', "does not match any of the expected tags"),
        ('{"id": 1}', "Unable to extract tag"),
        (
            '{"type": "run", "id": 1, "name": "r", "seed": "3", "phase": "mixed", "step": 0, '
            '"policy_version": 0}',
            "seed",
        ),
        (
            '{"type": "state", "scope": 1, "question": 2, "last_k": 1, "retired": 0, "last_step": 0}',
            "retired",
        ),
        (
            '{"type": "trajectory", "question": 1, "policy_version": 0, "step": 0, "token_ids_b64": "", '
            '"logprobs_b64": "", "reward": 1.0, "colour": "red"}',
            "colour",
        ),
        ('{"type": "policy_version", "run": -1, "version": 0, "uri": "x"}', "run"),
        ('{"type": "question", "id": 1, "prompt": "nope", "ground_truth": "1"}', "prompt"),
        ("[1, 2]", "tag"),
        ("{not json", "JSON"),
    ],
)
def test_bad_records_are_refused(line: str, where: str) -> None:
    with pytest.raises(ValidationError, match=where) as info:
        s.parse_export_record(line)
    assert s.validation_summary(info.value)


def test_read_export_yields_validated_records(tmp_path: Path) -> None:
    path = tmp_path / "p.ndjson"
    path.write_bytes(b"".join(s.export_line(r) for r in RECORDS) + b"\n")
    assert list(read_export(path)) == RECORDS

    lines = [s.export_line(r) for r in RECORDS]
    lines[3] = b'{"type": "question", "id": "11"}\n'
    path.write_bytes(b"".join(lines))
    with pytest.raises(ExportFileError, match=r"p\.ndjson, row 4: ") as info:
        list(read_export(path))
    assert info.value.row == 4

    path.write_bytes(b"".join(s.export_line(r) for r in RECORDS[1:]))
    with pytest.raises(ExportFileError, match="row 1: the first record is not the export header"):
        list(read_export(path))
    with pytest.raises(ExportFileError, match="cannot be read"):
        list(read_export(tmp_path / "missing.ndjson"))


# ------------------------------------------------------------------------------ stored plans
def test_stored_plan_writes_full_names_and_reads_the_short_keys() -> None:
    pick = s.StoredPick(question_id=5, bucket=2, probability=0.25, candidates=[9, 10])
    plan = s.StoredPlan(
        k=4, fresh=[1, 2], replay=[pick], num_eligible=3, skipped_fresh=0, epoch=1, batch_size=3
    )
    stored = json.loads(json.dumps(plan.model_dump()))
    assert stored["replay"] == [{"question_id": 5, "bucket": 2, "probability": 0.25, "candidates": [9, 10]}]
    assert s.StoredPlan.model_validate(stored) == plan

    old = {**stored, "replay": [{"q": 5, "b": 2, "p": 0.25, "c": [9, 10]}]}
    assert s.StoredPlan.model_validate(old) == plan
    with pytest.raises(ValidationError, match=r"replay\.0\.q\n  Field required"):
        s.StoredPlan.model_validate({**stored, "replay": [{"b": 2, "p": 0.25, "c": []}]})
    with pytest.raises(ValidationError, match="extra"):
        s.StoredPlan.model_validate({**stored, "surprise": 1})


def test_stored_pick_takes_numpy_scalars() -> None:
    pick = s.StoredPick(question_id=np.int64(5), bucket=np.int64(1), probability=np.float64(0.5))  # type: ignore[arg-type]  # what the sampler hands over
    assert pick.model_dump() == {"question_id": 5, "bucket": 1, "probability": 0.5, "candidates": []}
    assert type(pick.question_id) is int
