"""Latency, throughput and memory of the experience-pool service at 10k, 100k and 1M questions.

For every backend (``postgres``: Postgres + Redis index; ``sqlite``: SQLite + in-process index)
and pool size, the benchmark copies a cached seeded database (see ``_seed.py`` for its exact
shape), starts the real service as a subprocess (``_serve.py``: uvicorn on a free loopback port)
and talks to it over HTTP with httpx, as a trainer would:

* select: ``POST .../select`` with n = 64 on the seeded state, with all stored trajectories and
  their payloads, and with ids only (``candidates: none``, the sampling path alone).
* plan + commit: each step plans a batch (B = 128, experience ratio 0.5, run in the mixed phase,
  so 64 replayed questions with all their stored trajectories) and commits 128 groups x 8
  rollouts. Rewards follow a fixed mix (25% of fresh groups all wrong, 8% all right -> retired,
  the rest 1..7 correct); correct rollouts carry ~1k-token payloads as base64 packed arrays.
* ingest: ``POST .../ingest`` of 32 graded groups per request from several concurrent producers;
  throughput = stored trajectories per second.
* epoch start: the first plan of a brand-new run, which shuffles the whole pool.
* memory: RSS of the server process (``/proc/<pid>/status``) along the run and its peak.

Every latency is measured by the client around the HTTP call (request encoding excluded, response
download included). The server adds a ``Server-Timing`` header (time in the app, in SQL, in Redis)
and the CPU time of the server's threads is read around each request, so the report can tell
where the time goes even on a busy machine.

    .venv/bin/python bench/pool_bench.py                      # full: both backends, 10k/100k/1M
    .venv/bin/python bench/pool_bench.py --quick              # 10k only, few iterations (~1-2 min)
    .venv/bin/python bench/pool_bench.py --markdown bench/out/pool_bench.json   # tables as markdown
    .venv/bin/python bench/pool_bench.py --clean              # drop the cached seeded databases

Results: tables on stdout and ``bench/out/pool_bench.json``. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pydantic_core

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _seed

from exgrpo_client import frames, schemas

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
CACHE = OUT / "cache"
SERVE = ROOT / "bench" / "_serve.py"
FLOOR = ROOT / "bench" / "_floor.py"
GOAL_MS = 100.0
GOAL_SELECT_GROWTH = 2.0


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- server
#: how long the benchmark's clients keep an idle connection for the next request: under uvicorn's
#: 5 s (its `timeout_keep_alive`), so that a request never goes out on a connection the server is
#: closing at that moment (a `ReadError` with nothing wrong: the SDK retries such errors, these raw
#: clients do not; a throughput round 5 s after the side's last one met it)
KEEPALIVE_S = 2.0


def bench_client(url: str) -> httpx.AsyncClient:
    """The benchmark's HTTP client of a server at `url` (no proxies from the environment)."""
    # httpx's own limits but for the keep-alive
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S)
    return httpx.AsyncClient(base_url=url, timeout=300, trust_env=False, limits=limits)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def family(pid: int) -> list[int]:
    """`pid` and every process below it (`exgrpo serve --workers N`: the supervisor and its
    workers), from each thread's `children` list (Linux)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def memory_mb(pid: int) -> dict[str, float]:
    """Resident and peak resident size of a process and the processes below it, summed."""
    out = {"VmRSS": 0.0, "VmHWM": 0.0}
    for p in family(pid):
        with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in out:
                    out[key] += int(value.split()[0]) / 1024
    return {"rss": round(out["VmRSS"], 1), "peak": round(out["VmHWM"], 1)}


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    startup_s: float
    log_path: Path
    profile_path: Path | None = None
    redis_url: str | None = None
    redis_prefix: str = ""

    def memory(self) -> dict[str, float]:
        return memory_mb(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


#: service processes (`--service-workers`; the floor is always one)
SERVICE_WORKERS = 1
#: the service's max_active_requests (None: its default)
MAX_ACTIVE: int | None = None
#: the service's sqlite_driver (None: its default)
SQLITE_DRIVER: str | None = None
#: an older tree whose service runs instead of this one (`--service-src`; None: this tree's)
SERVICE_SRC: Path | None = None
#: the service's ingest_group_max (`--ingest-group-max`; None: its default)
INGEST_GROUP_MAX: int | None = None
#: a folder for every side's statement log (`--sql-log`; None: no log)
SQL_LOG: Path | None = None


def older_service_path(src: Path) -> str:
    """A folder to put first on the service's PYTHONPATH so that it imports `exgrpo_pool` and
    `exgrpo_client` (the wire models it uses) from the older tree `src` (e.g. the output of
    `git archive <commit> services clients | tar -x -C src`)."""
    shim = OUT / "service-src"
    shim.mkdir(parents=True, exist_ok=True)
    for name, rel in (("exgrpo_pool", "services/buffer_api"), ("exgrpo_client", "clients/exgrpo_client")):
        target = (src / rel).resolve()
        if not (target / "__init__.py").is_file():
            raise SystemExit(f"--service-src: {target} is not a package")
        link = shim / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return str(shim)


def schema_head(src: Path) -> str:
    """The newest migration of the older tree `src`: the revision no other one revises."""
    revisions: dict[str, str | None] = {}
    for f in (src / "services/buffer_api/store/migrations/versions").glob("*.py"):
        text = f.read_text()
        rev = re.search(r'^revision = "([^"]+)"', text, re.M)
        down = re.search(r'^down_revision = (?:"([^"]+)"|None)', text, re.M)
        if rev and down:
            revisions[rev.group(1)] = down.group(1)
    heads = set(revisions) - set(revisions.values())
    if len(heads) != 1:
        raise SystemExit(f"--service-src: migrations with {len(heads)} heads: {sorted(heads)}")
    return heads.pop()


async def downgrade_to(url: str, src: Path) -> str:
    """Take a seeded copy back to the schema of the older tree `src` (this tree's migrations run
    down) and drop the keys of its pool configs and run overrides that the older wire models do
    not know (they refuse extra keys). Returns the older schema's revision."""
    import ast

    from alembic import command
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from exgrpo_pool.store import db as dbmod

    head = schema_head(src)
    await asyncio.to_thread(command.downgrade, dbmod.alembic_config(url), head)
    tree = ast.parse((src / "clients/exgrpo_client/schemas.py").read_text())
    fields = {
        node.name: {
            f.target.id for f in node.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
        }
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            for table, column, model in (
                ("pool", "config", "PoolConfig"),
                ("run", "overrides", "RunOverrides"),
            ):
                rows = (await conn.execute(text(f"SELECT id, {column} FROM {table}"))).all()
                for row_id, raw in rows:
                    value = json.loads(raw) if isinstance(raw, str) else raw
                    kept = {k: v for k, v in (value or {}).items() if k in fields[model]}
                    if kept != value:
                        update = text(f"UPDATE {table} SET {column} = :v WHERE id = :id")
                        await conn.execute(update, {"v": json.dumps(kept), "id": row_id})
    finally:
        await engine.dispose()
    return head


def start_server(
    env_extra: dict[str, str], log_path: Path, profile_path: Path | None, script: Path = SERVE
) -> Server:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_")}
    env.update(
        EXGRPO_ALLOW_ANONYMOUS="true",
        EXGRPO_HOST="127.0.0.1",
        EXGRPO_PORT=str(port),
        FLOOR_PORT=str(port),
        EXGRPO_BENCH_TIMING="1",
    )
    env.update(env_extra)
    if profile_path is not None:
        env["EXGRPO_BENCH_PROFILE"] = str(profile_path)
    if script == SERVE and SERVICE_WORKERS > 1:
        env["EXGRPO_WORKERS"] = str(SERVICE_WORKERS)
    if script == SERVE and MAX_ACTIVE is not None:
        env["EXGRPO_MAX_ACTIVE_REQUESTS"] = str(MAX_ACTIVE)
    if script == SERVE and SQLITE_DRIVER is not None:
        env["EXGRPO_SQLITE_DRIVER"] = SQLITE_DRIVER
    if script == SERVE and INGEST_GROUP_MAX is not None:
        env["EXGRPO_INGEST_GROUP_MAX"] = str(INGEST_GROUP_MAX)
    if SQL_LOG is not None:  # one file per server: its log's name, `.sql`
        SQL_LOG.mkdir(parents=True, exist_ok=True)
        env["EXGRPO_BENCH_SQL_LOG"] = str(SQL_LOG / f"{log_path.stem}.sql")
    if script == SERVE and SERVICE_SRC is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (older_service_path(SERVICE_SRC), env.get("PYTHONPATH", "")) if p
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT, stdout=logf, stderr=logf)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    with httpx.Client(trust_env=False, timeout=5) as c:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"service exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if c.get(f"{url}/readyz").status_code == 200:
                    break
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"service not ready after 900 s; see {log_path}")
            time.sleep(0.1)
    return Server(proc, url, time.perf_counter() - t0, log_path, profile_path)


# ------------------------------------------------------------------------------- the client
@dataclass
class Sample:
    ms: float
    cpu_ms: float | None = None
    app_ms: float | None = None
    sql_ms: float | None = None
    sql_n: int | None = None
    redis_ms: float | None = None
    redis_n: int | None = None
    gc_ms: float | None = None
    bytes_out: int = 0
    bytes_in: int = 0


