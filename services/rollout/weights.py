"""Loading a published policy into a generation engine, by the uri the trainer registered.

`load_policy(engine, uri)` is the one entry point the rollout worker uses. The trainer publishes a
version in one of three ways (`rollout.publish` of its config, `exgrpo_trainer.publisher`):

- ``file:///.../v000010`` or a plain path: a Hugging Face folder on a filesystem shared with the
  trainer; the engine reads it (`engine.load_weights(path)`).
- ``http://HOST:PORT/policies/<pool>/<run>/v000010``: the trainer's weight server holds the version
  in memory as one safetensors byte string; the worker reads it into one buffer and the engine
  copies the tensors out of it (`engine.load_state_dict`). Nothing touches a disk on either side,
  and it works across hosts wherever the worker can reach the trainer.
- ``shm://<segment>``: the same bytes in a POSIX shared-memory segment (a file of ``/dev/shm``,
  Linux), written once per version by the trainer and mapped by the workers of the same host.

Engines that load in other processes (vLLM's workers) take the uri itself (`load_policy_uri`) and
fetch it there, so the tensors do not cross a process boundary twice.

The byte format is the safetensors format (``model.safetensors``): an 8-byte little-endian header
length, a JSON header of names -> dtype, shape and byte range, then the tensor bytes. It is written
straight into the destination buffer and read back as views of the received buffer (no copy of
the whole model on either side). This module imports only the standard library and torch: vLLM's
worker extension (`engines/vllm_ext.py`) uses it inside vLLM's processes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import mmap
import os
import shutil
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable
from urllib.parse import quote, unquote, urlparse
from urllib.request import url2pathname

import torch

if TYPE_CHECKING:
    from exgrpo_rollout.engines.base import GenerationEngine

__all__ = [
    "DTYPES",
    "FILES",
    "SHM_ROOT",
    "StateDictEngine",
    "UriEngine",
    "decode_state",
    "encode_state",
    "encoded_layout",
    "fetch_model_dir",
    "fetch_state",
    "load_policy",
    "path_from_uri",
    "policy_path",
    "policy_state",
    "shm_files",
    "shm_path",
    "write_state",
    "write_state_file",
]

SHM_ROOT = Path("/dev/shm")
"""Where POSIX shared-memory segments live on Linux (`shm_open` creates its files there)."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype codes of the tensors a model holds."""
_CODES = {v: k for k, v in DTYPES.items()}
FILES = "files"
"""Path under a policy's http uri, and last part of the name of a run's shm folder, of the model
folder's small files (config, generation config, tokenizer)."""


class StateDictEngine(Protocol):
    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy these named tensors (Hugging Face names) into the model's weights."""


@runtime_checkable
class UriEngine(Protocol):
    def load_policy_uri(self, uri: str) -> None:
        """Fetch and load the http:// or shm:// policy at `uri` in the engine's own processes."""


# ----------------------------------------------------------------------------------- uris
def path_from_uri(uri: str) -> str:
    """Local path of a published policy: a `file://` uri or a plain path."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"policy uri {uri!r} names host {parsed.netloc!r}: only local file:// uris load")
        return url2pathname(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return uri
    raise ValueError(
        f"policy uri {uri!r}: scheme {parsed.scheme!r} is not supported; workers load file:// uris "
        "(a filesystem shared with the trainer), http:// (the trainer's weight server) or shm:// "
        "(shared memory on the trainer's host)"
    )


def policy_path(pool: str, run: str, version: int) -> str:
    """The path part of a policy's http uri (and the name of its shm segment, with dots)."""
    return f"/policies/{quote(pool, safe='')}/{quote(run, safe='')}/v{version:06d}"


def shm_path(uri: str) -> Path:
    """The /dev/shm file of a `shm://<segment>` uri."""
    parsed = urlparse(uri)
    name = unquote(parsed.netloc + parsed.path)
    if parsed.scheme != "shm" or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"policy uri {uri!r}: expected shm://<segment name> (one name, no slash)")
    return SHM_ROOT / name


def shm_files(uri: str) -> Path:
    """The folder of the model's small files next to the segment of a `shm://` uri: the segment's
    name with its version part (``.v000010``) replaced by ``.files``."""
    path = shm_path(uri)
    stem, dot, version = path.name.rpartition(".")
    if not dot or not version.startswith("v"):
        raise ValueError(f"policy uri {uri!r}: the segment name does not end in .v<version>")
    return path.with_name(f"{stem}.{FILES}")


def _scheme(uri: str) -> str:
    scheme = urlparse(uri).scheme
    return "file" if scheme == "" or (len(scheme) == 1 and os.name == "nt") else scheme


