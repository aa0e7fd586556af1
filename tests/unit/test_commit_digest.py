"""The digest a committed batch keeps of its commit: one per commit, whatever the encoding."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import numpy as np

from exgrpo_client import frames
from exgrpo_client import schemas as s
from exgrpo_pool import jsonwrite
from exgrpo_pool.service.convert import (
    COMMIT_DIGEST,
    COMMIT_DIGEST_V1,
    LEGACY_DIGEST,
    _legacy_digest,
    commit_digest,
    commit_digest_parts,
    commit_digest_v1,
    committed_result,
    predecode,
    same_commit,
)
from exgrpo_pool.store.models import BatchRow


def _commit(tokens: list[int], *, b64: bool, reward: float = 1.0) -> s.BatchCommit:
    payload: dict[str, Any] = (
        {"token_ids_b64": s.pack_ids(tokens), "logprobs_b64": s.pack_logprobs([-0.5] * len(tokens))}
        if b64
        else {"token_ids": tokens, "logprobs": [-0.5] * len(tokens)}
    )
    rollouts = [{"reward": reward, **payload}, {"reward": 0.0}]
    req = s.BatchCommit.model_validate({"groups": [{"question_id": 3, "rollouts": rollouts}]}, strict=False)
    predecode(req.groups)
    return req


def _batch(result: dict[str, Any]) -> BatchRow:
    return BatchRow(
        id="b",
        run_id=1,
        step=1,
        status="committed",
        phase="mixed",
        policy_version=0,
        plan={},
        result=result,
        created_at=datetime.now(UTC),
    )


def test_base64_and_lists_of_the_same_payload_are_one_commit() -> None:
    a, b = _commit([1, 2, 3], b64=True), _commit([1, 2, 3], b64=False)
    assert commit_digest(a) == commit_digest(b)
    assert commit_digest(a) != commit_digest(_commit([1, 2, 4], b64=True))
    # where one payload ends and the next begins is part of what was committed
    assert commit_digest(_commit([1, 2], b64=True)) != commit_digest(_commit([1, 2, 3], b64=True))


def test_a_frame_base64_and_lists_give_one_digest() -> None:
    """The same commit in every encoding the service takes, a frame's payloads handed over as views
    into its buffers (as the route hands them), and a reward sent as an integer."""
    lists = _commit([1, 2, 3], b64=False)
    body, payloads = frames.decode(frames.encode_model(lists))
    framed = s.BatchCommit.model_validate(body, strict=False)
    frames.attach(framed, payloads, views=True)
    assert commit_digest(framed) == commit_digest(lists) == commit_digest(_commit([1, 2, 3], b64=True))
    assert commit_digest(_commit([1, 2, 3], b64=False, reward=1)) == commit_digest(lists)
    assert commit_digest(_commit([1, 2, 3], b64=True, reward=0.0)) != commit_digest(lists)


def test_a_batch_committed_with_an_earlier_digest_still_knows_its_commit() -> None:
    sent = _commit([1, 2, 3], b64=True)
    answer = {"batch_id": "b", "step": 1}
    old = _batch({**answer, LEGACY_DIGEST: _legacy_digest(sent)})
    assert same_commit(old, _commit([1, 2, 3], b64=True))
    assert not same_commit(old, _commit([1, 2, 4], b64=True))
    v1 = _batch({**answer, COMMIT_DIGEST_V1: commit_digest_v1(sent)})
    assert same_commit(v1, _commit([1, 2, 3], b64=False))
    assert not same_commit(v1, _commit([1, 2, 4], b64=False))
    new = _batch({**answer, COMMIT_DIGEST: commit_digest(sent)})
    assert same_commit(new, _commit([1, 2, 3], b64=False))
    assert not same_commit(new, _commit([1, 2, 4], b64=False))
    # no digest is part of the answer a replay gets
    for batch in (old, v1, new):
        assert batch.result is not None
        assert set(batch.result) - {COMMIT_DIGEST, COMMIT_DIGEST_V1, LEGACY_DIGEST} == set(answer)
    assert same_commit(_batch(answer), sent)  # committed before any digest existed
    assert committed_result is not None


def test_the_digest_is_the_documented_byte_layout() -> None:
    """Digests stored with committed batches must keep matching: the layout's name, the commit's
    fields but its payloads as JSON of lists, with every rollout's token count (-1 without a
    payload) after them, then every payload's packed ids, then every payload's packed log-probs."""
    req = _commit([7, 8, 9], b64=False)
    req.groups[0].rollouts[0].entropy = 0.25
    meta = [None, [[3, None, [[1.0, 0.25, False, None, None], [0.0, None, False, None, None]]]], [3, -1]]
    ids = np.asarray([7, 8, 9], dtype="<i4").tobytes()
    lps = np.asarray([-0.5] * 3, dtype="<f4").tobytes()
    layout = b"exgrpo commit digest v2\n" + jsonwrite.dumps(meta) + ids + lps
    assert commit_digest(req) == hashlib.sha256(layout).hexdigest()
    # the parts the route makes on the loop and hashes in a thread are that layout
    assert b"".join(commit_digest_parts(req)) == layout


def test_the_first_digest_is_the_documented_byte_layout() -> None:
    """`commit_digest_v1`, which batches committed before `commit_digest` keep: the metadata's
    JSON, then per rollout 0x01, the two payload lengths as 8-byte little-endian integers and the
    packed bytes (0x00 for a rollout without a payload)."""
    req = _commit([7, 8, 9], b64=False)
    payload_fields = {"token_ids", "token_ids_b64", "logprobs", "logprobs_b64"}
    without = {"groups": {"__all__": {"rollouts": {"__all__": payload_fields}}}}
    meta = req.model_dump_json(include={"groups", "policy_version"}, exclude=without)
    ids = np.asarray([7, 8, 9], dtype="<i4").tobytes()
    lps = np.asarray([-0.5] * 3, dtype="<f4").tobytes()
    layout = b"\x01" + len(ids).to_bytes(8, "little") + len(lps).to_bytes(8, "little") + ids + lps + b"\x00"
    assert commit_digest_v1(req) == hashlib.sha256(meta.encode() + layout).hexdigest()
