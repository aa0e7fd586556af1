"""Numbers and text on the wire: integral floats count as integers in what clients send, and the
answers the SDK parses from JSON text keep working (datetimes included)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from exgrpo_client import schemas as s


def test_integral_floats_are_integers_in_requests() -> None:
    assert s.RunCreate.model_validate_json('{"name": "r", "seed": 5742733.0}').seed == 5742733
    assert s.Payload.model_validate({"token_ids": [1.0, 2], "logprobs": [-1]}).token_ids == [1, 2]
    assert s.PoolConfig.model_validate({"k": 4.0}).k == 4
    for bad in (5742733.5, "5", True, 2.0**31):
        with pytest.raises(ValidationError, match="seed"):
            s.RunCreate.model_validate({"name": "r", "seed": bad})


def test_answers_parse_from_json_text() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    text = json.dumps({"version": 1, "uri": "file:///w", "step": 0, "created_at": now.isoformat()})
    assert s.PolicyVersionPublic.model_validate_json(text).created_at == now
    run = {
        "id": 1, "name": "r", "pool": "p", "seed": 0, "phase": "mixed", "switched_at_step": 0, "step": 2,
        "policy_version": 0, "epoch": 0, "cursor": 0, "overrides": {"batch_size": 8.0},
        "created_at": now.isoformat(), "updated_at": now.isoformat(),
    }  # fmt: skip
    parsed = s.RunPublic.model_validate_json(json.dumps(run))
    assert parsed.updated_at == now and parsed.overrides.batch_size == 8


def test_text_refuses_nul_and_json_refuses_non_finite_numbers() -> None:
    with pytest.raises(ValidationError, match="NUL"):
        s.TaskClaim.model_validate({"worker": "a\x00"})
    q = {"prompt": [{"role": "user", "content": "q"}], "ground_truth": "1"}
    for meta, word in (
        ({"x": float("nan")}, "finite"),
        ({"x": [{"y": "\x00"}]}, "NUL"),
        ({"\x00": 1}, "NUL"),
    ):
        with pytest.raises(ValidationError, match=word):
            s.QuestionCreate.model_validate({**q, "metadata": meta})
    deep: object = 1
    for _ in range(s.MAX_JSON_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValidationError, match="deeper"):
        s.QuestionCreate.model_validate({**q, "metadata": {"x": deep}})