# ------------------------------------------------------------------------------ the format
def encoded_layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[torch.Tensor, int]], int]:
    """(prefix: length + JSON header, [(tensor, byte offset in the whole buffer)], total size).

    Tensors are laid out by decreasing element size, so each starts aligned to its element size
    (the header is padded to a multiple of 8 bytes)."""
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in order:
        if t.dtype not in _CODES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be published")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    starts = [int(header[name]["data_offsets"][0]) + len(prefix) for name, _ in order]
    return prefix, [(t, s) for (_, t), s in zip(order, starts, strict=True)], len(prefix) + offset


def write_state(prefix: bytes, placed: list[tuple[torch.Tensor, int]], out: Any) -> None:
    """Write an `encoded_layout` into `out` (a writable buffer of the layout's total size).

    The header goes last, after its length was first overwritten with an impossible one: a reader
    of a reused shared-memory segment that compares the header before and after its load sees any
    rewrite that overlapped it (`policy_state`)."""
    view = memoryview(out)
    view[:8] = b"\xff" * 8
    for t, start in placed:
        size = t.numel() * t.element_size()
        if size == 0:
            continue
        dst = torch.frombuffer(out, dtype=torch.uint8, count=size, offset=start)
        src = t.detach()
        src = src.to("cpu") if src.device.type != "cpu" else src
        dst.copy_(src.contiguous().reshape(-1).view(torch.uint8))
    view[8 : len(prefix)] = prefix[8:]
    view[:8] = prefix[:8]


def write_state_file(prefix: bytes, placed: list[tuple[torch.Tensor, int]], f: BinaryIO) -> None:
    """Write an `encoded_layout` into an open binary file, in the same order as `write_state`
    (length invalidated first, header last). Writing into a file that already has its pages (a
    reused shared-memory segment) costs one copy and no page faults."""
    f.seek(0)
    f.write(b"\xff" * 8)
    f.seek(len(prefix))
    for t, _start in placed:  # in file order
        if t.numel():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    f.seek(8)
    f.write(prefix[8:])
    f.seek(0)
    f.write(prefix[:8])
    f.flush()


def encode_state(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytearray:
    """The safetensors bytes of `tensors`, written once into a new buffer."""
    prefix, placed, total = encoded_layout(tensors, metadata)
    out = bytearray(total)
    write_state(prefix, placed, out)
    return out


def decode_state(buf: Any) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors buffer, as views of it (no copy; keep `buf` alive while they are used).

    `buf` must be writable (a bytearray, or an mmap opened with ACCESS_COPY)."""
    view = memoryview(buf)
    if len(view) < 8:
        raise ValueError("policy weights: truncated (no header)")
    (length,) = struct.unpack_from("<Q", view, 0)
    if length > len(view) - 8:
        raise ValueError(f"policy weights: header of {length} bytes in a buffer of {len(view)}")
    try:
        header = json.loads(bytes(view[8 : 8 + length]))
    except ValueError as e:
        raise ValueError(f"policy weights: unreadable header ({e})") from e
    base = 8 + length
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"policy weights: tensor {name!r} has dtype {info.get('dtype')!r}")
        shape = [int(d) for d in info["shape"]]
        begin, end = (int(x) for x in info["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or base + end > len(view) or begin < 0:
            raise ValueError(f"policy weights: tensor {name!r} does not fit its byte range")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + begin).view(shape)
    return out


# ------------------------------------------------------------------------------- fetching
def _http_get(uri: str, timeout: float, into: bytearray | None = None) -> bytearray:
    """The body of a GET, read into `into` when it has the body's size (no new allocation: first
    touching hundreds of MB of fresh memory costs more than receiving them), else a new buffer."""
    parsed = urlparse(uri)
    if parsed.scheme != "http":
        raise ValueError(f"policy uri {uri!r}: only http:// is served (the trainer's weight server)")
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port or 80, timeout=timeout)
    try:
        try:
            conn.request("GET", parsed.path or "/")
            resp = conn.getresponse()
        except OSError as e:
            raise ConnectionError(
                f"policy uri {uri}: the trainer's weight server cannot be reached ({e})"
            ) from e
        if resp.status != 200:
            body = resp.read(2000).decode(errors="replace").strip()
            raise FileNotFoundError(f"policy uri {uri}: HTTP {resp.status} {body}")
        size = int(resp.getheader("Content-Length") or -1)
        if size < 0:
            raise ValueError(f"policy uri {uri}: the answer has no Content-Length")
        buf = into if into is not None and len(into) == size else bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = resp.readinto(view[got:])
            if not n:
                raise ConnectionError(f"policy uri {uri}: connection closed after {got} of {size} bytes")
            got += n
        return buf
    finally:
        conn.close()


def _shm_map(uri: str) -> mmap.mmap:
    path = shm_path(uri)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"policy uri {uri}: no shared-memory segment {path} (shm:// policies load only on the "
            "trainer's host, and only the versions it still keeps)"
        ) from e
    try:
        # private copy-on-write mapping: writable views for torch, pages shared until written
        return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


_RECEIVE_LOCK = threading.Lock()
_receive_buffer: bytearray | None = None
"""This process's buffer for http:// policies, kept between loads (one model's size)."""


@contextlib.contextmanager
def policy_state(uri: str, *, timeout: float = 300.0) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of an http:// or shm:// policy, valid inside the block only: views of this
    process's receive buffer (reused by the next load) or of the segment's mapping. Copy them out
    (an engine's `load_state_dict`) before the block ends.

    shm://: the trainer reuses the segments of dropped versions; a rewrite that overlapped this load
    is detected by the header (it carries the version) and raises ValueError at the end of the
    block, so the caller knows the weights it copied may be mixed."""
    global _receive_buffer
    scheme = _scheme(uri)
    if scheme == "http":
        with _RECEIVE_LOCK:
            buf = _http_get(uri, timeout, into=_receive_buffer)
            _receive_buffer = buf
            yield decode_state(buf)
    elif scheme == "shm":
        mm = _shm_map(uri)
        (length,) = struct.unpack_from("<Q", mm, 0) if len(mm) >= 8 else (0,)
        before = bytes(mm[: 8 + min(length, len(mm))])
        yield decode_state(mm)
        if bytes(mm[: len(before)]) != before:
            raise ValueError(f"policy uri {uri}: the trainer rewrote the segment during the load; load again")
    else:
        raise ValueError(f"policy uri {uri!r}: policy_state reads http:// and shm:// uris, not {scheme}://")


