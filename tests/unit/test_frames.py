"""The binary frame codec (`exgrpo_client.frames`): round trips, the vectorised payload checks
(which slot breaks which rule), unreadable frames, and the SDK speaking frames or JSON to the
real app with the same results."""

from __future__ import annotations

import random
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_client_async import app  # noqa: F401  # the app fixture: SQLite in tmp_path

from exgrpo_client import AsyncClient, decode_trajectory, frames, rollout
from exgrpo_client import schemas as s


def _commit(payloads: list[tuple[list[int], list[float]] | None]) -> dict[str, Any]:
    return {"groups": [{"question_id": 1, "rollouts": [{"reward": float(p is not None)} for p in payloads]}]}


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.integers(1, 40).flatmap(
                lambda n: st.tuples(
                    st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n),
                    st.lists(st.floats(-50, 0, width=32), min_size=n, max_size=n),
                )
            ),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_round_trip_keeps_every_slot(payloads: list[tuple[list[int], list[float]] | None]) -> None:
    body = _commit(payloads)
    raw = frames.encode(body, [None if p is None else (np.array(p[0]), np.array(p[1])) for p in payloads])
    got_body, got = frames.decode(raw)
    got.check()
    assert got_body == body
    for want, arrays, packed, views in zip(payloads, got.arrays(), got.chunks(), got.views(), strict=True):
        if want is None:
            assert arrays is None and packed is None and views is None
            continue
        assert arrays is not None and packed is not None and views is not None
        assert arrays[0].tolist() == want[0] and arrays[1].tolist() == want[1]
        assert packed == (s.ids_bytes(want[0]), s.logprobs_bytes(want[1]))
        # the views hold the same bytes, read out of the frame's buffers without a copy
        assert (bytes(views[0]), bytes(views[1])) == packed
        assert np.shares_memory(np.frombuffer(views[0], np.uint8), got.token_ids)
        assert np.shares_memory(np.frombuffer(views[1], np.uint8), got.logprobs)


_ODD_BODIES: list[tuple[dict[str, Any], int, list[str]]] = [
    # (body, its payload slots, the JSON payload fields of the first slot that carries any)
    ({}, 0, []),
    ({"groups": "x"}, 0, []),
    ({"groups": [1, {"rollouts": "x"}, {"rollouts": [{}, 2, {"reward": 1}]}]}, 2, []),
    (
        {
            "groups": [
                {"rollouts": [{}]},
                {"rollouts": [{"logprobs": [], "token_ids_b64": ""}, {"token_ids": []}]},
            ]
        },
        3,
        ["token_ids_b64", "logprobs"],
    ),
    (
        {"replay": [{"candidates": [{"id": 1}, "x", {"logprobs_b64": ""}]}, None, {"candidates": 3}]},
        2,
        ["logprobs_b64"],
    ),
    ({"groups": [], "replay": [{"candidates": [{}]}]}, 0, []),  # a body with groups has no other slots
]


@pytest.mark.parametrize(("body", "n", "fields"), _ODD_BODIES)
def test_slots_of_odd_bodies(body: dict[str, Any], n: int, fields: list[str]) -> None:
    listed = list(frames.slots(body))
    assert len(listed) == n and all(isinstance(x, dict) for x in listed)
    assert frames.json_fields_given(body) == fields
    # the first slot that carries any, as `json_fields_in` names them
    assert fields == next((f for f in map(frames.json_fields_in, listed) if f), [])


def _bad(payloads: list[tuple[Any, Any] | None], **frame: Any) -> frames.FrameError:
    raw = frames.encode(_commit(payloads), payloads)
    if frame:
        raw = msgpack.packb({**msgpack.unpackb(raw), **frame})
    with pytest.raises(frames.FrameError) as info:
        _, p = frames.decode(raw)
        p.check()
    return info.value


def test_checks_name_the_slot_that_breaks_a_rule() -> None:
    good = (np.array([1, 2], "<i4"), np.array([-0.5, -1.0], "<f4"))
    e = _bad([good, None, (np.array([3, -1], "<i4"), np.array([-1.0, -1.0], "<f4"))])
    assert e.slot == 2 and "[0, 2^31)" in str(e)
    e = _bad([good, (np.array([3], "<i4"), np.array([np.inf], "<f4"))])
    assert e.slot == 1 and "finite" in str(e)
    e = _bad([(np.array([3], "<i4"), np.array([0.5], "<f4")), good])
    assert e.slot == 0 and "<= 0" in str(e)
    e = _bad([good, good], lengths=np.array([2, 0], "<i4").tobytes())
    assert e.slot == 1 and "at least one token" in str(e)
    too_long = s.MAX_TOKENS_PER_TRAJECTORY + 1
    e = _bad([good, good], lengths=np.array([2, too_long], "<i4").tobytes())
    assert e.slot == 1 and "limit" in str(e)
    e = _bad([good, good], lengths=np.array([2, 1], "<i4").tobytes())
    assert e.slot is None and "add up to 3 tokens" in str(e)


