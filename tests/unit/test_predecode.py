"""A JSON commit's or ingest's payloads are decoded and checked by `convert.predecode` for the whole
request at once: the same packed bytes on each rollout, and for a payload that breaks a rule the
same error, word for word, as checking rollout by rollout (`convert.decode_payload`) gives; a body
of base64 payloads that all hold is never checked rollout by rollout."""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_client import schemas as s
from exgrpo_client.schemas import packed_of
from exgrpo_pool.errors import BadRequest
from exgrpo_pool.service import convert


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(arr.tobytes()).decode()


def _rollout(kind: str, n: int, seed: int) -> dict[str, Any]:
    """A rollout's JSON fields: a payload of `n` tokens, sound or broken as `kind` says."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50_000, n).astype("<i4")
    lps = -rng.random(n).astype("<f4")
    out: dict[str, Any] = {"reward": 1.0}
    if kind == "none":
        return {"reward": 0.0}
    if kind == "negative id":
        ids[-1] = -3
    elif kind == "NaN log-prob":
        lps[0] = np.nan
    elif kind == "infinite log-prob":
        lps[-1] = -np.inf
    elif kind == "positive log-prob":
        lps[n // 2] = 0.5
    elif kind == "just over 1e-3":
        lps[0] = np.float32(1e-3) + np.float32(1e-6)
    elif kind == "at 1e-3":
        lps[0] = 1e-3
    elif kind == "negative zero":
        lps[0] = -0.0
    if kind == "lists":
        return {**out, "token_ids": ids.tolist(), "logprobs": [float(x) for x in lps]}
    if kind == "list ids":
        return {**out, "token_ids": ids.tolist(), "logprobs_b64": _b64(lps)}
    ids_b64, lps_b64 = _b64(ids), _b64(lps)
    if kind == "fewer log-probs":
        lps_b64 = _b64(lps[:-1])
    elif kind == "no tokens":
        ids_b64 = lps_b64 = ""
    elif kind == "not base64":
        ids_b64 = ids_b64[:-4] + "@@@="
    elif kind == "odd length":
        ids_b64 = base64.b64encode(ids.tobytes() + b"\x01").decode()
    elif kind == "too long":
        big = np.zeros(s.MAX_TOKENS_PER_TRAJECTORY + 1, dtype="<i4")
        ids_b64, lps_b64 = _b64(big), _b64(np.zeros(big.size, dtype="<f4"))
    return {**out, "token_ids_b64": ids_b64, "logprobs_b64": lps_b64}


SOUND = ["sound", "none", "at 1e-3", "negative zero"]
BROKEN = [
    "negative id",
    "NaN log-prob",
    "infinite log-prob",
    "positive log-prob",
    "just over 1e-3",
    "fewer log-probs",
    "no tokens",
    "not base64",
    "odd length",
    "too long",
]
KINDS = SOUND + BROKEN + ["lists", "list ids"]


def _groups(kinds: list[list[str]]) -> list[s.GroupResult]:
    body = {
        "groups": [
            {
                "question_id": gi + 1,
                "rollouts": [_rollout(k, 3 + (gi * 7 + ri) % 40, gi * 100 + ri) for ri, k in enumerate(g)],
            }
            for gi, g in enumerate(kinds)
        ]
    }
    return s.IngestRequest.model_validate(body).groups


def _rollout_by_rollout(groups: list[s.GroupResult]) -> list[Any]:
    """What checking each rollout alone gives: its packed bytes (or None), or the first error."""
    out: list[Any] = []
    for gi, g in enumerate(groups):
        for ri, r in enumerate(g.rollouts):
            try:
                arrays = convert.decode_payload(r, f"groups[{gi}].rollouts[{ri}] (question {g.question_id})")
            except BadRequest as e:
                return [*out, ("error", str(e))]
            out.append(None if arrays is None else (arrays[0].tobytes(), arrays[1].tobytes()))
    return out


def _at_once(groups: list[s.GroupResult]) -> list[Any]:
    try:
        convert.predecode(groups)
    except BadRequest as e:
        return [("error", str(e))]
    return [
        None if (p := packed_of(r)) is None else (bytes(p[0]), bytes(p[1]))
        for g in groups
        for r in g.rollouts
    ]


def _same(at_once: list[Any], one_by_one: list[Any]) -> None:
    if one_by_one and one_by_one[-1] and one_by_one[-1][0] == "error":
        assert at_once == [one_by_one[-1]]
    else:
        assert at_once == one_by_one


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_payload_among_sound_ones(kind: str) -> None:
    kinds = [["sound"] * 8, ["sound", kind, "sound", "none"], ["at 1e-3", "sound"]]
    _same(_at_once(_groups(kinds)), _rollout_by_rollout(_groups(kinds)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(KINDS), min_size=1, max_size=6), min_size=1, max_size=5))
def test_any_mix_of_payloads(kinds: list[list[str]]) -> None:
    _same(_at_once(_groups(kinds)), _rollout_by_rollout(_groups(kinds)))


def test_sound_base64_payloads_are_not_checked_rollout_by_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    one = convert.decode_payload

    def counted(r: s.Payload, where: str) -> Any:
        calls.append(where)
        return one(r, where)

    monkeypatch.setattr(convert, "decode_payload", counted)
    groups = _groups([["sound"] * 8 for _ in range(16)] + [["none", "at 1e-3", "negative zero"]])
    convert.predecode(groups)
    assert calls == []
    packed = [packed_of(r) for g in groups for r in g.rollouts]
    assert sum(p is not None for p in packed) == 16 * 8 + 2
    # a broken one among them: the rollouts are checked one by one, to name it
    groups = _groups([["sound"] * 8, ["sound", "NaN log-prob"]])
    with pytest.raises(
        BadRequest, match=r"groups\[1\]\.rollouts\[1\] \(question 2\): log-probs must be finite"
    ):
        convert.predecode(groups)
    assert len(calls) == 10


def test_lps_at_the_float32_limit() -> None:
    """1e-3 as a float32 is allowed (the bound is compared in float32, as a frame's check does)."""
    assert math.isclose(float(np.float32(1e-3)), 1e-3, rel_tol=1e-7)
    _same(_at_once(_groups([["at 1e-3"]])), _rollout_by_rollout(_groups([["at 1e-3"]])))
