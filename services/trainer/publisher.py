"""Publishing the trainer's weights as a policy version that rollout workers load by uri.

`WeightPublisher.publish(model, tokenizer, pool, run, version)` is collective (every rank gathers
its shard; rank 0 publishes) and returns the uri to register with the pool service (rank 0; ""
elsewhere). Three ways, chosen by `rollout.publish`:

- `file` (`FilePublisher`, the default): a Hugging Face folder under the run's output folder,
  ``file://.../published/<pool>/<run>/v000010``. Workers need the same filesystem; every version
  stays on disk.
- `http` (`HttpPublisher`): the trainer serves the version from memory. Publishing serializes the
  full state dict once into one safetensors byte string; a small threaded HTTP server in the
  trainer process answers ``GET /policies/<pool>/<run>/v000010`` with it (and
  ``.../v000010/files[/<name>]`` with the model's config and tokenizer files, for a worker that
  starts without a model folder). No disk on either side; workers on another host reach it when the
  server binds an address they can route to (`rollout.publish_addr`).
- `shm` (`ShmPublisher`): the same bytes written once into a POSIX shared-memory segment
  (``/dev/shm/<segment>``, Linux), uri ``shm://<segment>``; workers of the same host map it.

The memory publishers keep the newest `keep` versions of each run (older ones are dropped: a
worker still reading one keeps its buffer alive until it is done) and free everything at `close()`.
A restarted trainer publishes its current version again: shm segment names follow the output
folder, so the uri is the one the service holds; an http uri is the same only when
`rollout.publish_port` is fixed (with a free port the service refuses the new uri with 409). Costs
and choice: docs/benchmarks.md, section "Weight publication".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import socket
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Generic, Literal, Protocol, TypeVar
from urllib.parse import quote, unquote

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from exgrpo_rollout.weights import FILES, SHM_ROOT, encoded_layout, policy_path, write_state, write_state_file
from exgrpo_trainer import dist
from exgrpo_trainer.model import publishable_state, write_model_files

__all__ = [
    "FilePublisher",
    "HttpPublisher",
    "PublishKind",
    "ShmPublisher",
    "WeightPublisher",
    "make_publisher",
    "model_files",
    "write_safetensors",
]

log = logging.getLogger("exgrpo.trainer")

PublishKind = Literal["file", "http", "shm"]


class WeightPublisher(Protocol):
    kind: str

    def publish(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pool: str, run: str, version: int
    ) -> str:
        """Publish the current weights as `version` of the run; the uri (rank 0), "" elsewhere.
        Collective: every rank calls it."""

    def close(self) -> None:
        """Stop serving and free what was published (the file publisher keeps its folders)."""


class FilePublisher:
    """Hugging Face folders under `root` (the run output's ``published`` folder), the same files
    `save_hf` writes: the weights go straight from the tensors to the file (no serialized copy in
    memory first) and the config and tokenizer files are rendered once per run."""

    kind = "file"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}

    def publish(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pool: str, run: str, version: int
    ) -> str:
        state = publishable_state(model)
        path = self.root / pool / run / f"v{version:06d}"
        if dist.is_main():
            if (pool, run) not in self.files:
                self.files[(pool, run)] = model_files(model, tokenizer)
            path.mkdir(parents=True, exist_ok=True)
            for name, data in self.files[(pool, run)].items():
                (path / name).write_bytes(data)
            write_safetensors(state, path / "model.safetensors", {"format": "pt"})
        dist.barrier()
        return path.resolve().as_uri() if dist.is_main() else ""

    def close(self) -> None:
        pass


def write_safetensors(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file of `state`, written tensor by tensor and renamed into place."""
    prefix, placed, _ = encoded_layout(state, metadata)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        write_state_file(prefix, placed, f)
    os.replace(tmp, path)


def model_files(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The small files of the model's Hugging Face folder (config, generation config, tokenizer),
    by name. Written once to a temporary folder and read back."""
    with tempfile.TemporaryDirectory(prefix="exgrpo-model-files-") as tmp:
        write_model_files(model, tokenizer, Path(tmp))
        return {f.name: f.read_bytes() for f in sorted(Path(tmp).iterdir()) if f.is_file()}


V = TypeVar("V")


class _Versions(Generic[V]):
    """The newest `keep` published buffers of each run, by (pool, run, version)."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.lock = threading.Lock()
        self.items: OrderedDict[tuple[str, str, int], V] = OrderedDict()

    def put(self, key: tuple[str, str, int], value: V) -> list[tuple[tuple[str, str, int], V]]:
        """Store `value`; the entries dropped to keep `keep` per run."""
        with self.lock:
            self.items[key] = value
            same = sorted(k for k in self.items if k[:2] == key[:2])
            dropped = [(k, self.items.pop(k)) for k in same[: max(0, len(same) - self.keep)]]
        return dropped

    def get(self, key: tuple[str, str, int]) -> V | None:
        with self.lock:
            return self.items.get(key)

    def clear(self) -> list[tuple[tuple[str, str, int], V]]:
        with self.lock:
            out = list(self.items.items())
            self.items.clear()
        return out


class _MemoryPublisher(Generic[V]):
    """What the http and shm publishers share: the gather, the model's small files (read once per
    run), the newest `keep` versions of each run."""

    kind: str

    versions: _Versions[V]

    def __init__(self, keep: int) -> None:
        self.versions = _Versions(keep)
        self.files: dict[tuple[str, str], dict[str, bytes]] = {}

    def publish(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pool: str, run: str, version: int
    ) -> str:
        state = publishable_state(model)
        if not dist.is_main():
            return ""
        if (pool, run) not in self.files:
            self.files[(pool, run)] = model_files(model, tokenizer)
            self._new_run(pool, run)
        return self._put(state, pool, run, version)

    @staticmethod
    def _metadata(pool: str, run: str, version: int) -> dict[str, str]:
        return {"format": "pt", "policy": f"{pool}/{run}/v{version:06d}"}

    def _new_run(self, pool: str, run: str) -> None:
        pass

    def _put(self, state: dict[str, torch.Tensor], pool: str, run: str, version: int) -> str:
        raise NotImplementedError


class HttpPublisher(_MemoryPublisher[bytearray]):
    """Serves published versions from this process's memory over HTTP (see the module docstring).

    `addr` is the address the server binds (127.0.0.1: this host only; 0.0.0.0: every interface);
    `advertise` the host name written into uris (default: `addr`, or this host's name for 0.0.0.0);
    `port` 0 picks a free port at the first publish."""

    kind = "http"

    def __init__(
        self, *, addr: str = "127.0.0.1", port: int = 0, advertise: str | None = None, keep: int = 2
    ) -> None:
        super().__init__(keep)
        self.addr, self.port = addr, port
        self.advertise = advertise or (socket.gethostname() if addr in ("0.0.0.0", "::", "") else addr)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._retired: list[bytearray] = []
        """Buffers of dropped versions, reused for new ones once no answer is sending them: the
        first touch of hundreds of MB of fresh memory costs more than writing the weights."""
        self._sending: dict[int, int] = {}

    def _buffer(self, total: int) -> bytearray:
        with self.versions.lock:
            for i, b in enumerate(self._retired):
                if len(b) == total and not self._sending.get(id(b)):
                    return self._retired.pop(i)
        return bytearray(total)

    def checkout(self, key: tuple[str, str, int]) -> bytearray | None:
        """The buffer of a version, counted as being sent until `checkin` (never reused meanwhile)."""
        with self.versions.lock:
            buf = self.versions.items.get(key)
            if buf is not None:
                self._sending[id(buf)] = self._sending.get(id(buf), 0) + 1
            return buf

    def checkin(self, buf: bytearray) -> None:
        with self.versions.lock:
            left = self._sending[id(buf)] - 1
            if left:
                self._sending[id(buf)] = left
            else:
                del self._sending[id(buf)]

    @property
    def base_url(self) -> str:
        return f"http://{self.advertise}:{self.port}"

    def start(self) -> None:
        if self._server is not None:
            return
        self._server = ThreadingHTTPServer((self.addr, self.port), _handler(self))
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="weight-server", daemon=True)
        self._thread.start()
        log.info("weight server on %s (binds %s)", self.base_url, self.addr)

    def _put(self, state: dict[str, torch.Tensor], pool: str, run: str, version: int) -> str:
        self.start()
        prefix, placed, total = encoded_layout(state, self._metadata(pool, run, version))
        buf = self._buffer(total)
        write_state(prefix, placed, buf)
        dropped = self.versions.put((pool, run, version), buf)
        with self.versions.lock:
            self._retired = [*self._retired, *(b for _, b in dropped)][-self.versions.keep :]
        return self.base_url + policy_path(pool, run, version)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.versions.clear()
        self._retired = []


def _handler(pub: HttpPublisher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # headers and body go out as two writes: without this, Nagle's algorithm holds the body
            # until the client's delayed ACK of the headers (~40 ms per request on Linux)
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_GET(self) -> None:
            parts = [unquote(p) for p in self.path.split("?", 1)[0].strip("/").split("/")]
            if len(parts) < 4 or parts[0] != "policies" or not _is_version(parts[3]):
                self._send(404, b"not a policy path: /policies/<pool>/<run>/v<version>[/files[/<name>]]\n")
                return
            pool, run, version = parts[1], parts[2], int(parts[3][1:])
            rest = parts[4:]
            if pub.versions.get((pool, run, version)) is None:
                self._send(404, f"policy version {version} of {pool}/{run} is not served here\n".encode())
                return
            files = pub.files.get((pool, run), {})
            if not rest:
                buf = pub.checkout((pool, run, version))
                if buf is None:  # dropped just now
                    self._send(404, f"policy version {version} of {pool}/{run} is not served here\n".encode())
                    return
                try:
                    self._send(200, buf, "application/octet-stream")
                finally:
                    pub.checkin(buf)
            elif rest == [FILES]:
                self._send(200, json.dumps(sorted(files)).encode(), "application/json")
            elif len(rest) == 2 and rest[0] == FILES and rest[1] in files:
                self._send(200, files[rest[1]], "application/octet-stream")
            else:
                self._send(404, b"no such file of the policy\n")

        def _send(self, status: int, body: bytes | bytearray, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(memoryview(body))

        def log_message(self, format: str, *args: object) -> None:
            log.debug("weight server: " + format, *args)

    return Handler


def _is_version(part: str) -> bool:
    return len(part) > 1 and part[0] == "v" and part[1:].isdigit()


@dataclass
class _Segment:
    path: Path
    map: mmap.mmap
    """Kept mapped: rewriting a mapped segment is a plain copy, without a page fault per page."""


class ShmPublisher(_MemoryPublisher[_Segment]):
    """Writes each version once into a POSIX shared-memory segment of this host (see the module
    docstring). Segments are named ``<prefix>.<pool>.<run>.v000010``; the model's small files go to
    the folder ``<prefix>.<pool>.<run>.files`` (`exgrpo_rollout.weights.shm_files`). `prefix`
    defaults to one unique to this process."""

    kind = "shm"

    def __init__(self, *, prefix: str | None = None, keep: int = 2, root: Path = SHM_ROOT) -> None:
        if not root.is_dir():
            raise ValueError(f"rollout.publish=shm needs POSIX shared memory at {root} (Linux)")
        super().__init__(keep)
        self.root = root
        self.prefix = prefix or f"exgrpo-{os.getpid()}-{os.urandom(3).hex()}"
        self._retired: list[_Segment] = []
        """Segments of dropped versions (no uri names them any more), rewritten for new versions."""

    def segment(self, pool: str, run: str, version: int) -> str:
        return f"{self.prefix}.{pool}.{run}.v{version:06d}"

    def _new_run(self, pool: str, run: str) -> None:
        files = self.root / f"{self.prefix}.{pool}.{run}.{FILES}"
        files.mkdir(exist_ok=True)
        for fname, data in self.files[(pool, run)].items():
            (files / fname).write_bytes(data)

    def _put(self, state: dict[str, torch.Tensor], pool: str, run: str, version: int) -> str:
        name = self.segment(pool, run, version)
        path = self.root / name
        prefix, placed, total = encoded_layout(state, self._metadata(pool, run, version))
        tmp = path.with_name(name + ".partial")
        seg = self._retired.pop() if self._retired else None
        if seg is not None and len(seg.map) == total:
            # the segment of a dropped version, renamed away from its uri and rewritten in place;
            # a worker still loading it sees the header change (`policy_state`)
            os.replace(seg.path, tmp)
        else:
            if seg is not None:
                _drop(seg)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, total)
                seg = _Segment(tmp, mmap.mmap(fd, total))
            finally:
                os.close(fd)
        write_state(prefix, placed, seg.map)
        os.replace(tmp, path)  # readers never see a partly written segment under its name
        seg.path = path
        for _, old in self.versions.put((pool, run, version), seg):
            self._retired.append(old)
        while len(self._retired) > 1:
            _drop(self._retired.pop(0))
        return f"shm://{quote(name, safe='')}"

    def close(self) -> None:
        for seg in [*(v for _, v in self.versions.clear()), *self._retired]:
            _drop(seg)
        self._retired = []
        for pool, run in self.files:
            shutil.rmtree(self.root / f"{self.prefix}.{pool}.{run}.{FILES}", ignore_errors=True)
        self.files.clear()


def _drop(seg: _Segment) -> None:
    """Unmap and unlink a segment (processes that mapped it keep their mapping)."""
    seg.map.close()
    with contextlib.suppress(FileNotFoundError):
        seg.path.unlink()


def make_publisher(
    kind: PublishKind,
    published_root: Path,
    *,
    addr: str = "127.0.0.1",
    port: int = 0,
    keep: int = 2,
) -> WeightPublisher:
    """The publisher of `rollout.publish`. Segment names of shm are derived from the output folder,
    so a trainer restarted on the same folder publishes a version under the uri the service already
    holds for it (the service accepts the same uri again, and refuses another)."""
    if kind == "file":
        return FilePublisher(published_root)
    if kind == "http":
        return HttpPublisher(addr=addr, port=port, keep=keep)
    if kind == "shm":
        digest = hashlib.sha256(str(published_root.resolve()).encode()).hexdigest()[:12]
        return ShmPublisher(prefix=f"exgrpo-{digest}", keep=keep)
    raise ValueError(f"unknown publish kind {kind!r}: use file, http or shm")
