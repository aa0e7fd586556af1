"""The I/O-free half of the SDK: retry policy, error mapping, call building, payload helpers."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from exgrpo_client import _base as b
from exgrpo_client import decode_trajectory, errors, rollout
from exgrpo_client import schemas as s


# ----------------------------------------------------------------------------------- retry policy
def test_backoff_doubles_within_jitter_and_is_capped() -> None:
    policy = b.RetryPolicy(retries=5, backoff=0.5, max_delay=3.0)
    for attempt, base in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]):
        for _ in range(20):
            assert base * 0.5 <= policy.delay(attempt) <= base


@pytest.mark.parametrize(
    ("header", "expected"),
    [("2", 2.0), ("0", 0.0), ("120", 30.0), ("-5", 0.0)],
    ids=["seconds", "zero", "capped", "negative"],
)
def test_retry_after_header_wins(header: str, expected: float) -> None:
    response = httpx.Response(503, headers={"retry-after": header})
    assert b.RetryPolicy(backoff=10).delay(0, response) == expected


def test_retry_after_as_a_date_falls_back_to_backoff() -> None:
    response = httpx.Response(429, headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert 0.05 <= b.RetryPolicy(backoff=0.1).delay(0, response) <= 0.1


@pytest.mark.parametrize("kwargs", [{"retries": -1}, {"backoff": -0.1}], ids=["retries", "backoff"])
def test_policy_refuses_negative_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        b.RetryPolicy(**kwargs)  # type: ignore[arg-type]  # bad values on purpose


@pytest.mark.parametrize(
    ("status", "retried"),
    [
        (429, True),
        (502, True),
        (503, True),
        (504, True),
        (500, False),
        (404, False),
        (409, False),
        (422, False),
    ],
)
def test_which_statuses_are_retried(status: int, retried: bool) -> None:
    assert b.RetryPolicy().retry_status(status) is retried


# ---------------------------------------------------------------------------------- error mapping
def _problem(status: int, detail: str = "something is wrong", **extra: object) -> httpx.Response:
    body = {
        "type": "about:blank",
        "title": "T",
        "status": status,
        "detail": detail,
        "request_id": "rid-1",
        **extra,
    }
    request = httpx.Request("GET", "http://pool.test/v1/pools/x")
    return httpx.Response(
        status, json=body, request=request, headers={"content-type": "application/problem+json"}
    )


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, errors.BadRequest),
        (401, errors.Unauthorized),
        (403, errors.Forbidden),
        (404, errors.NotFound),
        (409, errors.Conflict),
        (413, errors.PayloadTooLarge),
        (422, errors.BadRequest),
        (429, errors.RateLimited),
        (418, errors.APIError),
        (500, errors.ServerError),
        (503, errors.ServerError),
    ],
)
def test_status_maps_to_error_class(status: int, cls: type[errors.APIError]) -> None:
    err = b.api_error(_problem(status, "pool 'x' does not exist"))
    assert type(err) is cls
    assert isinstance(err, errors.APIError)
    assert err.status == status
    assert err.detail == "pool 'x' does not exist"
    assert err.request_id == "rid-1"
    assert str(err).startswith("pool 'x' does not exist")
    assert "rid-1" in str(err)
    assert err.method == "GET"
    assert err.url == "http://pool.test/v1/pools/x"


def test_validation_errors_are_kept() -> None:
    err = b.api_error(_problem(422, "k: too small", errors=[{"loc": ["body", "k"], "msg": "too small"}]))
    assert err.errors == [{"loc": ["body", "k"], "msg": "too small"}]


def test_error_without_a_problem_body() -> None:
    request = httpx.Request("POST", "http://pool.test/v1/pools")
    html = httpx.Response(
        502, text="<html>Bad gateway</html>", headers={"x-request-id": "proxy-7"}, request=request
    )
    err = b.api_error(html)
    assert isinstance(err, errors.ServerError)
    assert err.detail == "<html>Bad gateway</html>"
    assert err.title == "Bad Gateway"
    assert err.request_id == "proxy-7"
    empty = b.api_error(httpx.Response(504, request=request))
    assert empty.detail == "HTTP 504 Gateway Timeout"
    assert empty.request_id is None


def test_transport_error_names_the_url() -> None:
    request = httpx.Request("GET", "http://127.0.0.1:1/v1/pools")
    err = b.transport_error(httpx.ConnectError("refused"), request, 4)
    assert isinstance(err, errors.TransportError)
    assert "GET http://127.0.0.1:1/v1/pools failed (4 times): ConnectError: refused" in str(err)
    assert err.url == "http://127.0.0.1:1/v1/pools"


# ------------------------------------------------------------------------------------ call building
def test_writes_carry_a_fresh_idempotency_key_and_reads_none() -> None:
    first, second = b.create_pool("p1", None, ""), b.create_pool("p1", None, "")
    assert first.idempotency_key is not None and second.idempotency_key is not None
    assert uuid.UUID(first.idempotency_key).version == 4
    assert first.idempotency_key != second.idempotency_key
    assert b.get_pool("p1").idempotency_key is None
    assert b.select("p1", "r1", 3, None, "all").idempotency_key is None


def test_bodies_leave_out_what_was_not_given() -> None:
    plan = b.plan_batch("p", "r", {"batch_size": 16, "experience_ratio": None})
    assert plan.body is not None and json.loads(plan.body) == {"batch_size": 16}
    create = b.create_pool("p", {"k": 4}, "")
    assert create.body is not None
    assert json.loads(create.body) == {"name": "p", "description": "", "config": {"k": 4}}
    update = b.update_pool("p", "new text", None)
    assert update.body is not None and json.loads(update.body) == {"description": "new text"}
    assert update.method == "PATCH"


def test_path_segments_are_quoted() -> None:
    assert b.get_batch("p", "a/b c").path == "/v1/pools/p/batches/a%2Fb%20c"


def test_arguments_are_checked_before_anything_is_sent() -> None:
    with pytest.raises(ValidationError, match="name"):
        b.create_pool("bad name!", None, "")
    with pytest.raises(ValidationError, match="lbound"):
        b.create_pool("p", {"k": 4, "lbound": 3}, "")
    with pytest.raises(ValidationError):
        b.commit_batch("p", "id", [], None, None, False)


def test_a_config_mapping_patches_only_its_keys() -> None:
    patch = b.update_pool("p", None, {"experience_ratio": 0.25})
    assert patch.body is not None and json.loads(patch.body) == {"config": {"experience_ratio": 0.25}}
    # a whole PoolConfig sends every key: it replaces the config
    whole = b.update_pool("p", None, s.PoolConfig(k=4))
    assert whole.body is not None and json.loads(whole.body)["config"] == s.PoolConfig(k=4).model_dump()
    assert b.config_patch(None) is None
    with pytest.raises(ValidationError, match="sigmaa"):
        b.update_pool("p", None, {"sigmaa": 1.0})


def test_question_chunks_validate_dicts_and_split() -> None:
    qs = [{"prompt": [{"role": "user", "content": f"q{i}"}], "ground_truth": str(i)} for i in range(5)]
    chunks = list(b.question_chunks(qs, 2))
    assert [len(c) for c in chunks] == [2, 2, 1]
    assert all(isinstance(q, s.QuestionCreate) for c in chunks for q in c)
    with pytest.raises(ValueError, match="chunk_size"):
        list(b.question_chunks(qs, 0))
    with pytest.raises(ValidationError):
        list(b.question_chunks([{"prompt": [], "ground_truth": "1"}], 10))


def test_imported_counts_add_up() -> None:
    first = s.QuestionsImported(received=3, inserted=2, duplicates=1, num_questions=2)
    second = s.QuestionsImported(received=4, inserted=4, duplicates=0, num_questions=6)
    assert b.add_imported(b.add_imported(None, first), second) == s.QuestionsImported(
        received=7, inserted=6, duplicates=1, num_questions=6
    )


def test_client_reads_url_and_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from exgrpo_client import Client

    monkeypatch.setenv("EXGRPO_URL", "http://pool.example:9000/")
    monkeypatch.setenv("EXGRPO_TOKEN", "secret-token-0123456789")
    with Client() as client:
        assert client.base_url == "http://pool.example:9000"
        assert client.token == "secret-token-0123456789"
        assert "secret" not in repr(client)
    with Client("http://other:1", token="explicit-token-000000") as client:
        assert client.base_url == "http://other:1"
        assert client.token == "explicit-token-000000"
    monkeypatch.delenv("EXGRPO_URL")
    monkeypatch.delenv("EXGRPO_TOKEN")
    with Client() as client:
        assert client.base_url == b.DEFAULT_URL
        assert client.token is None
    with pytest.raises(ValueError, match="http://"):
        Client("127.0.0.1:8700")


# ---------------------------------------------------------------------------------- payloads
def test_rollout_packs_lists_and_arrays_alike() -> None:
    from_lists = rollout(1.0, [5, 6, 7], [-0.5, -0.25, 0.0], entropy=0.3)
    from_arrays = rollout(
        1.0, np.array([5, 6, 7], dtype=np.int64), np.array([-0.5, -0.25, 0.0], dtype=np.float32), entropy=0.3
    )
    assert from_lists == from_arrays
    assert from_lists.token_ids_b64 == s.pack_ids([5, 6, 7])
    assert s.unpack_logprobs(from_lists.logprobs_b64 or "") == [-0.5, -0.25, 0.0]
    assert from_lists.token_ids is None and from_lists.logprobs is None
    assert from_lists.replayed is False and from_lists.entropy == 0.3


def test_rollout_without_payload() -> None:
    r = rollout(0.0, None, None, replayed=True, finish_reason="length")
    assert r.token_ids_b64 is None and r.logprobs_b64 is None
    assert r.replayed and r.finish_reason == "length"
    assert json.loads(r.model_dump_json(exclude_unset=True)) == {
        "reward": 0.0,
        "replayed": True,
        "finish_reason": "length",
    }


@pytest.mark.parametrize(
    ("ids", "lps", "message"),
    [
        ([1, 2], [-0.1], "differ in length"),
        ([1, 2], None, "together"),
        ([-1], [-0.1], r"\[0, 2\^31\)"),
        ([2**31], [-0.1], r"\[0, 2\^31\)"),
        ([1.5], [-0.1], "integers"),
        ([1], [float("nan")], "finite"),
        ([[1, 2]], [[-0.1, -0.2]], "1-D"),
    ],
    ids=["length", "half", "negative", "too-large", "float-ids", "nan", "2d"],
)
def test_rollout_refuses_bad_payloads(ids: object, lps: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rollout(1.0, ids, lps)  # type: ignore[arg-type]  # bad payloads on purpose


def _trajectory(**payload: str | None) -> s.TrajectoryPublic:
    return s.TrajectoryPublic.model_validate_json(
        json.dumps(
            {
                "id": 7,
                "question_id": 1,
                "source_run": "r",
                "policy_version": 0,
                "step": 1,
                "reward": 1.0,
                "entropy": None,
                "num_tokens": 3,
                "created_at": "2026-01-01T00:00:00Z",
                **payload,
            }
        )
    )


def test_decode_trajectory_round_trip() -> None:
    r = rollout(1.0, [3, 1, 2], [-1.5, -0.5, -0.125])
    ids, lps = decode_trajectory(_trajectory(token_ids_b64=r.token_ids_b64, logprobs_b64=r.logprobs_b64))
    assert ids.dtype == np.int32 and lps.dtype == np.float32
    assert ids.tolist() == [3, 1, 2]
    assert lps.tolist() == [-1.5, -0.5, -0.125]
    ids[0] = 9  # a writable copy, not a view of the decoded bytes


def test_decode_trajectory_needs_the_payload() -> None:
    with pytest.raises(ValueError, match="payload=True"):
        decode_trajectory(_trajectory())
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        decode_trajectory(_trajectory(token_ids_b64=s.pack_ids([1, 2]), logprobs_b64=s.pack_logprobs([-1.0])))


# ----------------------------------------------------------------------------- export / upload
HEADER = {
    "type": "header",
    "kind": "exgrpo-pool-export",
    "format_version": 1,
    "pool": {"name": "p", "config": {"k": 4}, "description": ""},
    "num_questions": 2,
    "num_trajectories": 0,
    "num_runs": 1,
}


def test_export_writer_renames_a_complete_stream(tmp_path: Path) -> None:
    dest = tmp_path / "p.ndjson"
    writer = b.ExportWriter(dest)
    line = json.dumps(HEADER).encode() + b"\n"
    for chunk in (line[:10], line[10:], b'{"type":"question"}\n'):
        writer.feed(chunk)
        writer.file.write(chunk)
    assert (tmp_path / "p.ndjson.partial").exists() and not dest.exists()
    done = writer.finish()
    assert dest.read_bytes() == line + b'{"type":"question"}\n'
    assert not (tmp_path / "p.ndjson.partial").exists()
    assert done.num_bytes == len(line) + 20
    assert done.header.pool.name == "p" and done.header.num_questions == 2
    assert done.path == str(dest)


def test_export_writer_removes_a_broken_stream(tmp_path: Path) -> None:
    writer = b.ExportWriter(tmp_path / "p.ndjson")
    writer.feed(b'{"type":"head')
    with pytest.raises(errors.ExgrpoError, match="before its header"):
        writer.finish()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(errors.ExgrpoError, match="not a pool export"):
        b.ExportWriter(io.BytesIO()).feed(b'{"type":"question"}\n')


def test_upload_source_knows_its_size_and_rewinds(tmp_path: Path) -> None:
    path = tmp_path / "e.ndjson"
    path.write_bytes(b"x" * 10)
    source = b.UploadSource(path)
    assert source.total == 10 and source.rewindable
    assert source.read() == b"x" * 10 and source.read() == b""
    source.rewind()
    assert source.read() == b"x" * 10
    source.close()
    assert source.file.closed
    buffer = io.BytesIO(b"abcdef")
    buffer.seek(2)
    from_buffer = b.UploadSource(buffer)
    assert from_buffer.total == 4 and from_buffer.read() == b"cdef"
    from_buffer.close()
    assert not buffer.closed  # not ours to close