_SPECIAL = [0.0, -0.0, 1e-3, 2e-3, 0.5, -1e-30, float("nan"), float("inf"), float("-inf"), -3.0]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-3, 12), min_size=0, max_size=8),
    st.integers(-2, 2),
    st.lists(st.integers(-5, 40), max_size=4),
    st.lists(st.sampled_from(_SPECIAL), max_size=4),
    st.randoms(use_true_random=False),
)
def test_the_quick_check_agrees_with_the_one_that_names_the_slot(
    lengths: list[int], extra: int, ids: list[int], lps: list[float], rnd: Any
) -> None:
    """`Payloads.check` first asks a few reductions whether every rule holds, and looks for the slot
    only where one does not: the two agree on every frame, good or bad (tokens of each kind placed
    at random, lengths that do or do not add up, zero, negative and too long lengths)."""
    _agree(lengths, extra, ids, lps, rnd)


@pytest.mark.parametrize("value", _SPECIAL)
@pytest.mark.parametrize("where", [0, 3, 9])
def test_the_quick_check_agrees_on_each_special_log_prob(value: float, where: int) -> None:
    rnd = random.Random(where)
    lps = np.full(10, -0.25, dtype="<f4")
    lps[where] = value
    p = frames.Payloads(np.array([4, -1, 6], "<i4"), np.arange(10, dtype="<i4"), lps)
    assert p._holds() is not _broken(p)
    _agree([4, -1, 6], 0, [], [value], rnd)


def _broken(p: frames.Payloads) -> bool:
    """Whether the check that names the slot refuses `p`."""
    quick = frames.Payloads._holds
    frames.Payloads._holds = lambda self: False  # type: ignore[method-assign]  # the slow path alone
    try:
        p.check()
        return False
    except frames.FrameError:
        return True
    finally:
        frames.Payloads._holds = quick  # type: ignore[method-assign]


def _agree(lengths: list[int], extra: int, ids: list[int], lps: list[float], rnd: Any) -> None:
    total = sum(n for n in lengths if n > 0) + extra
    size = max(total, 0)
    token_ids = np.arange(size, dtype="<i4")
    logprobs = np.full(size, -0.25, dtype="<f4")
    for v in ids:
        if size:
            token_ids[rnd.randrange(size)] = v - 5  # -5..-1 break the rule, the others do not
    for v in lps:
        if size:
            logprobs[rnd.randrange(size)] = v
    if lengths and rnd.random() < 0.1:
        lengths[rnd.randrange(len(lengths))] = s.MAX_TOKENS_PER_TRAJECTORY + 1
    p = frames.Payloads(np.array(lengths, "<i4"), token_ids, logprobs)
    assert p._holds() is not _broken(p)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"\xc1", "not a msgpack frame"),
        (msgpack.packb([1, 2]), "version 1"),
        (msgpack.packb({"v": 1, "body": []}), "'body' must be a map"),
        (msgpack.packb({"v": 1, "body": {}, "lengths": "x"}), "must be binary"),
        (
            msgpack.packb({"v": 1, "body": {}, "lengths": b"", "token_ids": b"", "logprobs": b"12"}),
            "whole number",
        ),
        (
            msgpack.packb(
                {"v": 1, "body": _commit([None]), "lengths": b"", "token_ids": b"", "logprobs": b""}
            ),
            "0 entries for 1 payload slots",
        ),
    ],
)
def test_unreadable_frames(raw: bytes, words: str) -> None:
    with pytest.raises(frames.FrameError, match=None) as info:
        frames.decode(raw)
    assert words in str(info.value)


def test_frame_media_type_in_headers() -> None:
    assert frames.wants_frame("application/x-msgpack")
    assert frames.wants_frame("Application/X-Msgpack, application/json;q=0.5")
    assert not frames.wants_frame("application/json")
    assert not frames.wants_frame(None)