def fetch_state(uri: str, *, timeout: float = 300.0) -> dict[str, torch.Tensor]:
    """The tensors of an http:// or shm:// policy, as views of one received or mapped buffer."""
    scheme = _scheme(uri)
    if scheme == "http":
        return decode_state(_http_get(uri, timeout))
    if scheme == "shm":
        return decode_state(_shm_map(uri))
    raise ValueError(f"policy uri {uri!r}: fetch_state reads http:// and shm:// uris, not {scheme}://")


def fetch_model_dir(uri: str, dest: Path, *, timeout: float = 300.0) -> Path:
    """A Hugging Face folder of the policy at `uri`, for building an engine from it.

    file://: the published folder itself (`dest` unused). http:// and shm://: the model's small files
    (config, tokenizer) and its weights written into `dest`, once, at start-up."""
    scheme = _scheme(uri)
    if scheme == "file":
        return Path(path_from_uri(uri))
    dest.mkdir(parents=True, exist_ok=True)
    if scheme == "http":
        listing = json.loads(bytes(_http_get(f"{uri}/{FILES}", timeout)))
        for name in listing:
            (dest / _safe_name(name)).write_bytes(_http_get(f"{uri}/{FILES}/{quote(name)}", timeout))
        (dest / "model.safetensors").write_bytes(_http_get(uri, timeout))
    elif scheme == "shm":
        files = shm_files(uri)
        if not files.is_dir():
            raise FileNotFoundError(f"policy uri {uri}: no model files at {files}")
        for f in files.iterdir():
            shutil.copyfile(f, dest / f.name)
        shutil.copyfile(shm_path(uri), dest / "model.safetensors")
    else:
        raise ValueError(f"policy uri {uri!r}: scheme {scheme!r} is not supported")
    return dest


def _safe_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"model file name {name!r} from the weight server is not a plain file name")
    return name


# -------------------------------------------------------------------------------- loading
def load_policy(engine: GenerationEngine, uri: str) -> None:
    """Load the policy published at `uri` into `engine`.

    Raises ValueError for a uri it cannot load (unknown scheme, another host's file://),
    FileNotFoundError when the version is not there (any more), ConnectionError when the trainer's
    weight server cannot be reached."""
    scheme = _scheme(uri)
    if scheme == "file":
        engine.load_weights(path_from_uri(uri))
        return
    if scheme not in ("http", "shm"):
        path_from_uri(uri)  # raises with the list of supported schemes
    if isinstance(engine, UriEngine):
        engine.load_policy_uri(uri)
        return
    loader = getattr(engine, "load_state_dict", None)
    if loader is None:
        raise ValueError(f"engine {engine.name!r} cannot load {scheme}:// policies (no load_state_dict)")
    with policy_state(uri) as tensors:
        loader(tensors)
