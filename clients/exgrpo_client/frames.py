"""The binary wire frame: a body whose token ids and log-probs travel as raw little-endian buffers.

JSON carries each rollout's payload as two base64 strings. A frame (media type
`application/x-msgpack`) is one msgpack map instead:

    {"v": 1,
     "body": <the JSON body, its payload fields left out>,
     "lengths": <int32 LE, one per payload slot: its number of tokens, -1 for none>,
     "token_ids": <int32 LE, the token ids of every slot with a payload, in slot order>,
     "logprobs": <float32 LE, their log-probs, in the same order>}

Payload slots are, in document order, `groups[*].rollouts[*]` of a commit or an ingest and
`replay[*].candidates[*]` of a batch plan or a selection. Apart from the payload the body is what
the JSON body would be, field for field. Checks run over the whole frame at once (numpy over the
three buffers), never per rollout. See docs/api.md ("Binary frames").
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np
import numpy.typing as npt
from pydantic import BaseModel

from exgrpo_client import schemas as s

MEDIA_TYPE = "application/x-msgpack"
VERSION = 1
JSON_FIELDS = ("token_ids", "token_ids_b64", "logprobs", "logprobs_b64")
_JSON_FIELD_SET = frozenset(JSON_FIELDS)


def json_fields_in(slot: dict[str, Any]) -> list[str]:
    """The JSON payload fields a frame's slot carries (a frame carries none: its payloads are in
    its buffers). One set test in C for a slot without any: a commit has a thousand slots."""
    if _JSON_FIELD_SET.isdisjoint(slot):
        return []
    return [f for f in JSON_FIELDS if f in slot]


Arrays = tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]
M = TypeVar("M", bound=BaseModel)


class FrameError(ValueError):
    """A frame that cannot be read, or whose payload breaks a rule. `slot` is the payload slot the
    problem is in, when it is in one."""

    def __init__(self, message: str, slot: int | None = None) -> None:
        super().__init__(message)
        self.slot = slot


def wants_frame(header: str | None) -> bool:
    """Whether a `Content-Type` or `Accept` header names the frame's media type."""
    return header is not None and MEDIA_TYPE in header.lower()


@dataclass(frozen=True, slots=True)
class Payloads:
    """The payloads of a frame: per slot its length (-1: none), and all ids and log-probs."""

    lengths: npt.NDArray[np.int32]
    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]

    def _spans(self, width: int) -> list[tuple[int, int] | None]:
        """Each slot's (start, end) in the buffers, counted in units of `width`, or None."""
        ends = (np.cumsum(np.maximum(self.lengths, 0), dtype=np.int64) * width).tolist()
        out: list[tuple[int, int] | None] = []
        start = 0
        for n, end in zip(self.lengths.tolist(), ends, strict=True):
            out.append(None if n < 0 else (start, end))
            start = end
        return out

    def chunks(self) -> list[tuple[bytes, bytes] | None]:
        """Each slot's packed (ids, log-probs) bytes, or None: each slot copied once out of the
        frame's buffers (from its `views`, not a copy of the whole buffer first)."""
        return [None if v is None else (v[0].tobytes(), v[1].tobytes()) for v in self.views()]

    def views(self) -> list[tuple[memoryview, memoryview] | None]:
        """Each slot's (ids, log-probs) as byte views into the frame's buffers, or None: no copy,
        but each keeps the whole frame alive (a request's, read while it lasts; `chunks` for
        payloads kept longer)."""
        return list(self.iter_views())

    def iter_views(self) -> Iterator[tuple[memoryview, memoryview] | None]:
        """`views`, each slot's made as it is asked for (`attach` hands them on in one pass)."""
        ids = np.ascontiguousarray(self.token_ids).data.cast("B")
        lps = np.ascontiguousarray(self.logprobs).data.cast("B")
        at = 0
        for n in self.lengths.tolist():
            if n < 0:
                yield None
                continue
            end = at + 4 * n
            yield ids[at:end], lps[at:end]
            at = end

    def arrays(self) -> list[Arrays | None]:
        """Each slot's (ids, log-probs), views into the frame's buffers, or None."""
        ids, lps = self.token_ids, self.logprobs
        return [None if sp is None else (ids[sp[0] : sp[1]], lps[sp[0] : sp[1]]) for sp in self._spans(1)]

    def check(self) -> None:
        """The payload rules of the API, over the whole frame at once (FrameError naming the first
        slot that breaks one)."""
        if self._holds():
            return
        lengths = self.lengths
        bad = np.flatnonzero((lengths == 0) | (lengths < -1))
        if bad.size:
            raise FrameError(
                "a trajectory needs at least one token (-1 marks a slot without one)", int(bad[0])
            )
        bad = np.flatnonzero(lengths > s.MAX_TOKENS_PER_TRAJECTORY)
        if bad.size:
            n = int(lengths[bad[0]])
            raise FrameError(f"{n} tokens, more than the limit {s.MAX_TOKENS_PER_TRAJECTORY}", int(bad[0]))
        ends = np.cumsum(np.maximum(lengths, 0), dtype=np.int64)
        total = int(ends[-1]) if ends.size else 0
        if total != self.token_ids.size or total != self.logprobs.size:
            raise FrameError(
                f"the lengths add up to {total} tokens, but the frame holds {self.token_ids.size} token "
                f"ids and {self.logprobs.size} log-probs"
            )

        def slot_of(token: int) -> int:
            return int(np.searchsorted(ends, token, side="right"))

        neg = np.flatnonzero(self.token_ids < 0)
        if neg.size:
            raise FrameError("token ids must be in [0, 2^31)", slot_of(int(neg[0])))
        lps = self.logprobs
        bad = np.flatnonzero(~np.isfinite(lps))
        if bad.size:
            raise FrameError(
                "log-probs must be finite float32 numbers (found NaN or infinity)", slot_of(int(bad[0]))
            )
        bad = np.flatnonzero(lps > 1e-3)
        if bad.size:
            raise FrameError("log-probs must be <= 0 (they are log-probabilities)", slot_of(int(bad[0])))

    def _holds(self) -> bool:
        """Whether every rule of `check` holds, from a few reductions over the buffers (no array of
        positions, no mask of the buffers' size: a commit's 1.4M tokens 0.6 -> 0.3 ms); where one
        does not, `check` finds which and where."""
        lengths, ids, lps = self.lengths, self.token_ids, self.logprobs
        if lengths.size and (
            int(lengths.min()) < -1
            or int(lengths.max()) > s.MAX_TOKENS_PER_TRAJECTORY
            or np.count_nonzero(lengths) != lengths.size
        ):
            return False
        total = int(lengths[lengths > 0].sum(dtype=np.int64))
        if total != ids.size or total != lps.size:
            return False
        if not total:
            return True
        # NaN in both if any is NaN; compared as float32, as `check` compares the buffer (1e-3 as
        # a float32 is 1e-3 there, not the float32 just above it); not `high > 1e-3`: False for NaN
        low, high = lps.min(), lps.max()
        return bool(ids.min() >= 0 and high <= 1e-3 and low > -np.inf)