def _server_timing(header: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in (header or "").split(","):
        fields = [f.strip() for f in part.split(";")]
        name = fields[0]
        for f in fields[1:]:
            if f.startswith("dur="):
                out[f"{name}_ms"] = float(f[4:])
            elif f.startswith("desc="):
                out[f"{name}_n"] = float(f[5:].strip('"'))
    return out


def cpu_ms(pid: int) -> float:
    """CPU time so far of every thread of a process and of the processes below it (a service's
    workers), in scheduler nanoseconds, not clock ticks. A worker that exited no longer counts."""
    total = 0
    for p in family(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
    return total / 1e6


@dataclass
class Api:
    client: httpx.AsyncClient
    pid: int


def answer(r: httpx.Response) -> dict[str, Any]:
    """An answer's body, JSON or a binary frame (payloads left in the frame's buffers)."""
    if frames.wants_frame(r.headers.get("content-type")):
        return frames.decode(r.content)[0]
    out: dict[str, Any] = r.json()
    return out


def wire_headers(encoding: str, frame_body: bool = False) -> dict[str, str]:
    """Headers of a request in `encoding` (json or binary): the answer's, and the body's."""
    if encoding == "json":
        return {}
    return {"accept": frames.MEDIA_TYPE, **({"content-type": frames.MEDIA_TYPE} if frame_body else {})}


async def timed_post(
    api: Api, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[httpx.Response, Sample]:
    h = {"content-type": "application/json", **(headers or {})}
    return await timed_request(api, "POST", path, body, h)


async def timed_get(api: Api, path: str) -> tuple[httpx.Response, Sample]:
    return await timed_request(api, "GET", path, b"", {})


async def timed_request(
    api: Api, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[httpx.Response, Sample]:
    """One request, its latency and the server process's CPU meanwhile (every thread)."""
    c0 = cpu_ms(api.pid)
    t0 = time.perf_counter()
    r = await api.client.request(method, path, content=body or None, headers=headers)
    ms = (time.perf_counter() - t0) * 1000
    cpu = cpu_ms(api.pid) - c0
    if r.status_code >= 300:
        raise RuntimeError(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
    st = _server_timing(r.headers.get("server-timing"))
    sample = Sample(
        ms=ms,
        cpu_ms=cpu,
        app_ms=st.get("app_ms"),
        sql_ms=st.get("sql_ms"),
        sql_n=int(st["sql_n"]) if "sql_n" in st else None,
        redis_ms=st.get("redis_ms"),
        redis_n=int(st["redis_n"]) if "redis_n" in st else None,
        gc_ms=st.get("gc_ms"),
        bytes_out=len(body),
        bytes_in=len(r.content),
    )
    return r, sample


def _mean(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return round(float(np.mean(got)), 2) if got else None


def _max(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return round(float(np.max(got)), 2) if got else None


#: decimals of the milliseconds a summary keeps (1 us): a run's stats take ~1.2 ms, where tenths
#: of a millisecond made the medians of the interval's resamples a few values apart (8% steps) and
#: its bounds one of them, not always around the ratio reported beside it
MS_DECIMALS = 3


def summarize(samples: list[Sample]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    ms = np.array([x.ms for x in samples])

    def med(attr: str) -> float | None:
        vals = [getattr(x, attr) for x in samples if getattr(x, attr) is not None]
        return round(float(np.median(vals)), 2) if vals else None

    return {
        "n": len(samples),
        "p50_ms": round(float(np.percentile(ms, 50)), MS_DECIMALS),
        "p99_ms": round(float(np.percentile(ms, 99)), MS_DECIMALS),
        "mean_ms": round(float(ms.mean()), 2),
        "max_ms": round(float(ms.max()), 2),
        "server_cpu_mean_ms": round(float(np.mean([x.cpu_ms for x in samples if x.cpu_ms is not None])), 2),
        "server_app_p50_ms": med("app_ms"),
        "server_sql_p50_ms": med("sql_ms"),
        "server_sql_statements_p50": med("sql_n"),
        "server_redis_p50_ms": med("redis_ms"),
        "server_redis_calls_p50": med("redis_n"),
        "server_gc_mean_ms": _mean([x.gc_ms for x in samples]),
        "server_gc_max_ms": _max([x.gc_ms for x in samples]),
        "request_bytes_p50": med("bytes_out"),
        "response_bytes_p50": med("bytes_in"),
        "samples_ms": [round(float(x), MS_DECIMALS) for x in ms],
        # where the slowest requests' time went (the tail of a p99: in the app, in SQL, in Redis, in
        # garbage collection, or outside the app: the network, the client, a CPU not free)
        "slowest": [
            {k: (None if v is None else round(float(v), 1)) for k, v in vars(x).items() if k.endswith("_ms")}
            for x in sorted(samples, key=lambda x: -x.ms)[:5]
        ],
    }


#: random payloads each `Trainer` draws once and slices for its rollouts (see `Trainer.payload`)
PAYLOAD_POOL = 64


class Trainer:
    """Builds commit and ingest bodies the way a trainer / producer would send them.

    Cheaply: the 50 clients of the mix share the machine with the service, so a body costs the
    clients what it must and no more. Scalars come from Python's generator (numpy's costs ~1-2 us
    a call, ~1,000 calls a commit); a payload is a slice of random arrays drawn once, its first
    two token ids stamped with a counter so that no two payloads are the same (a repeated one
    would be de-duplicated, not stored). A 128-group commit body took 21.6 ms to build with a
    payload drawn per rollout (half of a client CPU at the mix's ~12 commits/s)."""

    def __init__(self, seed: int, k: int = 8, tokens: tuple[int, int] = (512, 1536)) -> None:
        rng = np.random.default_rng(seed)
        self.py = random.Random(seed)
        self.k = k
        self.tokens = tokens
        # fresh groups: P(0 correct) = 0.25, P(K correct) = 0.08, 1..K-1 share the rest
        self.fresh_cum = list(itertools.accumulate([0.25] + [0.67 / (k - 1)] * (k - 1) + [0.08]))
        # replayed groups: the stored (correct) trajectory + K-1 new rollouts, of which j correct
        self.replay_cum = list(itertools.accumulate([0.15] + [0.77 / (k - 2)] * (k - 2) + [0.08]))
        self._ids = rng.integers(0, _seed.VOCAB, size=(PAYLOAD_POOL, tokens[1]), dtype=np.int32).astype("<i4")
        self._lps = (-rng.exponential(0.6, size=(PAYLOAD_POOL, tokens[1]))).astype("<f4")
        self._serial = int(rng.integers(0, _seed.VOCAB**2))

    def payload(self) -> tuple[np.ndarray, np.ndarray]:
        n = self.py.randint(self.tokens[0], self.tokens[1])
        row = self.py.randrange(PAYLOAD_POOL)
        ids = self._ids[row, :n].copy()
        self._serial = (self._serial + 1) % _seed.VOCAB**2
        ids[0], ids[1] = divmod(self._serial, _seed.VOCAB)
        return ids, self._lps[row, :n]

    def rollout(self, correct: bool, replayed: bool = False) -> dict[str, Any]:
        r: dict[str, Any] = {
            "reward": 1.0 if correct else 0.0,
            "entropy": round(self.py.uniform(0.05, 1.5), 4),
        }
        if replayed:
            r["replayed"] = True
        elif correct:
            r["_payload"] = self.payload()  # sent as base64 (JSON) or raw buffers (frame)
            r["finish_reason"] = "stop"
        else:
            r["finish_reason"] = "stop" if self.py.random() < 0.8 else "length"
        return r

    def _draw(self, cum: list[float]) -> int:
        """An index drawn with the probabilities whose running sums are `cum`."""
        return min(bisect.bisect_right(cum, self.py.random() * cum[-1]), len(cum) - 1)

    def fresh_group(self, qid: int) -> dict[str, Any]:
        c = self._draw(self.fresh_cum)
        return {"question_id": qid, "rollouts": [self.rollout(i < c) for i in range(self.k)]}

    def replay_group(self, qid: int, trajectory_id: int | None) -> dict[str, Any]:
        j = self._draw(self.replay_cum)
        rollouts = [self.rollout(True, replayed=True)] + [self.rollout(i < j) for i in range(self.k - 1)]
        g: dict[str, Any] = {"question_id": qid, "rollouts": rollouts}
        if trajectory_id is not None:
            g["replay_trajectory_id"] = trajectory_id
        return g

    @staticmethod
    def encode(body: dict[str, Any], encoding: str) -> bytes:
        """A commit or ingest body as JSON (payloads as base64) or as a binary frame."""
        payloads = [slot.pop("_payload", None) for slot in frames.slots(body)]
        if encoding == "binary":
            return frames.encode(body, payloads)
        for slot, p in zip(frames.slots(body), payloads, strict=True):
            if p is not None:
                slot["token_ids_b64"] = schemas.encode_b64(p[0].tobytes())
                slot["logprobs_b64"] = schemas.encode_b64(p[1].tobytes())
        # compact, by pydantic-core's writer: the stdlib's took 20 ms for a commit's 4.7 MB
        return pydantic_core.to_json(body)

    def commit_body(self, plan: dict[str, Any], encoding: str = "json", *, with_stats: bool = False) -> bytes:
        groups = [self.fresh_group(f["question_id"]) for f in plan["fresh"]]
        for r in plan["replay"]:
            cands = r["candidates"]
            best = (
                min(cands, key=lambda c: c["entropy"] if c["entropy"] is not None else 0.0) if cands else None
            )
            groups.append(self.replay_group(r["question_id"], best["id"] if best else None))
        body: dict[str, Any] = {"groups": groups, "metrics": {"train/loss": 0.1}}
        if with_stats:
            body["with_stats"] = True
        return self.encode(body, encoding)

    def ingest_body(self, qids: list[int], encoding: str = "json") -> bytes:
        groups = [self.fresh_group(q) for q in qids]
        return self.encode({"groups": groups, "policy_version": 1}, encoding)


# ------------------------------------------------------------------------------ measurement
@dataclass
class Options:
    iterations: int
    warmup: int
    select_iterations: int
    ingest_requests: int
    #: floor mode: the polled reads measured per size, each kind (`--read-iterations`)
    read_iterations: int
    ingest_groups: int
    ingest_concurrency: int
    epoch_starts: int
    candidates: str
    idempotency_keys: bool
    profile: bool
    pg_dsn: str
    redis_url: str
    encodings: list[str] = field(default_factory=lambda: ["json", "binary"])
    unrelated_keys: int = 100_000
    #: floor mode: ingest throughput rounds (requests per side and encoding; 0 skips them)
    throughput_requests: int = 0
    throughput_groups: int = 256
    mix_s: float = 0.0
    mix_only: bool = False
    #: with --floor --mix-only: the floor's mix before the service's
    floor_first: bool = False
    floor: bool = False
    #: with --floor: the floor on both sides (`--floor-twice`), what the ratios read for equal code
    floor_twice: bool = False
    #: read each copy once before measuring (into the OS's page cache)
    warm: bool = False


@dataclass
class Combo:
    backend: str
    size: int
    result: dict[str, Any] = field(default_factory=dict)


async def plan_commit(
    api: Api, trainer: Trainer, prefix: str, opts: Options, encoding: str = "json"
) -> tuple[Sample, Sample, dict[str, Any], dict[str, Any]]:
    idem = (lambda: {"Idempotency-Key": uuid.uuid4().hex}) if opts.idempotency_keys else dict
    body = json.dumps({"candidates": opts.candidates}).encode()
    path = f"{prefix}/runs/{_seed.RUN_NAME}/batches"
    r, plan_s = await timed_post(api, path, body, {**idem(), **wire_headers(encoding)})
    plan = answer(r)
    commit_body = trainer.commit_body(plan, encoding)
    headers = {**idem(), **wire_headers(encoding, frame_body=True)}
    r, commit_s = await timed_post(api, f"{prefix}/batches/{plan['id']}/commit", commit_body, headers)
    return plan_s, commit_s, plan, r.json()


def by_encoding(res: dict[str, Any], what: str, samples: dict[str, list[Sample]], **extra: Any) -> None:
    """Store each encoding's summary under res['encodings'][enc][what], and the last encoding's
    (binary when both ran) as res[what], the number the main tables show."""
    for enc, smp in samples.items():
        res.setdefault("encodings", {}).setdefault(enc, {})[what] = {**summarize(smp), **extra}
    res[what] = res["encodings"][list(samples)[-1]][what]


async def run_workload(server: Server, opts: Options, combo: Combo) -> None:
    res = combo.result
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    trainer = Trainer(seed=combo.size)
    memory: dict[str, dict[str, float]] = {"after_start": server.memory()}
    async with bench_client(server.url) as client:
        api = Api(client, server.proc.pid)
        if opts.mix_only:
            res["mix"] = await _mix(api, trainer, prefix, opts, combo.size)
            # the service's memory after 50 clients (a SQLite connection, and its page cache, each)
            res["mix"]["memory_mb"] = {**memory, "end": server.memory()}
            log(f"  service RSS after the mix: {res['mix']['memory_mb']['end']} MB")
            return
        # replay-only selection, on the seeded state (same shape at every pool size): with the
        # stored trajectories (the payload dominates), and ids only (the sampling path alone)
        # each request in every encoding, interleaved, so encodings are compared under one load
        encs = opts.encodings
        for key, mode in (("select", opts.candidates), ("select_ids", "none")):
            sel: dict[str, list[Sample]] = {e: [] for e in encs}
            for i in range(opts.warmup + opts.select_iterations):
                for enc in in_turn(encs, i):
                    body = json.dumps({"n": 64, "seed": 1000 + i, "candidates": mode}).encode()
                    path = f"{prefix}/runs/{_seed.RUN_NAME}/select"
                    _, smp = await timed_post(api, path, body, wire_headers(enc))
                    if i >= opts.warmup:
                        sel[enc].append(smp)
            by_encoding(res, key, sel, candidates=mode)
        memory["after_select"] = server.memory()

        # plan + commit (the first plan after start also loads the run's epoch order)
        first: dict[str, float] = {}
        for i in range(opts.warmup):
            p, c, _, _ = await plan_commit(api, trainer, prefix, opts, encs[i % len(encs)])
            if i == 0:
                first = {"plan_ms": round(p.ms, 2), "commit_ms": round(c.ms, 2)}
        res["first_after_start"] = first

        plans: dict[str, list[Sample]] = {e: [] for e in encs}
        commits: dict[str, list[Sample]] = {e: [] for e in encs}
        replays, stored, retired, eligible = [], [], [], []
        rss_trace: list[float] = []
        t0 = time.perf_counter()
        for i in range(opts.iterations * len(encs)):
            enc = encs[i % len(encs)]
            p, c, plan, result = await plan_commit(api, trainer, prefix, opts, enc)
            plans[enc].append(p)
            commits[enc].append(c)
            replays.append(len(plan["replay"]))
            eligible.append(plan["num_eligible"])
            stored.append(result["stored_trajectories"])
            retired.append(result["retired"])
            if (i + 1) % 10 == 0:
                rss_trace.append(server.memory()["rss"])
            if (i + 1) % 20 == 0:
                log(f"    {combo.backend} {combo.size}: {i + 1}/{opts.iterations} plan+commit")
        by_encoding(res, "plan", plans)
        by_encoding(res, "commit", commits)
        res["steps"] = {
            "iterations": opts.iterations,
            "seconds": round(time.perf_counter() - t0, 1),
            "replayed_per_plan_mean": round(float(np.mean(replays)), 1),
            "eligible_at_plan_mean": round(float(np.mean(eligible)), 1),
            "stored_per_commit_mean": round(float(np.mean(stored)), 1),
            "retired_per_commit_mean": round(float(np.mean(retired)), 1),
            "rss_mb_every_10_steps": rss_trace,
        }
        memory["after_plan_commit"] = server.memory()

        if opts.profile and server.profile_path is not None:
            server.proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.2)
            for _ in range(10):
                await plan_commit(api, trainer, prefix, opts, encs[-1])
            server.proc.send_signal(signal.SIGUSR2)
            await asyncio.sleep(1.0)
            res["profile"] = str(server.profile_path)

        # ingest throughput, one round per encoding: all bodies are built before the clock starts
        rng = np.random.default_rng([combo.size, 9])
        for enc in encs:
            bodies = [
                trainer.ingest_body(
                    [int(q) + 1 for q in rng.choice(combo.size, size=opts.ingest_groups, replace=False)],
                    enc,
                )
                for _ in range(opts.ingest_requests)
            ]
            res.setdefault("encodings", {}).setdefault(enc, {})["ingest"] = await _ingest(
                api, prefix, opts, bodies, wire_headers(enc, frame_body=True)
            )
            res["ingest"] = res["encodings"][enc]["ingest"]
        memory["after_ingest"] = server.memory()

        if opts.unrelated_keys and server.redis_url is not None:
            res["unrelated_keys"] = await _unrelated_keys(api, trainer, prefix, opts, server)

        # epoch start: the first plan of a brand-new run shuffles every active question of the pool
        starts: list[Sample] = []
        for i in range(opts.epoch_starts):
            name = f"cold-{i}-{uuid.uuid4().hex[:6]}"
            body = json.dumps({"name": name, "seed": 7 + i}).encode()
            await timed_post(api, f"{prefix}/runs", body)
            _, smp = await timed_post(api, f"{prefix}/runs/{name}/batches", json.dumps({}).encode())
            starts.append(smp)
        res["epoch_start_plan"] = summarize(starts)
        if opts.mix_s > 0:
            res["mix"] = await _mix(api, trainer, prefix, opts, combo.size)
        memory["end"] = server.memory()
    res["memory_mb"] = memory
    res["rss_end_mb"] = memory["end"]["rss"]
    res["rss_peak_mb"] = max(m["peak"] for m in memory.values())


#: the polled reads of `against_floor`: a run's stats, the pool's stats and a page of questions
FLOOR_READS = {
    "run_stats": "{prefix}/runs/{run}/stats",
    "pool_stats": "{prefix}/stats",
    "questions": "{prefix}/questions?limit=50",
}


async def against_floor(server: Server, floor: Server, opts: Options, combo: Combo) -> None:
    """The service and the floor (``_floor.py``: the same work on a copy of the same database)
    side by side, request by request: service, floor, service, floor... in every encoding, so
    both see the same load. Each has its own trainer of the same seed, so the bodies match in
    size and mix; the plans match too while both pick the same replays from the same index."""
    res = combo.result
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    encs = opts.encodings
    sides = ("service", "floor")
    samples: dict[str, dict[str, dict[str, list[Sample]]]] = {
        side: {e: {w: [] for w in ("plan", "commit", "select", "select_ids", "ingest")} for e in encs}
        for side in sides
    }
    async with (
        bench_client(server.url) as c1,
        bench_client(floor.url) as c2,
    ):
        apis = {"service": Api(c1, server.proc.pid), "floor": Api(c2, floor.proc.pid)}
        trainers = {side: Trainer(seed=combo.size) for side in sides}
        # what each side did, to show it is the same work: per plan the replays and candidates,
        # per commit the stored and retired, and how many plans picked the very same questions
        work: dict[str, dict[str, list[int]]] = {
            side: {"replayed": [], "candidates": [], "stored": [], "retired": []} for side in sides
        }
        same_plans = 0
        # the first selection of each kind is answered the same by both sides, byte for byte
        selected: dict[str, dict[str, bytes]] = {}
        for key, mode in (("select", opts.candidates), ("select_ids", "none")):
            for i in range(opts.warmup + opts.select_iterations):
                for enc in in_turn(encs, i):
                    body = json.dumps({"n": 64, "seed": 1000 + i, "candidates": mode}).encode()
                    for side in sides:
                        path = f"{prefix}/runs/{_seed.RUN_NAME}/select"
                        r, smp = await timed_post(apis[side], path, body, wire_headers(enc))
                        if i == 0:
                            selected.setdefault(f"{key} {enc}", {})[side] = r.content
                        if i >= opts.warmup:
                            samples[side][enc][key].append(smp)
        res["floor_selections_same"] = {what: a["service"] == a["floor"] for what, a in selected.items()}
        if not all(res["floor_selections_same"].values()):
            log(f"    WARNING: the service and the floor selected unlike: {res['floor_selections_same']}")
        for i in range(opts.warmup + opts.iterations):
            for enc in in_turn(encs, i):
                picked: list[list[int]] = []
                for side in sides:
                    p, c, plan, result = await plan_commit(apis[side], trainers[side], prefix, opts, enc)
                    picked.append(sorted(x["question_id"] for x in plan["fresh"] + plan["replay"]))
                    w = work[side]
                    w["replayed"].append(len(plan["replay"]))
                    w["candidates"].append(sum(len(x["candidates"]) for x in plan["replay"]))
                    w["stored"].append(result["stored_trajectories"])
                    w["retired"].append(result["retired"])
                    if i >= opts.warmup:
                        samples[side][enc]["plan"].append(p)
                        samples[side][enc]["commit"].append(c)
                same_plans += picked[0] == picked[1]
            if (i + 1) % 10 == 0:
                log(f"    {combo.backend} {combo.size}: {i + 1}/{opts.warmup + opts.iterations} rounds")
        # ingest: the very same body to both, one request at a time (latency, not throughput)
        rng = np.random.default_rng([combo.size, 9])
        for i in range(opts.warmup + opts.ingest_requests):
            qids = [int(q) + 1 for q in rng.choice(combo.size, size=opts.ingest_groups, replace=False)]
            for enc in in_turn(encs, i):
                body = trainers["service"].ingest_body(qids, enc)
                for side in sides:
                    path = f"{prefix}/runs/{_seed.RUN_NAME}/ingest"
                    r, smp = await timed_post(apis[side], path, body, wire_headers(enc, frame_body=True))
                    w = work[side]
                    w.setdefault("ingest_stored", []).append(r.json()["stored_trajectories"])
                    if i >= opts.warmup:
                        samples[side][enc]["ingest"].append(smp)
        # the reads dashboards and the mix's readers poll (JSON answers whatever the encoding:
        # listed under the last one), each to the service and then to the floor
        answers: dict[str, dict[str, bytes]] = {}
        for i in range(opts.warmup + opts.read_iterations):
            for what, path in FLOOR_READS.items():
                for side in sides:
                    r, smp = await timed_get(apis[side], path.format(prefix=prefix, run=_seed.RUN_NAME))
                    answers.setdefault(what, {})[side] = r.content
                    if i >= opts.warmup:
                        samples[side][encs[-1]].setdefault(what, []).append(smp)
        # after the same plans, commits and ingests both sides answer the same values (the same
        # bytes but for the Postgres page's prompts and metadata: JSONB's text on the service's side)
        res["floor_reads_same"] = {
            what: json.loads(a["service"]) == json.loads(a["floor"]) for what, a in answers.items()
        }
        if not all(res["floor_reads_same"].values()):
            log(f"    WARNING: the service and the floor answered reads unlike: {res['floor_reads_same']}")
        if opts.throughput_requests:
            tp = await _floor_throughput(apis, trainers["service"], prefix, opts, combo.size, encs)
            res["floor_ingest"] = tp
    out: dict[str, Any] = {}
    for enc in encs:
        for what in samples["service"][enc]:
            a, b = summarize(samples["service"][enc][what]), summarize(samples["floor"][enc][what])
            out.setdefault(enc, {})[what] = {
                "service": a,
                "floor": b,
                "ratio_p50": round(a["p50_ms"] / b["p50_ms"], 2),
                "ratio_p50_ci90": p50_ratio_interval(a["samples_ms"], b["samples_ms"]),
                "ratio_p99": round(a["p99_ms"] / b["p99_ms"], 2),
                "ratio_cpu": round(a["server_cpu_mean_ms"] / b["server_cpu_mean_ms"], 2),
            }
    res["floor"] = out
    res["floor_work"] = {
        "plans": len(work["service"]["replayed"]),
        "same_questions_planned": same_plans,
        **{f"{side}_{k}_mean": round(float(np.mean(v)), 1) for side in sides for k, v in work[side].items()},
    }
    log(f"    work: {res['floor_work']}")
    differ = [
        k
        for k, v in work["service"].items()
        if k in work["floor"] and not np.isclose(np.mean(v), np.mean(work["floor"][k]))
    ]
    if differ:
        log(f"    WARNING: the service and the floor did different work ({', '.join(differ)}): unlike ratios")


async def _floor_throughput(
    apis: dict[str, Api], trainer: Trainer, prefix: str, opts: Options, size: int, encs: list[str]
) -> dict[str, Any]:
    """Ingest throughput of the service and of the floor: the very same bodies (built before the
    clock starts) from `ingest_concurrency` producers, one side at a time, the side that goes first
    alternating per encoding and round (two rounds each)."""
    out: dict[str, Any] = {}
    for n, enc in enumerate(encs):
        headers = wire_headers(enc, frame_body=True)
        for rnd in range(2):
            rng = np.random.default_rng([size, 11, n, rnd])
            picks = [
                [int(q) + 1 for q in rng.choice(size, size=opts.throughput_groups, replace=False)]
                for _ in range(opts.throughput_requests)
            ]
            bodies = [trainer.ingest_body(q, enc) for q in picks]
            order = in_turn(("service", "floor"), n + rnd)
            for side in order:
                r = await _ingest(apis[side], prefix, opts, bodies, headers, opts.throughput_groups)
                out.setdefault(enc, {}).setdefault(side, []).append(r)
                log(f"    ingest throughput {enc} {side}: {r['trajectories_per_s']:.0f} traj/s")
    return out


def floor_throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: ingest throughput of the service and the floor (best of the rounds)."""
    out = [
        "| backend | questions | encoding | groups per request | producers | service traj/s | floor traj/s "
        "| service/floor | service p50 ms | floor p50 ms | service CPU ms | floor CPU ms | CPU ratio "
        "| service ingests per transaction |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for enc, sides in r.get("floor_ingest", {}).items():
            a = max(sides["service"], key=lambda x: x["trajectories_per_s"])
            b = max(sides["floor"], key=lambda x: x["trajectories_per_s"])
            out.append(
                f"| {r['backend']} | {r['questions']:,} | {enc} | {a['groups_per_request']} "
                f"| {a['concurrency']} "
                f"| {a['trajectories_per_s']:,.0f} | {b['trajectories_per_s']:,.0f} "
                f"| {a['trajectories_per_s'] / b['trajectories_per_s']:.2f} | {_f(a['p50_ms'])} "
                f"| {_f(b['p50_ms'])} | {_round_cpu(a)} | {_round_cpu(b)} | {_cpu_ratio(a, b)} "
                f"| {a.get('ingests_per_transaction') or '-'} |"
            )
    return out


def _round_cpu(x: dict[str, Any]) -> str:
    """The server's CPU per request over a whole throughput round (results from before this
    column: not measured)."""
    v = x.get("round_cpu_ms_per_request")
    return "-" if v is None else _f(v)


def _cpu_ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    x, y = a.get("round_cpu_ms_per_request"), b.get("round_cpu_ms_per_request")
    return "-" if not x or not y else f"{x / y:.2f}"


def in_turn(items: Sequence[T], i: int) -> list[T]:
    """`items` in the order the `i`-th round sends them: each goes first in turn. Two encodings of
    the same request read the same rows; the one sent first finds them outside the database's own
    cache, the next inside it (a selection's stored trajectories at 1M: statements of 16-48 ms
    in JSON, sent first, against 4.7-11 ms in frames right after), so a fixed order made one
    encoding's latencies look slower than the other's."""
    k = i % len(items) if items else 0
    return [*items[k:], *items[:k]]


def p50_ratio_interval(
    service_ms: list[float], floor_ms: list[float], *, level: float = 0.9, resamples: int = 4000
) -> list[float] | None:
    """A bootstrap interval (`level`, percentile method) of the ratio of the two sides' median
    latencies: each side's requests drawn again with replacement, on their own, `resamples`
    times, with a fixed seed (the same samples give the same interval). What one cell's ratio
    could have read in the same minutes with other requests; the hour's drift between runs is not
    in it (the floor against itself, `--floor-twice`, shows that). None for fewer than 5 a side."""
    if min(len(service_ms), len(floor_ms)) < 5:
        return None
    rng = np.random.default_rng(0)
    a, b = np.asarray(service_ms, float), np.asarray(floor_ms, float)
    ma = np.median(a[rng.integers(0, len(a), (resamples, len(a)))], axis=1)
    mb = np.median(b[rng.integers(0, len(b), (resamples, len(b)))], axis=1)
    lo, hi = np.percentile(ma / mb, [50 * (1 - level), 50 * (1 + level)])
    return [round(float(lo), 2), round(float(hi), 2)]


def _interval(x: dict[str, Any]) -> str:
    ci = x.get("ratio_p50_ci90")  # (a file written before the interval was kept has none)
    return f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else ""


def floor_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: service against the floor, per backend, size, encoding and request type."""
    out = [
        "| backend | questions | encoding | request | service p50 | service p99 | floor p50 | floor p99 "
        "| p50 ratio | 90% interval | p99 ratio | service CPU | floor CPU | CPU ratio |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for enc, whats in r.get("floor", {}).items():
            for what, x in whats.items():
                a, b = x["service"], x["floor"]
                out.append(
                    f"| {r['backend']} | {r['questions']:,} | {enc} | {what} | {_f(a['p50_ms'])} "
                    f"| {_f(a['p99_ms'])} | {_f(b['p50_ms'])} | {_f(b['p99_ms'])} | {x['ratio_p50']:.2f} "
                    f"| {_interval(x)} | {x['ratio_p99']:.2f} | {_f(a['server_cpu_mean_ms'])} "
                    f"| {_f(b['server_cpu_mean_ms'])} | {x['ratio_cpu']:.2f} |"
                )
    return out


MIX_TRAINERS, MIX_INGESTERS, MIX_READERS = 20, 4, 26


async def _mix(api: Api, trainer: Trainer, prefix: str, opts: Options, size: int) -> dict[str, Any]:
    """50 concurrent clients for `opts.mix_s` seconds: 20 trainers (a run each, plan + commit),
    4 producers ingesting into r1 and 26 readers (run and pool stats, a small selection, a page of
    questions), all in the last encoding. Throughput and p50/p99 per request type."""
    enc = opts.encodings[-1]
    rng = np.random.default_rng([size, 50])
    runs = [f"mix-{i}-{uuid.uuid4().hex[:4]}" for i in range(MIX_TRAINERS)]
    for i, name in enumerate(runs):
        await timed_post(
            api, f"{prefix}/runs", json.dumps({"name": name, "seed": 100 + i, "phase": "mixed"}).encode()
        )
    ingest_bodies = [
        trainer.ingest_body([int(q) + 1 for q in rng.choice(size, opts.ingest_groups, replace=False)], enc)
        for _ in range(MIX_INGESTERS * 2)
    ]
    samples: dict[str, list[Sample]] = {}
    errors: dict[str, int] = {}
    deadline = time.perf_counter() + opts.mix_s

    async def call(kind: str, coro: Any) -> Any:
        try:
            r, smp = await coro
        except RuntimeError:
            errors[kind] = errors.get(kind, 0) + 1
            return None
        if time.perf_counter() <= deadline:
            samples.setdefault(kind, []).append(smp)
        return r

    async def get(path: str) -> tuple[httpx.Response, Sample]:
        t0 = time.perf_counter()
        r = await api.client.get(path)
        if r.status_code >= 300:
            raise RuntimeError(f"GET {path} -> {r.status_code}")
        return r, Sample(ms=(time.perf_counter() - t0) * 1000, bytes_in=len(r.content))

    async def train(run: str) -> None:
        local = Trainer(seed=hash(run) % 2**31)
        while time.perf_counter() < deadline:
            body = json.dumps({"candidates": opts.candidates}).encode()
            path = f"{prefix}/runs/{run}/batches"
            r = await call("plan", timed_post(api, path, body, wire_headers(enc)))
            if r is None:
                continue
            plan = answer(r)
            commit = local.commit_body(plan, enc)
            cpath = f"{prefix}/batches/{plan['id']}/commit"
            await call("commit", timed_post(api, cpath, commit, wire_headers(enc, frame_body=True)))

    async def ingest(n: int) -> None:
        i = n
        while time.perf_counter() < deadline:
            body = ingest_bodies[i % len(ingest_bodies)]
            path = f"{prefix}/runs/{_seed.RUN_NAME}/ingest"
            await call("ingest", timed_post(api, path, body, wire_headers(enc, frame_body=True)))
            i += MIX_INGESTERS

    async def read(n: int) -> None:
        i = n
        while time.perf_counter() < deadline:
            choice = i % 4
            if choice == 0:
                await call("run stats", get(f"{prefix}/runs/{_seed.RUN_NAME}/stats"))
            elif choice == 1:
                body = json.dumps({"n": 4, "seed": i}).encode()
                path = f"{prefix}/runs/{_seed.RUN_NAME}/select"
                await call("select n=4", timed_post(api, path, body, wire_headers(enc)))
            elif choice == 2:
                await call("questions", get(f"{prefix}/questions?limit=50"))
            else:
                await call("pool stats", get(f"{prefix}/stats"))
            i += 1

    t0, cpu0, own0 = time.perf_counter(), cpu_ms(api.pid), time.process_time()
    await asyncio.gather(
        *(train(r) for r in runs),
        *(ingest(n) for n in range(MIX_INGESTERS)),
        *(read(n) for n in range(MIX_READERS)),
    )
    wall = time.perf_counter() - t0
    cpu_s = (cpu_ms(api.pid) - cpu0) / 1000
    client_s = time.process_time() - own0
    out: dict[str, Any] = {
        "clients": {"trainers": MIX_TRAINERS, "ingesters": MIX_INGESTERS, "readers": MIX_READERS},
        # the server process's CPU over the mix (every thread; a parent of several service
        # processes counts only itself), and the CPUs it kept busy on average
        "server_cpu_s": round(cpu_s, 1),
        "server_cpus": round(cpu_s / wall, 2),
        # the 50 clients' own CPU (this process: building bodies, HTTP), on the same machine
        "client_cpu_s": round(client_s, 1),
        "client_cpus": round(client_s / wall, 2),
        "seconds": round(opts.mix_s, 1),
        "wall_s": round(wall, 1),
        "encoding": enc,
        "requests": sum(len(v) for v in samples.values()),
        "requests_per_s": round(sum(len(v) for v in samples.values()) / opts.mix_s, 2),
        # the trainers' work: a step is a plan and its commit (reads are cheap, and many of them
        # can hide writers that starve)
        "steps_per_s": round(len(samples.get("commit", [])) / opts.mix_s, 2),
        "errors": errors,
        "by_type": {},
    }
    for kind, smp in sorted(samples.items()):
        ms = np.array([x.ms for x in smp])
        out["by_type"][kind] = {
            "n": len(smp),
            "per_s": round(len(smp) / opts.mix_s, 2),
            "p50_ms": round(float(np.percentile(ms, 50)), 1),
            "p99_ms": round(float(np.percentile(ms, 99)), 1),
        }
    return out


def len_commits(m: dict[str, Any]) -> int:
    """Commits completed in a mix (its training steps)."""
    return int(m["by_type"].get("commit", {}).get("n", 0))


def mix_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| backend | questions | request | completed | per s | p50 ms | p99 ms |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r.get("mix")
        if not m:
            continue
        for kind, x in m["by_type"].items():
            out.append(
                f"| {r['backend']} | {r['questions']:,} | {kind} | {x['n']} | {x['per_s']:.2f} "
                f"| {_f(x['p50_ms'])} | {_f(x['p99_ms'])} |"
            )
        out.append(
            f"| {r['backend']} | {r['questions']:,} | **all** | {m['requests']} | {m['requests_per_s']:.2f} "
            f"| | |"
        )
        out.append(
            f"| {r['backend']} | {r['questions']:,} | **training steps** | {len_commits(m)} "
            f"| {m['by_type'].get('commit', {}).get('per_s', 0.0):.2f} | | |"
        )
        if "server_cpus" in m:
            cpus = m["server_cpus"]
            out.append(f"| {r['backend']} | {r['questions']:,} | **server CPUs** | | {cpus:.2f} | | |")
        if "client_cpus" in m:
            cpus = m["client_cpus"]
            out.append(f"| {r['backend']} | {r['questions']:,} | **client CPUs** | | {cpus:.2f} | | |")
    return out


MIX_READS = ("run stats", "select n=4", "questions", "pool stats")


async def mix_against_floor(server: Server, floor: Server, opts: Options, combo: Combo) -> None:
    """The 50-client mix against the service and against the floor (the same requests on its own
    fresh copy), one side at a time while the other idles: the service first, or the floor with
    `opts.floor_first` (a second run in the other order evens out what the hour does). A mix
    leaves its copy grown (20 more runs, their states and trajectories), so each side runs once."""
    prefix = f"/v1/pools/{_seed.POOL_NAME}"
    sides: dict[str, dict[str, Any]] = {}
    async with (
        bench_client(server.url) as c1,
        bench_client(floor.url) as c2,
    ):
        apis = {"service": Api(c1, server.proc.pid), "floor": Api(c2, floor.proc.pid)}
        for side in ("floor", "service") if opts.floor_first else ("service", "floor"):
            m = sides[side] = await _mix(apis[side], Trainer(seed=combo.size), prefix, opts, combo.size)
            log(
                f"    {combo.backend} {combo.size:,} mix, {side}: {m['requests_per_s']:.2f} requests/s, "
                f"{m['steps_per_s']:.2f} steps/s, {m['server_cpus']:.2f} CPUs "
                f"(clients {m['client_cpus']:.2f}), errors {m['errors'] or 0}"
            )
    combo.result["mix_floor"] = sides


def floor_mix_table(rows: list[dict[str, Any]]) -> list[str]:
    """The mix against the floor: each side's throughput and latency, and the service's requests
    and steps per second over the floor's."""
    out = [
        "| backend | questions | side | requests/s | steps/s | reads/s | ingests/s | server CPUs | plan p50 "
        "/ p99 ms | commit p50 / p99 ms | read p50 ms (run stats, select, questions, pool stats) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    ratios = []
    for r in rows:
        sides = r.get("mix_floor")
        if not sides:
            continue
        for side, m in sides.items():
            bt = m["by_type"]
            reads = sum(bt.get(k, {}).get("per_s", 0.0) for k in MIX_READS)

            def lat(kind: str, bt: dict[str, Any] = bt) -> str:
                x = bt.get(kind)
                return f"{_f(x['p50_ms'])} / {_f(x['p99_ms'])}" if x else "-"

            read_p50 = ", ".join(_f(bt[k]["p50_ms"]) if k in bt else "-" for k in MIX_READS)
            out.append(
                f"| {r['backend']} | {r['questions']:,} | {side} | {m['requests_per_s']:.2f} "
                f"| {m['steps_per_s']:.2f} | {reads:.2f} | {bt.get('ingest', {}).get('per_s', 0.0):.2f} "
                f"| {m['server_cpus']:.2f} | {lat('plan')} | {lat('commit')} | {read_p50} |"
            )
        svc, flo = sides["service"], sides["floor"]
        ratios.append(
            f"| {r['backend']} | {r['questions']:,} | {svc['requests_per_s'] / flo['requests_per_s']:.2f} "
            f"| {svc['steps_per_s'] / flo['steps_per_s']:.2f} |"
        )
    return [*out, "", "| backend | questions | service / floor, requests/s | service / floor, steps/s |",
            "|---|---:|---:|---:|", *ratios]  # fmt: skip


async def _ingest(
    api: Api,
    prefix: str,
    opts: Options,
    bodies: list[bytes],
    headers: dict[str, str],
    groups: int | None = None,
) -> dict[str, Any]:
    sem = asyncio.Semaphore(opts.ingest_concurrency)
    ing: list[Sample] = []
    stored_total = 0

    async def one(b: bytes) -> None:
        nonlocal stored_total
        async with sem:
            r, smp = await timed_post(api, f"{prefix}/runs/{_seed.RUN_NAME}/ingest", b, headers)
        ing.append(smp)
        stored_total += r.json()["stored_trajectories"]

    g0 = await _grouped_writes(api)
    t0, c0 = time.perf_counter(), cpu_ms(api.pid)
    await asyncio.gather(*(one(b) for b in bodies))
    wall, cpu = time.perf_counter() - t0, cpu_ms(api.pid) - c0
    g1 = await _grouped_writes(api)
    grouped = None
    if g0 is not None and g1 is not None and g1[0] > g0[0]:
        # ingests per transaction of those the service wrote in groups (Postgres)
        grouped = round((g1[1] - g0[1]) / (g1[0] - g0[0]), 2)
    return {
        "ingests_per_transaction": grouped,
        **summarize(ing),
        "requests": len(bodies),
        "groups_per_request": opts.ingest_groups if groups is None else groups,
        "concurrency": opts.ingest_concurrency,
        "stored_trajectories": stored_total,
        "seconds": round(wall, 2),
        "trajectories_per_s": round(stored_total / wall, 1),
        "payload_mb_per_s": round(sum(len(b) for b in bodies) / wall / 1e6, 1),
        # the server's CPU over the whole round per request (a request's own CPU column counts
        # every request that overlapped it when several producers send at once)
        "round_cpu_ms_per_request": round(cpu / len(bodies), 2),
    }


async def _grouped_writes(api: Api) -> tuple[float, float] | None:
    """The service's grouped transactions so far and the writes they held (`/metrics`; None from
    the floor, or a service without the metric)."""
    r = await api.client.get("/metrics")
    if r.status_code != 200:
        return None
    found = dict(re.findall(r"^exgrpo_db_grouped_writes_(count|sum) (\S+)$", r.text, re.M))
    if len(found) != 2:
        return None
    return float(found["count"]), float(found["sum"])


async def _unrelated_keys(
    api: Api, trainer: Trainer, prefix: str, opts: Options, server: Server
) -> dict[str, Any]:
    """Select and plan latency with 0 and with `opts.unrelated_keys` other keys in the Redis db
    (the service must not walk the db), in pairs: each round measures select ids, select and
    plan + commit without the keys, writes them, measures again and deletes them."""
    import redis

    enc = opts.encodings[-1]
    rounds = max(opts.select_iterations // 2, 5)
    junk = f"{server.redis_prefix}:unrelated"
    keys = [f"{junk}:{j}" for j in range(opts.unrelated_keys)]
    samples: dict[bool, dict[str, list[Sample]]] = {
        flag: {"select_ids": [], "select": [], "plan": []} for flag in (False, True)
    }
    r = redis.Redis.from_url(server.redis_url or "")
    try:
        for i in range(rounds):
            for with_keys in (False, True):
                if with_keys:
                    pipe = r.pipeline(transaction=False)
                    for j in range(0, len(keys), 10_000):
                        pipe.mset(dict.fromkeys(keys[j : j + 10_000], "x"))
                    pipe.execute()
                out = samples[with_keys]
                for key, mode in (("select_ids", "none"), ("select", opts.candidates)):
                    body = json.dumps({"n": 64, "seed": 5000 + i, "candidates": mode}).encode()
                    path = f"{prefix}/runs/{_seed.RUN_NAME}/select"
                    out[key].append((await timed_post(api, path, body, wire_headers(enc)))[1])
                out["plan"].append((await plan_commit(api, trainer, prefix, opts, enc))[0])
            for j in range(0, len(keys), 10_000):
                r.delete(*keys[j : j + 10_000])
    finally:
        for j in range(0, len(keys), 10_000):
            r.delete(*keys[j : j + 10_000])
        r.close()
    out: dict[str, Any] = {"keys": opts.unrelated_keys, "rounds": rounds, "encoding": enc}
    for key in samples[False]:
        a, b = summarize(samples[False][key]), summarize(samples[True][key])
        out[key] = {
            "p50_ms_0_keys": a["p50_ms"],
            "p50_ms_with_keys": b["p50_ms"],
            "ratio_p50": round(b["p50_ms"] / a["p50_ms"], 3),
            "cpu_ms_0_keys": a["server_cpu_mean_ms"],
            "cpu_ms_with_keys": b["server_cpu_mean_ms"],
            "ratio_cpu": round(b["server_cpu_mean_ms"] / a["server_cpu_mean_ms"], 3),
            "redis_ms_0_keys": a["server_redis_p50_ms"],
            "redis_ms_with_keys": b["server_redis_p50_ms"],
            "redis_calls": b["server_redis_calls_p50"],
        }
    return out


async def measure(backend: str, size: int, opts: Options, fresh_seed: bool) -> Combo:
    combo = Combo(backend, size)
    shape = _seed.Shape(questions=size)
    res = combo.result
    res["shape"] = {**shape.describe(), **_seed.layout(shape).stats}
    tag = f"{backend}-{size}"
    log_path = OUT / "logs" / f"server-{tag}.log"
    profile_path = OUT / f"profile-{tag}.pstats" if opts.profile else None
    redis_prefix = f"exgrpo-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    work_db = f"exgrpo_bench_work_{os.getpid()}"
    work_file = OUT / "work" / f"sqlite-{size}.db"
    floor_file = OUT / "work" / f"sqlite-{size}-floor.db"
    floor_db = f"{work_db}_floor"
    floor_url = ""
    env: dict[str, str]
    server: Server | None = None
    floor: Server | None = None
    try:
        if backend == "sqlite":
            seed_file = CACHE / f"sqlite-{size}.db"
            if fresh_seed or not _seed.sqlite_cache_ok(shape, seed_file):
                log(f"  seeding sqlite {size} (not cached)")
                res["seed_s"] = round(await asyncio.to_thread(_seed.seed_sqlite, shape, seed_file, log), 1)
            else:
                res["seed_s"] = "cached"
            res["db_bytes"] = seed_file.stat().st_size
            res["copy_s"] = round(_seed.copy_sqlite(seed_file, work_file), 1)
            env = {"EXGRPO_DATABASE_URL": f"sqlite+aiosqlite:///{work_file}"}
            if SERVICE_WORKERS > 1:
                # several service processes share one index: the service refuses them without Redis
                env.update(EXGRPO_REDIS_URL=opts.redis_url, EXGRPO_REDIS_PREFIX=redis_prefix)
            if opts.floor:
                _seed.copy_sqlite(seed_file, floor_file)
                floor_url = str(floor_file)
            # the seeded template, once copied, leaves the page cache to the copies measured
            res["seed_uncached"] = _seed.uncache_file(seed_file)
        else:
            seed_db = f"exgrpo_bench_seed_{size}"
            if fresh_seed or not await _seed.pg_cache_ok(shape, opts.pg_dsn, seed_db):
                log(f"  seeding postgres {size} (not cached)")
                res["seed_s"] = round(await _seed.seed_postgres(shape, opts.pg_dsn, seed_db, log), 1)
            else:
                res["seed_s"] = "cached"
            res["copy_s"] = round(await _seed.copy_postgres(opts.pg_dsn, seed_db, work_db), 1)
            res["db_bytes"] = await _pg_size(opts.pg_dsn, work_db)
            if opts.floor:
                await _seed.copy_postgres(opts.pg_dsn, seed_db, floor_db)
                floor_url = _seed.pg_url(opts.pg_dsn, floor_db)
            res["seed_uncached"] = await _seed.uncache_postgres(opts.pg_dsn, seed_db) > 0
            env = {
                "EXGRPO_DATABASE_URL": _seed.pg_url(opts.pg_dsn, work_db, driver=True),
                "EXGRPO_REDIS_URL": opts.redis_url,
                "EXGRPO_REDIS_PREFIX": redis_prefix,
            }
        if opts.warm:
            # both sides' copies read once, each in turn, before either is measured: a copy left
            # on disk by the page cache reads slower than one in it, whichever side it is
            if backend == "sqlite":
                warmed = [_seed.warm_sqlite(f) for f in (work_file, *([floor_file] if opts.floor else []))]
            else:
                dbs = (work_db, *([floor_db] if opts.floor else []))
                warmed = [await _seed.warm_postgres(opts.pg_dsn, d) for d in dbs]
            res["warm_s"] = [round(w, 1) for w in warmed]
            log(f"  {tag}: copies read once in {', '.join(f'{w:.1f}' for w in warmed)} s")
        if SERVICE_SRC is not None:
            head = await downgrade_to(env["EXGRPO_DATABASE_URL"], SERVICE_SRC)
            log(f"  {tag}: schema down to {head} for the service of {SERVICE_SRC}")
            res["service_src_schema"] = head
        if opts.floor_twice:
            # the service's side runs the floor too, on the service's copy: ratios of equal code
            log(f"  {tag}: starting the floor on the service's side")
            own = str(work_file) if backend == "sqlite" else _seed.pg_url(opts.pg_dsn, work_db)
            server = await asyncio.to_thread(start_server, {"FLOOR_DATABASE": own}, log_path, None, FLOOR)
            res["floor_twice"] = True
        else:
            log(f"  {tag}: starting service")
            server = await asyncio.to_thread(start_server, env, log_path, profile_path)
        if "EXGRPO_REDIS_URL" in env and not opts.floor_twice:
            server.redis_url, server.redis_prefix = opts.redis_url, redis_prefix
        res["startup_s"] = round(server.startup_s, 2)
        log(f"  {tag}: ready in {server.startup_s:.1f}s, measuring")
        res["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
        if opts.floor:
            floor_log = OUT / "logs" / f"floor-{tag}.log"
            floor = await asyncio.to_thread(
                start_server, {"FLOOR_DATABASE": floor_url}, floor_log, None, FLOOR
            )
            if opts.mix_only:
                await mix_against_floor(server, floor, opts, combo)
            else:
                await against_floor(server, floor, opts, combo)
        else:
            await run_workload(server, opts, combo)
        res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        if server is not None:
            server.stop()
        if floor is not None:
            floor.stop()
        if backend == "sqlite":
            for f in (work_file, floor_file):
                for p in (f, Path(f"{f}-wal"), Path(f"{f}-shm")):
                    p.unlink(missing_ok=True)
            if SERVICE_WORKERS > 1:
                _redis_cleanup(opts.redis_url, redis_prefix)
        else:
            with contextlib.suppress(Exception):
                await _seed.pg_admin(opts.pg_dsn, f"DROP DATABASE IF EXISTS {work_db} WITH (FORCE)")
                if opts.floor:
                    await _seed.pg_admin(opts.pg_dsn, f"DROP DATABASE IF EXISTS {floor_db} WITH (FORCE)")
            _redis_cleanup(opts.redis_url, redis_prefix)
    if opts.profile and profile_path is not None and profile_path.exists():
        _profile_report(profile_path, OUT / f"profile-{tag}.txt")
    return combo


async def _pg_size(dsn: str, database: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(_seed.pg_url(dsn, "postgres"))
    try:
        return int(await conn.fetchval("SELECT pg_database_size($1)", database))
    finally:
        await conn.close()


def _redis_cleanup(url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 1000):
            r.delete(*keys[i : i + 1000])
    finally:
        r.close()


def _profile_report(stats_path: Path, out: Path) -> None:
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(str(stats_path), stream=buf)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    out.write_text(buf.getvalue())


# ----------------------------------------------------------------------------------- report
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return str(v)


def goals(combos: list[Combo]) -> list[dict[str, Any]]:
    out = []
    for backend in sorted({c.backend for c in combos}):
        mine = sorted((c for c in combos if c.backend == backend), key=lambda c: c.size)
        big, small = mine[-1], mine[0]
        for what in ("plan", "commit"):
            p99 = big.result[what]["p99_ms"]
            out.append(
                {
                    "backend": backend,
                    "goal": f"{what} p99 < {GOAL_MS:.0f} ms at {big.size:,} questions",
                    "value": f"{p99:.1f} ms",
                    "met": p99 < GOAL_MS,
                }
            )
        if big.size != small.size:
            for sel, q in [(a, b) for a in ("select", "select_ids") for b in ("p50_ms", "p99_ms")]:
                ratio = big.result[sel][q] / small.result[sel][q]
                out.append(
                    {
                        "backend": backend,
                        "goal": f"{sel} {q[:3]} growth {small.size:,} -> {big.size:,} "
                        f"< {GOAL_SELECT_GROWTH:.0f}x",
                        "value": f"{ratio:.2f}x",
                        "met": ratio < GOAL_SELECT_GROWTH,
                    }
                )
    return out


def print_table(combos: list[Combo], goal_rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="experience-pool service (latencies in ms, client side over HTTP)")
    cols = [
        "backend", "questions", "eligible", "traj", "plan p50", "plan p99", "commit p50", "commit p99",
        "select p50", "select p99", "ids p50", "ids p99", "ingest traj/s", "RSS MB", "peak MB",
        "epoch start", "startup s",
    ]  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "backend" else "right")
    for c in combos:
        r = c.result
        t.add_row(
            c.backend,
            f"{c.size:,}",
            f"{r['shape']['eligible']:,}",
            f"{r['shape']['trajectories']:,}",
            _fmt(r["plan"]["p50_ms"]),
            _fmt(r["plan"]["p99_ms"]),
            _fmt(r["commit"]["p50_ms"]),
            _fmt(r["commit"]["p99_ms"]),
            _fmt(r["select"]["p50_ms"]),
            _fmt(r["select"]["p99_ms"]),
            _fmt(r["select_ids"]["p50_ms"]),
            _fmt(r["select_ids"]["p99_ms"]),
            _fmt(r["ingest"]["trajectories_per_s"]),
            _fmt(r["rss_end_mb"]),
            _fmt(r["rss_peak_mb"]),
            _fmt(r["epoch_start_plan"]["p50_ms"]),
            _fmt(r["startup_s"]),
        )
    b = Table(
        title="where the time goes: p50 ms (client = HTTP round trip, cpu = mean CPU ms of the service "
        "process per request, app = time inside the service)"
    )
    for c in [
        "backend",
        "questions",
        "what",
        "client",
        "cpu",
        "app",
        "sql",
        "sql stmts",
        "redis",
        "req KB",
        "resp KB",
    ]:
        b.add_column(c, justify="left" if c in ("backend", "what") else "right")
    for c in combos:
        for what in ("plan", "commit", "select", "select_ids", "ingest"):
            x = c.result[what]
            b.add_row(
                c.backend,
                f"{c.size:,}",
                what,
                _fmt(x["p50_ms"]),
                _fmt(x["server_cpu_mean_ms"]),
                _fmt(x["server_app_p50_ms"]),
                _fmt(x["server_sql_p50_ms"]),
                _fmt(x["server_sql_statements_p50"]),
                _fmt(x["server_redis_p50_ms"]),
                _fmt((x["request_bytes_p50"] or 0) / 1024),
                _fmt((x["response_bytes_p50"] or 0) / 1024),
            )
    g = Table(title="goals")
    for col in ("backend", "goal", "value", "met"):
        g.add_column(col)
    for row in goal_rows:
        g.add_row(row["backend"], row["goal"], row["value"], "yes" if row["met"] else "NO")
    console = Console(width=200)
    console.print(t)
    console.print(b)
    console.print(g)


def _f(v: Any) -> str:
    return "-" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.2f}" if v < 10 else f"{v:.1f}")


def side_by_side(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown tables: each request in both encodings (measured interleaved in one run), and
    select/plan with and without unrelated Redis keys."""
    out = [
        "| backend | questions | request | json p50 | binary p50 | binary/json | json p99 | binary p99 "
        "| json CPU | binary CPU | CPU binary/json | json KB | binary KB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        encs = r.get("encodings", {})
        if not {"json", "binary"} <= set(encs):
            continue
        for what in ("plan", "commit", "select", "select_ids", "ingest"):
            a, b = encs["json"].get(what), encs["binary"].get(what)
            if not a or not b or not a.get("n"):
                continue
            size = "response_bytes_p50" if what in ("plan", "select", "select_ids") else "request_bytes_p50"
            if what == "ingest":
                ratio = a["trajectories_per_s"] / b["trajectories_per_s"]
            else:
                ratio = b["p50_ms"] / a["p50_ms"]
            out.append(
                f"| {r['backend']} | {r['questions']:,} | {what} | {_f(a['p50_ms'])} | {_f(b['p50_ms'])} "
                f"| {ratio:.2f} | {_f(a['p99_ms'])} | {_f(b['p99_ms'])} | {_f(a['server_cpu_mean_ms'])} "
                f"| {_f(b['server_cpu_mean_ms'])} | {b['server_cpu_mean_ms'] / a['server_cpu_mean_ms']:.2f} "
                f"| {_f((a[size] or 0) / 1024)} | {_f((b[size] or 0) / 1024)} |"
            )
    keyed = [r for r in rows if r.get("unrelated_keys")]
    if keyed:
        out += [
            "",
            "| backend | questions | request | unrelated keys | p50 with 0 | p50 with them | ratio "
            "| CPU with 0 | CPU with them | CPU ratio | Redis ms with 0 | Redis ms with them |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in keyed:
            u = r["unrelated_keys"]
            for what in ("select_ids", "select", "plan"):
                x = u[what]
                out.append(
                    f"| {r['backend']} | {r['questions']:,} | {what} | {u['keys']:,} "
                    f"| {_f(x['p50_ms_0_keys'])} | {_f(x['p50_ms_with_keys'])} | {x['ratio_p50']:.2f} "
                    f"| {_f(x['cpu_ms_0_keys'])} | {_f(x['cpu_ms_with_keys'])} | {x['ratio_cpu']:.2f} "
                    f"| {_f(x.get('redis_ms_0_keys'))} | {_f(x.get('redis_ms_with_keys'))} |"
                )
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The tables of docs/benchmarks.md, from a result file."""
    rows = doc["results"]
    if any(r.get("floor") for r in rows):  # --floor: the service against the floor
        out = floor_table(rows)
        if any(r.get("floor_ingest") for r in rows):
            out += ["", *floor_throughput_table(rows)]
        return "\n".join(out)
    if any(r.get("mix_floor") for r in rows):  # --floor --mix-only: each side's mix
        return "\n".join(floor_mix_table(rows))
    if not any("plan" in r for r in rows):  # --mix-only: the mix is all there is
        return "\n".join(mix_table(rows))

    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.1f}")

    out = [
        "| backend | questions | eligible | trajectories | plan p50 | plan p99 | commit p50 | commit p99 "
        "| select p50 | select p99 | select ids p50 | select ids p99 | ingest traj/s | RSS MB (peak) "
        "| epoch start |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['backend']} | {r['questions']:,} | {r['shape']['eligible']:,} "
            f"| {r['shape']['trajectories']:,} "
            f"| {f(r['plan']['p50_ms'])} | {f(r['plan']['p99_ms'])} | {f(r['commit']['p50_ms'])} "
            f"| {f(r['commit']['p99_ms'])} | {f(r['select']['p50_ms'])} | {f(r['select']['p99_ms'])} "
            f"| {f(r['select_ids']['p50_ms'])} | {f(r['select_ids']['p99_ms'])} "
            f"| {f(r['ingest']['trajectories_per_s'])} | {f(r['rss_end_mb'])} ({f(r['rss_peak_mb'])}) "
            f"| {f(r['epoch_start_plan']['p50_ms'])} |"
        )
    out += [
        "",
        "| backend | questions | request | client p50 | service CPU / request | in service p50 | SQL p50 "
        "| SQL statements | Redis p50 | request KB | response KB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for what in ("plan", "commit", "select", "select_ids", "ingest"):
            x = r[what]
            out.append(
                f"| {r['backend']} | {r['questions']:,} | {what} | {f(x['p50_ms'])} "
                f"| {f(x['server_cpu_mean_ms'])} | {f(x['server_app_p50_ms'])} | {f(x['server_sql_p50_ms'])} "
                f"| {f(x['server_sql_statements_p50'])} "
                f"| {f(x['server_redis_p50_ms'])} | {f((x['request_bytes_p50'] or 0) / 1024)} "
                f"| {f((x['response_bytes_p50'] or 0) / 1024)} |"
            )
    out += ["", "| backend | goal | value | met |", "|---|---|---:|---|"]
    out += [
        f"| {g['backend']} | {g['goal']} | {g['value']} | {'yes' if g['met'] else 'no'} |"
        for g in doc["goals"]
    ]
    out += ["", *side_by_side(rows)]
    if any(r.get("mix") for r in rows):
        out += ["", *mix_table(rows)]
    loads = [x for r in rows for x in (r["loadavg_before"][0], r["loadavg_after"][0])]
    out += [
        "",
        f"Load average (1 min) during the run: {min(loads):.1f} to {max(loads):.1f} "
        f"on {doc['environment']['cpus']} CPUs.",
    ]
    return "\n".join(out)


def environment() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", *a], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--", "services", "clients")),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "argv": sys.argv[1:],
        "service_package": str(SERVICE_SRC.resolve()) if SERVICE_SRC else _service_path(),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def _service_path() -> str:
    import exgrpo_pool

    return str(Path(exgrpo_pool.__file__).resolve().parent)


# ------------------------------------------------------------------------------------- main
async def clean(opts: Options) -> None:
    import asyncpg

    conn = await asyncpg.connect(_seed.pg_url(opts.pg_dsn, "postgres"))
    try:
        names = [
            r[0]
            for r in await conn.fetch("SELECT datname FROM pg_database WHERE datname LIKE 'exgrpo_bench_%'")
        ]
    finally:
        await conn.close()
    for name in names:
        await _seed.pg_admin(opts.pg_dsn, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        log(f"dropped database {name}")
    for p in sorted(CACHE.glob("sqlite-*")) + sorted((OUT / "work").glob("sqlite-*")):
        p.unlink()
        log(f"removed {p}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="sqlite,postgres", help="comma list of sqlite, postgres")
    ap.add_argument("--sizes", default="10000,100000,1000000", help="comma list of pool sizes (questions)")
    ap.add_argument("--iterations", type=int, default=None, help="plan+commit steps measured per size (60)")
    ap.add_argument("--select-iterations", type=int, default=None, help="select calls measured per size (60)")
    ap.add_argument(
        "--read-iterations",
        type=int,
        default=None,
        help="with --floor: each polled read (run stats, pool stats, a page) measured per size "
        "(4x --select-iterations: ~1-2 ms requests whose p50 over 30 samples moved by ~0.05 of a ratio)",
    )
    ap.add_argument("--quick", action="store_true", help="10k questions only, few iterations (~1-2 min)")
    ap.add_argument("--candidates", default="all", choices=["all", "lowest_stored_entropy", "none"])
    ap.add_argument(
        "--no-idempotency-keys", action="store_true", help="send plan/commit without Idempotency-Key"
    )
    ap.add_argument("--ingest-requests", type=int, default=None, help="ingest requests per size (40)")
    ap.add_argument("--ingest-concurrency", type=int, default=4)
    ap.add_argument(
        "--ingest-throughput",
        type=int,
        default=0,
        metavar="REQUESTS",
        help="with --floor: ingest throughput rounds of this many requests per side (0: skip)",
    )
    ap.add_argument(
        "--throughput-groups", type=int, default=256, help="groups per request of the throughput rounds"
    )
    ap.add_argument(
        "--encodings",
        default="json,binary",
        help="comma list of json (base64 payloads) and binary (frames), measured interleaved",
    )
    ap.add_argument("--mix", type=float, default=0.0, metavar="SECONDS", help="run the 50-client mix so long")
    ap.add_argument("--mix-only", action="store_true", help="start the service and run only the mix")
    ap.add_argument(
        "--floor-first",
        action="store_true",
        help="with --floor --mix-only (SQLite): the floor's mix first, then the service's",
    )
    ap.add_argument(
        "--service-workers",
        type=int,
        default=1,
        help="service processes (exgrpo serve --workers N; needs Redis, so Postgres only here; "
        "no Server-Timing, and the CPU columns count the parent only)",
    )
    ap.add_argument(
        "--max-active",
        type=int,
        default=None,
        metavar="N",
        help="the service's max_active_requests (requests worked on at once; 0: no limit; default: "
        "the service's own)",
    )
    ap.add_argument(
        "--service-src",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the service of an older tree (`git archive <commit> services clients | tar -x -C DIR`) "
        "on a copy taken down to its schema; this tree's client and floor stay",
    )
    ap.add_argument(
        "--sqlite-driver",
        choices=("thread", "inline"),
        default=None,
        help="the service's sqlite_driver (default: the service's own)",
    )
    ap.add_argument(
        "--sql-log",
        type=Path,
        default=None,
        metavar="DIR",
        help="every side's statements with their ms (bench/_serve.py's EXGRPO_BENCH_SQL_LOG), a file "
        "per server in DIR named as its log",
    )
    ap.add_argument(
        "--ingest-group-max",
        type=int,
        default=None,
        metavar="N",
        help="the service's ingest_group_max (a run's waiting ingests written in one transaction, "
        "Postgres; 1: each alone; default: the service's own)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="only select, plan, commit and ingest, interleaved with the floor (bench/_floor.py) on a copy",
    )
    ap.add_argument(
        "--floor-twice",
        action="store_true",
        help="with --floor: the floor on the service's side too (an A/A run): how far the ratios "
        "stray from 1 when both sides run the same code, in the order and the hour they are taken",
    )
    ap.add_argument(
        "--unrelated-keys",
        type=int,
        default=100_000,
        help="postgres: select/plan before and after writing this many other keys to Redis (0: skip)",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="read each copy (the service's and the floor's) once before measuring: on a machine whose "
        "memory holds little more than the copies, a copy the page cache has dropped reads from disk",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile 10 extra plan+commit steps per size")
    ap.add_argument("--reseed", action="store_true", help="rebuild the seeded databases even if cached")
    ap.add_argument("--clean", action="store_true", help="drop cached seeded databases and exit")
    ap.add_argument(
        "--pg-dsn", default=os.environ.get("BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432")
    )
    ap.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--out", type=Path, default=OUT / "pool_bench.json")
    ap.add_argument(
        "--markdown", type=Path, metavar="RESULT_JSON", help="print a result file as markdown and exit"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    global SERVICE_WORKERS, MAX_ACTIVE, SQLITE_DRIVER, SERVICE_SRC, INGEST_GROUP_MAX, SQL_LOG
    args = parse(argv)
    SQL_LOG = args.sql_log
    INGEST_GROUP_MAX = args.ingest_group_max
    SERVICE_SRC = args.service_src
    SERVICE_WORKERS = args.service_workers
    MAX_ACTIVE = args.max_active
    SQLITE_DRIVER = args.sqlite_driver
    quick = args.quick
    opts = Options(
        iterations=args.iterations or (15 if quick else 60),
        warmup=2 if quick else 3,
        select_iterations=args.select_iterations or (15 if quick else 60),
        read_iterations=args.read_iterations or 4 * (args.select_iterations or (15 if quick else 60)),
        ingest_requests=args.ingest_requests or (8 if quick else 40),
        ingest_groups=32,
        ingest_concurrency=args.ingest_concurrency,
        epoch_starts=1 if quick else 3,
        candidates=args.candidates,
        idempotency_keys=not args.no_idempotency_keys,
        profile=args.profile,
        pg_dsn=args.pg_dsn,
        redis_url=args.redis_url,
        encodings=[e.strip() for e in args.encodings.split(",") if e.strip()],
        unrelated_keys=args.unrelated_keys,
        mix_s=args.mix or (60.0 if args.mix_only else 0.0),
        mix_only=args.mix_only,
        floor_first=args.floor_first,
        floor=args.floor,
        floor_twice=args.floor_twice,
        throughput_requests=args.ingest_throughput,
        throughput_groups=args.throughput_groups,
        warm=args.warm,
    )
    if not opts.encodings or set(opts.encodings) - {"json", "binary"}:
        raise SystemExit(f"--encodings takes json and/or binary, got {args.encodings!r}")
    if args.clean:
        asyncio.run(clean(opts))
        return 0
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    sizes = [10_000] if quick else [int(x) for x in args.sizes.split(",")]
    for b in backends:
        if b not in ("sqlite", "postgres"):
            raise SystemExit(f"unknown backend {b!r}: use sqlite and/or postgres")
    if opts.floor_twice and (not opts.floor or opts.mix_only or SERVICE_SRC is not None):
        raise SystemExit("--floor-twice goes with --floor, without --mix-only or --service-src")
    if opts.floor and opts.mix_only and "postgres" in backends:
        # the floor answers one request at a time on one connection: on SQLite that is all a
        # process gets (one writer, statements on the event loop), on Postgres it would leave the
        # server's concurrency unused and flatter the service
        raise SystemExit("--floor --mix-only runs on SQLite only (the floor serialises its requests)")
    OUT.mkdir(parents=True, exist_ok=True)
    combos: list[Combo] = []
    t0 = time.perf_counter()
    for backend in backends:
        for size in sizes:
            log(f"{backend} {size:,} questions")
            combos.append(asyncio.run(measure(backend, size, opts, args.reseed)))
            r = combos[-1].result
            if opts.floor:
                continue
            if opts.mix_only:
                m = r["mix"]
                log(
                    f"  {backend} {size:,}: mix {m['requests']} requests, {m['requests_per_s']:.2f}/s, "
                    f"{m['steps_per_s']:.2f} training steps/s"
                )
                continue
            log(
                f"  {backend} {size:,}: plan p50/p99 {r['plan']['p50_ms']:.1f}/{r['plan']['p99_ms']:.1f} ms, "
                f"commit {r['commit']['p50_ms']:.1f}/{r['commit']['p99_ms']:.1f} ms, "
                f"select {r['select']['p50_ms']:.1f}/{r['select']['p99_ms']:.1f} ms, "
                f"ingest {r['ingest']['trajectories_per_s']:.0f} traj/s, RSS {r['rss_end_mb']:.0f} MB"
            )
    if opts.mix_only or opts.floor:
        doc = {
            "environment": environment(),
            "options": opts.__dict__,
            "results": [{"backend": c.backend, "questions": c.size, **c.result} for c in combos],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2))
        if opts.floor and opts.mix_only:
            print("\n".join(floor_mix_table(doc["results"])))
        elif opts.floor:
            print("\n".join(floor_table(doc["results"])))
            if opts.throughput_requests:
                print("\n" + "\n".join(floor_throughput_table(doc["results"])))
        else:
            print("\n".join(mix_table(doc["results"])))
        return 0
    goal_rows = goals(combos)
    doc = {
        "environment": environment(),
        "options": opts.__dict__,
        "total_seconds": round(time.perf_counter() - t0, 1),
        "results": [{"backend": c.backend, "questions": c.size, **c.result} for c in combos],
        "goals": goal_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print_table(combos, goal_rows)
    print("\n".join(side_by_side(doc["results"])))
    print(f"\nwrote {args.out} ({doc['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
