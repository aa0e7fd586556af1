"""The binary form of a pool export (docs/api.md, "Binary export").

NDJSON carries every trajectory's token ids and log-probs as base64 text. The binary form
(`Accept: application/x-msgpack` on `GET /v1/pools/{pool}/export`) is a stream of records:

    MAGIC                                8 bytes, b"\\x89EXGRPO\\n"
    record, record, ...                  each: a uint32 little-endian length, then that many
                                         bytes of one msgpack map

A record is either the map of an NDJSON line (header, run, policy_version, question, state: the
same fields, told apart by `type`), or a frame of trajectories: a binary frame as in
`exgrpo_client.frames` whose body is `{"type": "trajectories", "trajectories": [...]}`, each entry
a trajectory record without its payload fields, the payloads of `trajectories[*]` in the frame's
buffers (raw little-endian int32 ids and float32 log-probs, the bytes the service stores). The
last record is `{"type": "end", "records": N}`, N the number of records before it, so a stream cut
off between two records is told from a complete one.

The first byte of the magic (0x89) begins no NDJSON export: `is_binary` tells the forms apart.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import msgpack
import numpy as np
from pydantic import TypeAdapter, ValidationError

from exgrpo_client import frames
from exgrpo_client import schemas as s

MEDIA_TYPE = frames.MEDIA_TYPE
MAGIC = b"\x89EXGRPO\n"
#: The largest record a reader takes (the service writes trajectory frames of about FRAME_BYTES).
MAX_RECORD_BYTES = 64 << 20
#: A trajectory frame is closed once its payloads and texts reach about this many bytes.
FRAME_BYTES = 8 << 20
TRAJECTORIES = "trajectories"
END = "end"

_PREFIX = struct.Struct("<I")
_RECORD: TypeAdapter[s.ExportRecord] = TypeAdapter(s.ExportRecord)
_NO_PAYLOAD = {"token_ids_b64": "", "logprobs_b64": ""}


class ExportFormatError(ValueError):
    """A binary export, or one of its records, that cannot be read."""


def is_binary(head: bytes) -> bool:
    """Whether an export that begins with `head` is the binary form (else NDJSON)."""
    return head[:1] == MAGIC[:1]


# ------------------------------------------------------------------------------------ writing
def record(obj: dict[str, Any]) -> bytes:
    """One record: its length and its msgpack map."""
    packed = msgpack.packb(obj, use_bin_type=True)
    return _PREFIX.pack(len(packed)) + packed


def model_record(model: s.ExportRecord) -> bytes:
    """The record of an NDJSON line's model (the same fields as the line)."""
    return record(model.model_dump(mode="json"))


def trajectory_frame(entries: list[dict[str, Any]], payloads: list[tuple[bytes, bytes]]) -> bytes:
    """A frame of trajectories: their records without payload fields, and each one's packed
    (token ids, log-probs) as stored."""
    frame = frames.encode({"type": TRAJECTORIES, TRAJECTORIES: entries}, payloads)
    return _PREFIX.pack(len(frame)) + frame


def end_record(records: int) -> bytes:
    return record({"type": END, "records": records})


# ------------------------------------------------------------------------------------ reading
class Reader:
    """Splits a binary export into its records' bytes, whatever the chunking of the stream."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._magic = False
        #: records handed out so far
        self.records = 0

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The records completed by `chunk` (ExportFormatError on a bad magic or length)."""
        self._buf += chunk
        if not self._magic:
            if len(self._buf) < len(MAGIC):
                if MAGIC.startswith(bytes(self._buf)):
                    return
                raise ExportFormatError(self._not_magic())
            if not self._buf.startswith(MAGIC):
                raise ExportFormatError(self._not_magic())
            self._magic = True
            self._pos = len(MAGIC)
        buf = self._buf
        while len(buf) - self._pos >= _PREFIX.size:
            (size,) = _PREFIX.unpack_from(buf, self._pos)
            if size > MAX_RECORD_BYTES:
                raise ExportFormatError(
                    f"record {self.records + 1} claims {size} bytes, more than the limit {MAX_RECORD_BYTES}"
                )
            start = self._pos + _PREFIX.size
            if len(buf) - start < size:
                break
            self._pos = start + size
            self.records += 1
            yield bytes(buf[start : self._pos])
        if self._pos > (1 << 20) or self._pos == len(buf):  # drop what was read
            del buf[: self._pos]
            self._pos = 0

    def close(self) -> None:
        """At the end of the stream: ExportFormatError if it ends inside the magic or a record."""
        if not self._magic:
            raise ExportFormatError(self._not_magic())
        left = len(self._buf) - self._pos
        if left:
            what = "its length" if left < _PREFIX.size else "it"
            raise ExportFormatError(
                f"the stream ends inside record {self.records + 1} ({left} bytes of {what})"
            )

    def _not_magic(self) -> str:
        return f"not a binary pool export: it does not begin with {MAGIC!r}"


@dataclass(frozen=True, slots=True)
class TrajectoryFrame:
    """A frame of trajectories: their records (validated; payload fields empty) and payloads
    (checked as a commit's)."""

    trajectories: list[s.ExportTrajectory]
    payloads: frames.Payloads

    def records(self) -> Iterator[s.ExportTrajectory]:
        """Each trajectory as its NDJSON record, payloads as base64."""
        for t, (ids, lps) in zip(self.trajectories, self._chunks(), strict=True):
            yield t.model_copy(update={"token_ids_b64": s.encode_b64(ids), "logprobs_b64": s.encode_b64(lps)})

    def _chunks(self) -> list[tuple[bytes, bytes]]:
        return [c for c in self.payloads.chunks() if c is not None]