# ----------------------------------------------------------------------------------- frames
def slots(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The payload slots of a body, in order (a commit's or ingest's rollouts, a plan's or a
    selection's stored candidates)."""
    return iter(_slot_list(body))


def _slot_list(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`slots` as a list, gathered by comprehensions (a commit's thousand slots: one nested
    generator resumed per slot cost ~0.1 ms a pass)."""
    groups = body.get("groups")
    if isinstance(groups, list):
        return [
            r
            for g in groups
            if isinstance(g, dict) and isinstance(rollouts := g.get("rollouts"), list)
            for r in rollouts
            if isinstance(r, dict)
        ]
    replay = body.get("replay")
    if isinstance(replay, list):
        return [
            c
            for item in replay
            if isinstance(item, dict) and isinstance(cands := item.get("candidates"), list)
            for c in cands
            if isinstance(c, dict)
        ]
    return []


def json_fields_given(body: dict[str, Any]) -> list[str]:
    """The JSON payload fields (`json_fields_in`) of the first of a body's slots that carries any
    ([] when none does: a frame's body carries none, its payloads are in its buffers)."""
    fields = _JSON_FIELD_SET
    slots = _slot_list(body)
    if all(map(fields.isdisjoint, slots)):  # the usual answer, without a Python step per slot
        return []
    for slot in slots:
        if not fields.isdisjoint(slot):
            return json_fields_in(slot)
    return []


def encode(body: dict[str, Any], payloads: Sequence[tuple[Any, Any] | None]) -> bytes:
    """A frame of `body` (without payload fields) and one payload per slot: (ids, log-probs) as
    numpy arrays or packed little-endian bytes, or None."""
    counts: list[int] = []
    ids: list[bytes | memoryview] = []
    lps: list[bytes | memoryview] = []
    for p in payloads:
        if p is None:
            counts.append(-1)
            continue
        a, b = p
        # stored payloads come as bytes: taken as they are, without a call each
        if type(a) is not bytes:
            a = _raw(a, s.ID_DTYPE)
        if type(b) is not bytes:
            b = _raw(b, s.LOGPROB_DTYPE)
        counts.append(len(a) // 4)
        ids.append(a)
        lps.append(b)
    lengths = np.array(counts, dtype="<i4")
    # the map written piece by piece, so the payload bytes are copied once (into the join), not
    # gathered into one buffer first and then copied again into msgpack's growing one
    pack = msgpack.Packer(use_bin_type=True)
    parts = [
        pack.pack_map_header(5),
        pack.pack("v"),
        pack.pack(VERSION),
        pack.pack("body"),
        pack.pack(body),
        pack.pack("lengths"),
        pack.pack(lengths.tobytes()),
        pack.pack("token_ids"),
        _bin_header(sum(map(len, ids))),
        *ids,
        pack.pack("logprobs"),
        _bin_header(sum(map(len, lps))),
        *lps,
    ]
    return b"".join(parts)


def _bin_header(size: int) -> bytes:
    """msgpack's bin 32 header (any length below 4 GiB; readers take it for short ones too)."""
    return struct.pack(">BI", 0xC6, size)


def _raw(values: Any, dtype: np.dtype[Any]) -> bytes | memoryview:
    if isinstance(values, bytes | memoryview):
        return values
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def decode(raw: bytes) -> tuple[dict[str, Any], Payloads]:
    """The body and the payloads of a frame (FrameError if it is not one). The payload rules are
    not checked here: `Payloads.check`."""
    try:
        frame = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=len(raw))
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise FrameError(f"the body is not a msgpack frame ({e})") from e
    if not isinstance(frame, dict) or frame.get("v") != VERSION:
        raise FrameError(f"the body is not a frame of version {VERSION} (a map with 'v': {VERSION})")
    body = frame.get("body")
    if not isinstance(body, dict):
        raise FrameError("the frame's 'body' must be a map (the body as JSON would give it)")
    arrays: list[npt.NDArray[Any]] = []
    for key, dtype in (("lengths", s.ID_DTYPE), ("token_ids", s.ID_DTYPE), ("logprobs", s.LOGPROB_DTYPE)):
        buf = frame.get(key)
        if not isinstance(buf, bytes):
            raise FrameError(f"the frame's {key!r} must be binary (little-endian {dtype.name})")
        if len(buf) % dtype.itemsize:
            raise FrameError(
                f"the frame's {key!r} holds {len(buf)} bytes, not a whole number of {dtype.name}"
            )
        arrays.append(np.frombuffer(buf, dtype=dtype))
    payloads = Payloads(arrays[0], arrays[1], arrays[2])
    n = len(_slot_list(body))
    if payloads.lengths.size != n:
        raise FrameError(f"the frame's 'lengths' has {payloads.lengths.size} entries for {n} payload slots")
    return body, payloads


# ---------------------------------------------------------------------------------- models
def rollout_arrays(r: s.RolloutResult | s.TrajectoryPublic) -> tuple[Any, Any] | None:
    """A rollout's or a stored trajectory's payload (packed bytes, or arrays), from wherever the
    model holds it."""
    packed = r._packed
    if packed is not None:
        return packed
    if isinstance(r, s.TrajectoryPublic):
        if r.token_ids_b64 is None or r.logprobs_b64 is None:
            return None
        return s.decode_ids(r.token_ids_b64), s.decode_logprobs(r.logprobs_b64)
    if r.token_ids is not None:
        ids = np.asarray(r.token_ids, dtype=s.ID_DTYPE)
    elif r.token_ids_b64 is not None:
        ids = s.decode_ids(r.token_ids_b64)
    else:
        return None
    if r.logprobs is not None:
        return ids, np.asarray(r.logprobs, dtype=s.LOGPROB_DTYPE)
    return ids, s.decode_logprobs(r.logprobs_b64 or "")


def _no_payload_fields() -> dict[str, Any]:
    return dict.fromkeys(JSON_FIELDS, True)


def encode_model(model: BaseModel) -> bytes:
    """The frame of a commit, an ingest, a batch plan or a selection."""
    if isinstance(model, s.BatchCommit | s.IngestRequest):
        exclude: dict[str, Any] = {"groups": {"__all__": {"rollouts": {"__all__": _no_payload_fields()}}}}
        items: list[Any] = [r for g in model.groups for r in g.rollouts]
        body = model.model_dump(mode="json", exclude_unset=True, exclude=exclude)
    elif isinstance(model, s.BatchPlan | s.SelectResult):
        exclude = {"replay": {"__all__": {"candidates": {"__all__": {"token_ids_b64", "logprobs_b64"}}}}}
        items = [c for item in model.replay for c in item.candidates]
        body = model.model_dump(mode="json", exclude=exclude)
    else:
        raise TypeError(f"{type(model).__name__} has no payload slots")
    return encode(body, [rollout_arrays(x) for x in items])


def decode_model(raw: bytes, cls: type[M]) -> M:
    """A batch plan or a selection (answers of the service) from its frame: the stored
    candidates hold their payloads as arrays (`decode_trajectory` reads them)."""
    body, payloads = decode(raw)
    payloads.check()
    model = cls.model_validate(body, strict=False)
    attach(model, payloads)
    return model


def attach(model: BaseModel, payloads: Payloads, *, views: bool = False) -> None:
    """Give the payload slots of a validated model their frame payloads: copies, or with `views`
    byte views into the frame (`Payloads.views`: for a model read no longer than its frame)."""
    if isinstance(model, s.BatchCommit | s.IngestRequest):
        items: list[Any] = [r for g in model.groups for r in g.rollouts]
    elif isinstance(model, s.BatchPlan | s.SelectResult):
        items = [c for item in model.replay for c in item.candidates]
    else:
        raise TypeError(f"{type(model).__name__} has no payload slots")
    set_packed = s.set_packed
    # byte views where bytes go (every reader takes a buffer), handed on as they are made
    given: Iterable[Any] = payloads.iter_views() if views else payloads.chunks()
    for item, packed in zip(items, given, strict=True):
        if packed is not None:
            set_packed(item, packed)
