"""The digest a committed batch keeps of its commit: one per commit, whatever the encoding."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import numpy as np

from exgrpo_client import schemas as s
from exgrpo_pool.service.convert import (
    COMMIT_DIGEST,
    LEGACY_DIGEST,
    _legacy_digest,
    commit_digest,
    committed_result,
    predecode,
    same_commit,
)
from exgrpo_pool.store.models import BatchRow


def _commit(tokens: list[int], *, b64: bool) -> s.BatchCommit:
    payload: dict[str, Any] = (
        {"token_ids_b64": s.pack_ids(tokens), "logprobs_b64": s.pack_logprobs([-0.5] * len(tokens))}
        if b64
        else {"token_ids": tokens, "logprobs": [-0.5] * len(tokens)}
    )
    rollouts = [{"reward": 1.0, **payload}, {"reward": 0.0}]
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


def test_a_batch_committed_with_the_legacy_digest_still_knows_its_commit() -> None:
    sent = _commit([1, 2, 3], b64=True)
    answer = {"batch_id": "b", "step": 1}
    old = _batch({**answer, LEGACY_DIGEST: _legacy_digest(sent)})
    assert same_commit(old, _commit([1, 2, 3], b64=True))
    assert not same_commit(old, _commit([1, 2, 4], b64=True))
    new = _batch({**answer, COMMIT_DIGEST: commit_digest(sent)})
    assert same_commit(new, _commit([1, 2, 3], b64=False))
    assert not same_commit(new, _commit([1, 2, 4], b64=False))
    # neither digest is part of the answer a replay gets
    for batch in (old, new):
        assert batch.result is not None
        assert set(batch.result) - {COMMIT_DIGEST, LEGACY_DIGEST} == set(answer)
    assert same_commit(_batch(answer), sent)  # committed before any digest existed
    assert committed_result is not None


def test_the_digest_is_the_documented_byte_layout() -> None:
    """Digests stored with committed batches must keep matching: the metadata's JSON, then per
    rollout 0x01, the two payload lengths as 8-byte little-endian integers and the packed bytes
    (0x00 for a rollout without a payload)."""
    req = _commit([7, 8, 9], b64=False)
    payload_fields = {"token_ids", "token_ids_b64", "logprobs", "logprobs_b64"}
    without = {"groups": {"__all__": {"rollouts": {"__all__": payload_fields}}}}
    meta = req.model_dump_json(include={"groups", "policy_version"}, exclude=without)
    ids = np.asarray([7, 8, 9], dtype="<i4").tobytes()
    lps = np.asarray([-0.5] * 3, dtype="<f4").tobytes()
    layout = b"\x01" + len(ids).to_bytes(8, "little") + len(lps).to_bytes(8, "little") + ids + lps + b"\x00"
    assert commit_digest(req) == hashlib.sha256(meta.encode() + layout).hexdigest()