@dataclass(frozen=True, slots=True)
class End:
    records: int


Item = s.ExportRecord | TrajectoryFrame | End


def parse(raw: bytes) -> Item:
    """One record, validated: an NDJSON record's model, a frame of trajectories or the end.
    Raises ExportFormatError (not a record) or pydantic's ValidationError (a record that breaks
    the models' rules)."""
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=len(raw))
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ExportFormatError(f"not a msgpack map ({e})") from e
    if not isinstance(obj, dict):
        raise ExportFormatError(f"a record is a msgpack map, not {type(obj).__name__}")
    if "v" in obj:
        return _trajectory_frame(obj)
    if obj.get("type") == END:
        records = obj.get("records")
        if set(obj) != {"type", "records"} or type(records) is not int or records < 0:
            raise ExportFormatError('the end record is {"type": "end", "records": <records before it>}')
        return End(records)
    if obj.get("type") == TRAJECTORIES:
        raise ExportFormatError("trajectories come in a frame (a map with 'v', 'body' and buffers)")
    return _RECORD.validate_python(obj, strict=True)


def _buffer(frame: dict[str, Any], key: str, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    buf = frame.get(key)
    if not isinstance(buf, bytes) or len(buf) % dtype.itemsize:
        raise frames.FrameError(f"{key!r} must be binary, a whole number of little-endian {dtype.name}")
    return np.frombuffer(buf, dtype=dtype)


def _trajectory_frame(frame: dict[str, Any]) -> TrajectoryFrame:
    body = frame.get("body")
    if frame.get("v") != frames.VERSION or not isinstance(body, dict):
        raise ExportFormatError(f"a frame is a map with 'v': {frames.VERSION} and a 'body' map")
    entries = body.get(TRAJECTORIES)
    if (
        body.get("type") != TRAJECTORIES
        or not isinstance(entries, list)
        or set(body) != {"type", TRAJECTORIES}
    ):
        raise ExportFormatError('a frame\'s body is {"type": "trajectories", "trajectories": [...]}')
    try:
        payloads = frames.Payloads(
            _buffer(frame, "lengths", s.ID_DTYPE),
            _buffer(frame, "token_ids", s.ID_DTYPE),
            _buffer(frame, "logprobs", s.LOGPROB_DTYPE),
        )
        if payloads.lengths.size != len(entries):
            raise frames.FrameError(
                f"'lengths' has {payloads.lengths.size} entries for {len(entries)} trajectories"
            )
        if (payloads.lengths == -1).any():
            raise frames.FrameError("every trajectory has a payload (no length -1)")
        payloads.check()
    except frames.FrameError as e:
        where = f"trajectories[{e.slot}]: " if e.slot is not None else ""
        raise ExportFormatError(f"{where}{e}") from e
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ExportFormatError(f"trajectories[{i}] is not a map")
        given = frames.json_fields_in(entry)
        if given:
            raise ExportFormatError(
                f"trajectories[{i}]: a frame carries payloads in its buffers, not in {', '.join(given)}"
            )
        try:
            out.append(s.ExportTrajectory.model_validate({**entry, **_NO_PAYLOAD}, strict=True))
        except ValidationError as e:
            raise ExportFormatError(f"trajectories[{i}]: {s.validation_summary(e)}") from e
    return TrajectoryFrame(out, payloads)


def header(head: bytes) -> s.ExportHeader | None:
    """The header of a binary export from its first bytes; None while they do not hold all of it.
    Raises ExportFormatError or ValidationError if they are no export's."""
    reader = Reader()
    for raw in reader.feed(head):
        item = parse(raw)
        if not isinstance(item, s.ExportHeader):
            raise ExportFormatError(f"the first record is a {_kind(item)!r} record, not the header")
        return item
    return None


def _kind(item: Item) -> str:
    if isinstance(item, TrajectoryFrame):
        return TRAJECTORIES
    return END if isinstance(item, End) else item.type


def read(file: IO[bytes], chunk_size: int = 1 << 20) -> Iterator[s.ExportRecord]:
    """The records of a binary export read from `file`, as NDJSON would give them: the header
    first, trajectories one by one with base64 payloads. ExportFormatError, naming the record,
    on a broken one or on a stream without its end."""
    reader = Reader()
    ended = False
    while chunk := file.read(chunk_size):
        for raw in reader.feed(chunk):
            n = reader.records
            try:
                if ended:
                    raise ExportFormatError("it comes after the end record")
                item = parse(raw)
                if n == 1 and not isinstance(item, s.ExportHeader):
                    raise ExportFormatError(f"the first record is a {_kind(item)!r} record, not the header")
            except ValidationError as e:
                raise ExportFormatError(f"record {n}: {s.validation_summary(e)}") from e
            except ExportFormatError as e:
                raise ExportFormatError(f"record {n}: {e}") from e
            if isinstance(item, End):
                check_end(item, n)
                ended = True
            elif isinstance(item, TrajectoryFrame):
                yield from item.records()
            else:
                yield item
    reader.close()
    if not ended:
        raise ExportFormatError(cut_off(reader.records))


def check_end(end: End, number: int) -> None:
    """The end record, record `number` of the stream, counts the records before it."""
    if end.records != number - 1:
        raise ExportFormatError(
            f"the end record counts {end.records} records before it, the stream held {number - 1}"
        )


def cut_off(records: int) -> str:
    return f"the stream ends after record {records} without the end record: it was cut off"