def test_models_go_through_frames_with_their_payloads() -> None:
    commit = s.BatchCommit.model_validate(
        {
            "groups": [
                {
                    "question_id": 3,
                    "rollouts": [rollout(1.0, [5, 6, 7], [-0.5, -0.25, -1.0]), rollout(0.0, None, None)],
                },
                {"question_id": 4, "rollouts": [{"reward": 1.0, "token_ids": [9], "logprobs": [-2.0]}]},
            ],
            "metrics": {"loss": 0.5},
        }
    )
    body, payloads = frames.decode(frames.encode_model(commit))
    assert body["metrics"] == {"loss": 0.5}
    assert all(not set(frames.JSON_FIELDS) & set(r) for g in body["groups"] for r in g["rollouts"])
    want = [
        (s.ids_bytes([5, 6, 7]), s.logprobs_bytes([-0.5, -0.25, -1.0])),
        None,
        (s.ids_bytes([9]), s.logprobs_bytes([-2.0])),
    ]
    back = s.BatchCommit.model_validate(body)
    frames.attach(back, payloads)
    assert [r._packed for g in back.groups for r in g.rollouts] == want
    # as views into the frame's buffers (the service's request path): the same bytes, no copy
    viewed = s.BatchCommit.model_validate(body)
    frames.attach(viewed, payloads, views=True)
    packed = [r._packed for g in viewed.groups for r in g.rollouts]
    assert [None if p is None else (bytes(p[0]), bytes(p[1])) for p in packed] == want
    assert all(isinstance(v, memoryview) for p in packed if p is not None for v in p)
    assert packed == [None if v is None else (v[0], v[1]) for v in payloads.views()]
    with pytest.raises(ValueError):  # a model with another number of payload slots
        frames.attach(s.BatchCommit.model_validate({"groups": body["groups"][:1]}), payloads, views=True)
    with pytest.raises(TypeError):
        frames.encode_model(s.SelectRequest(n=1))


# ------------------------------------------------------------------------- the SDK, both ways
def _groups(plan: s.BatchPlan) -> list[s.GroupResult]:
    out = []
    for item in [*plan.fresh, *plan.replay]:
        replayed = isinstance(item, s.ReplayItem)
        rows: list[s.RolloutResult] = []
        if replayed:
            rows.append(s.RolloutResult(reward=1.0, replayed=True))
        while len(rows) < plan.k:
            n = len(rows)
            correct = n < 2
            ids = [item.question_id, n + 1, 7] if correct else None
            rows.append(rollout(float(correct), ids, None if ids is None else [-0.25] * 3))
        out.append(s.GroupResult(question_id=item.question_id, rollouts=rows))
    return out


def _comparable(plan: s.BatchPlan) -> dict[str, Any]:
    out = plan.model_dump(
        exclude={"replay": {"__all__": {"candidates": {"__all__": {"token_ids_b64", "logprobs_b64"}}}}}
    )
    for item, original in zip(out["replay"], plan.replay, strict=True):
        for c, model in zip(item["candidates"], original.candidates, strict=True):
            ids, lps = decode_trajectory(model)
            c["payload"] = (ids.tolist(), lps.tolist())
    return out


async def test_the_sdk_gives_the_same_results_in_frames_and_json(app: Any) -> None:  # noqa: F811
    transport = httpx.ASGITransport(app=app)
    async with (
        AsyncClient("http://pool.test", transport=transport, retries=0) as framed,
        AsyncClient("http://pool.test", transport=transport, retries=0, binary=False) as plain,
    ):
        assert framed.binary and not plain.binary
        for name in ("a", "b"):
            await framed.create_pool(name, {"k": 4, "batch_size": 8, "start_threshold": 0.0})
            await framed.import_questions(
                name,
                [
                    s.QuestionCreate(
                        prompt=[s.ChatMessage(role="user", content=f"{i} + 1?")], ground_truth=str(i + 1)
                    )
                    for i in range(24)
                ],
            )
            await framed.create_run(name, "r1", seed=3)
        for _ in range(4):
            plans = [await framed.plan_batch("a", "r1"), await plain.plan_batch("b", "r1")]
            shift = 24  # pool b's question ids follow pool a's
            pa, pb = (_comparable(p) for p in plans)
            for x in (pa, pb):
                x.pop("id"), x.pop("pool"), x.pop("created_at")
            assert [q["question_id"] for q in pa["fresh"]] == [q["question_id"] - shift for q in pb["fresh"]]
            assert len(pa["replay"]) == len(pb["replay"])
            results = [
                await framed.commit_batch("a", plans[0].id, _groups(plans[0])),
                await plain.commit_batch("b", plans[1].id, _groups(plans[1])),
            ]
            ra, rb = (r.model_dump(exclude={"batch_id"}) for r in results)
            assert ra == rb
        # one pool read through both encodings: the same plan, the same selection
        a_plan = await framed.get_batch("a", plans[0].id)
        assert _comparable(a_plan) == _comparable(await plain.get_batch("a", plans[0].id))
        assert any(item.candidates for item in a_plan.replay)
        assert all(c.token_ids_b64 is None and c._packed for i in a_plan.replay for c in i.candidates)
        sel = [await c.select("a", "r1", 5, seed=11) for c in (framed, plain)]
        assert sel[0].model_dump(exclude={"replay"}) == sel[1].model_dump(exclude={"replay"})
        for x, y in zip(sel[0].replay, sel[1].replay, strict=True):
            assert [c.id for c in x.candidates] == [c.id for c in y.candidates]
            for cx, cy in zip(x.candidates, y.candidates, strict=True):
                assert all(
                    np.array_equal(u, v)
                    for u, v in zip(decode_trajectory(cx), decode_trajectory(cy), strict=True)
                )
