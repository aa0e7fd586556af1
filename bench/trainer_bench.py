"""Where a trainer step spends its time, and the trainer's memory, on a tiny model on CPU.

The benchmark drives the real trainer (``exgrpo_trainer.trainer.Trainer.train_step``) against the
real pool service (uvicorn in its own process on a free loopback port, SQLite) with a tiny random
Qwen2 (``exgrpo_onebox.tiny``), synthetic ``a+b`` questions and a parity reward (1 when the code
points of the response sum to an even number: deterministic in the text, passed by about half of
the samples, so groups are partially solved, stored in the pool and replayed later).

Two modes, each in a fresh process, alternated and repeated (``--repeats``):

* ``exgrpo``: experience on, start threshold 0, so step 1 switches the run to the mixed phase, step 2
  fills the pool and every later step replays half of its questions (rescoring is non-zero);
* ``grpo``: experience off (plain on-policy GRPO on the same machinery).

Each step is split into the trainer's own ``timing/*`` blocks (plan, rescore, generate,
old_logprob, update, commit, publish, plus what lies outside them), and, by wrapping the trainer's
collaborators from here (no change to the trainer), into kinds of work:

* compute: the model's forward calls and the log-prob/entropy head on their response positions
  (TRL computes the same inside its forward), ``generate`` of the engine, ``backward``, and the
  optimizer (gradient clipping, ``step``, ``zero_grad``);
* overhead: everything else: the loss, padding and batching, grading, HTTP to the pool service
  (client encode/decode and the wait), per-step metrics and the metrics log. The table also gives
  the overhead with the log-prob head counted in it.

Each process runs torch on one thread (``--threads``): on this shared 2-core machine a two-thread
op waits until both of its threads get a core, which makes the tiny model's timings swing widely.

Every entry is kept in wall-clock seconds and in CPU seconds of the trainer process: the machine is
shared, and CPU time does not count the time spent waiting for a core (nor the pool service's own
work behind an HTTP wait, which the wall view shows).

Memory: the RSS high-water mark of the trainer process (``getrusage``) and its current RSS after
every step; then ``--trace-steps`` more steps under ``tracemalloc`` give the peak of Python-level
allocations per step (those steps are slower and are left out of the timings).

Candidate fixes are tried without touching the trainer: a mode such as ``grpo+no-fsdp`` runs
the trainer with that change patched in from here (see "variants" below); a mode ending in ``@DIR``
imports the trainer from DIR (another checkout), to compare two versions in one invocation. ``ab``
times, in one process and alternating call by call, the pieces of work that a change affects, and
``head-memory`` measures the peak memory of the scoring pass with the LM head over every position
against the response positions only (SmolLM2-135M by default: a 49k-token vocabulary).

    .venv/bin/python bench/trainer_bench.py                    # both modes, 3 repeats each
    .venv/bin/python bench/trainer_bench.py --quick            # 1 repeat, fewer steps
    .venv/bin/python bench/trainer_bench.py --modes grpo,grpo+no-fsdp --repeats 5
    .venv/bin/python bench/trainer_bench.py --modes 'grpo,old=grpo@/path/to/old-packages'
    .venv/bin/python bench/trainer_bench.py ab                 # in-process A/B of changes
    .venv/bin/python bench/trainer_bench.py head-memory        # peak memory of the LM head, SmolLM2

Results: a table on stdout and ``bench/out/trainer_bench.json`` (``trainer_ab.json`` for ``ab``,
``trainer_head_memory.json`` for ``head-memory``).
``bench/trl_compare.py`` reuses ``run_once`` (``python bench/trainer_bench.py _run ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
WORK = OUT / "work" / "trainer"
GOAL_OVERHEAD_PCT = 5.0

PHASES = ("plan", "rescore", "generate", "old_logprob", "update", "commit", "publish", "outside")
"""The trainer's timed blocks; `outside` is the rest of `train_step` (prompt tokenisation,
advantages, step metrics; with a trainer from before the commit answered the run's stats, also the
run-stats and run-metrics requests) plus writing the metrics log."""

COMPUTE_KINDS = (
    "model_forward",  # the model's forward call (logits)
    "logprob_head",  # log-softmax / entropy of the response positions (inside response_forward)
    "engine_generate",  # sampling, with the engine's per-token log-prob/entropy processors
    "backward",
    "grad_clip",
    "optimizer_step",
    "zero_grad",
)
"""Model work. `logprob_head` counts as compute because TRL computes the same quantities inside the
model's forward (its fused LM head); it is also reported on its own and in `overhead_pct_strict`."""
OVERHEAD_KINDS = (
    "loss",  # ExGRPOLoss.__call__
    "pad_rows",  # building padded tensors from token lists
    "grading",  # reward function over the decoded responses
    "http_wait",  # request sent .. response read, per HTTP call to the pool service
    "http_client",  # the SDK around it: request building, JSON/pydantic encode and decode
    "save_hf",  # writing the published safetensors folder
    "metrics_log",  # MetricsLogger.log (JSONL)
)


@dataclass(frozen=True)
class Params:
    """The workload: model size, group size, questions per step, response length, step counts."""

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    k: int = 8
    questions_per_step: int = 16
    max_new_tokens: int = 48
    questions: int = 1024
    warmup: int = 3
    steps: int = 10
    trace_steps: int = 2
    publish_every: int = 10
    mini_batches: int = 1
    lr: float = 1e-5
    seed: int = 0
    threads: int = 1
    """torch intra-op threads of the trainer process (see `set_threads`)."""


# ----------------------------------------------------------------------------------- grading
def parity(response: str, ground_truth: str) -> Any:
    """Reward 1 when the response's code points sum to an even number (about half the samples)."""
    from exgrpo_rollout.graders.base import Grade

    del ground_truth
    return Grade(float(sum(map(ord, response)) % 2 == 0), "parity")


GRADER = "trainer_bench:parity"


def questions(n: int) -> list[dict[str, Any]]:
    """`n` distinct `a+b` questions (also the TRL side's prompts, via `bench/trl_compare.py`)."""
    side = int(n**0.5) + 1
    items = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "ground_truth": str(a + b)}
        for a in range(side)
        for b in range(side)
    ]
    return items[:n]


def ensure_model(p: Params, root: Path = WORK) -> Path:
    """The tiny model folder for these sizes (built once, then reused by every run)."""
    from exgrpo_onebox.tiny import build_tiny_model

    path = root / f"model-h{p.hidden}-l{p.layers}"
    if not (path / "config.json").is_file():
        build_tiny_model(
            path, hidden=p.hidden, layers=p.layers, heads=p.heads, kv_heads=p.kv_heads, seed=p.seed
        )
    return path


# ------------------------------------------------------------------------------ pool service
_SERVER = """
import sys, uvicorn
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings
app = create_app(Settings(database_url=sys.argv[1], allow_anonymous=True, log_level="WARNING"))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def pool_service(folder: Path) -> Iterator[str]:
    """The real pool service as its own process (so it does not share the trainer's interpreter)."""
    import httpx

    port = _free_port()
    db = f"sqlite+aiosqlite:///{folder / 'pool.db'}"
    log = open(folder / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, db, str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the pool service exited; see {folder / 'server.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the pool service did not start within 60 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ---------------------------------------------------------------------------- instrumentation
class Probe:
    """Seconds per (trainer phase, kind of work), from wrappers installed around the trainer's
    collaborators. The current phase follows the trainer's own `_timed` blocks. Each entry is kept
    twice: wall-clock time (`acc`) and CPU time (`cpu`), which a busy machine inflates far less than
    wall time, since time spent waiting for a core is not in it.

    CPU time here is that of the calling thread (`time.thread_time`; torch on one thread computes on
    it), so work that other threads do meanwhile (the trainer's background metrics sender) is never
    counted as model compute: it stays in the step's process CPU time, hence in its overhead. Calls
    made on another thread than the probe's own are not in `acc`/`cpu` at all (they do not hold up
    the step); the outermost of them are summed in `background_wall` / `background_cpu`."""

    def __init__(self) -> None:
        self.phase = "outside"
        self.acc: dict[tuple[str, str], float] = defaultdict(float)
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self._depth: dict[str, int] = defaultdict(int)
        self._owner = threading.get_ident()
        self._background = threading.local()
        self._lock = threading.Lock()
        self.background_wall = 0.0
        self.background_cpu = 0.0

    def wrap(self, kind: str, fn: Callable[..., Any], *, unless_in: str | None = None) -> Callable[..., Any]:
        """`fn`, timed as `kind`; calls made inside `unless_in` (another kind) are not counted."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._owner:
                return self._in_background(fn, *args, **kwargs)
            if self._depth[kind] or (unless_in and self._depth[unless_in]):  # counted once, outermost
                return fn(*args, **kwargs)
            self._depth[kind] += 1
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                key = (self.phase, kind)
                self.acc[key] += time.perf_counter() - t
                self.cpu[key] += time.thread_time() - c
                self.calls[key] += 1
                self._depth[kind] -= 1

        return functools.update_wrapper(timed, fn, updated=())

    def _in_background(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if getattr(self._background, "busy", False):  # inside an outer wrapped call: counted there
            return fn(*args, **kwargs)
        self._background.busy = True
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            wall, cpu = time.perf_counter() - t, time.thread_time() - c
            with self._lock:
                self.background_wall += wall
                self.background_cpu += cpu
            self._background.busy = False

    def background(self) -> tuple[float, float]:
        """(wall, CPU) seconds of the wrapped calls made on other threads so far."""
        with self._lock:
            return self.background_wall, self.background_cpu

    def snapshot(self) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
        return dict(self.acc), dict(self.cpu)

    @staticmethod
    def delta(
        before: tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]],
        after: tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]],
    ) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
        (acc0, cpu0), (acc1, cpu1) = before, after
        return (
            {k: v - acc0.get(k, 0.0) for k, v in acc1.items()},
            {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()},
        )


class _TimedModel:
    """Stands in for the model inside `response_forward`: times the model call only (which includes
    the LM head over the response positions)."""

    def __init__(self, model: Any, probe: Probe) -> None:
        self._model = model
        self._call = probe.wrap("model_forward", model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def get_output_embeddings(self) -> Any:
        return self._model.get_output_embeddings()


def instrument(trainer: Any, probe: Probe) -> Callable[[], None]:
    """Install the wrappers; returns a function that removes the global ones."""
    import torch

    from exgrpo_trainer import learner as learner_mod
    from exgrpo_trainer import trainer as trainer_mod

    undo: list[Callable[[], None]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        old = getattr(obj, name)
        setattr(obj, name, value)
        undo.append(lambda: setattr(obj, name, old))

    timer = trainer.timer
    original_part = timer.part

    @contextlib.contextmanager
    def timed(name: str) -> Iterator[None]:
        prev, probe.phase = probe.phase, name
        c = time.thread_time()
        try:
            with original_part(name):
                yield
        finally:
            probe.cpu[(name, "phase")] += time.thread_time() - c
            probe.phase = prev

    learner = trainer.learner
    timer.part = timed
    trainer.rollouts.engine.generate = probe.wrap("engine_generate", trainer.rollouts.engine.generate)
    trainer.grader._grade = probe.wrap("grading", trainer.grader._grade)
    learner.loss = probe.wrap("loss", learner.loss)
    learner.optimizer.step = probe.wrap("optimizer_step", learner.optimizer.step)
    learner.optimizer.zero_grad = probe.wrap("zero_grad", learner.optimizer.zero_grad)
    client = trainer.session.client
    client._request = probe.wrap("http_client", client._request)
    client._http.send = probe.wrap("http_wait", client._http.send)

    original_forward = learner_mod.response_forward
    model_proxy = _TimedModel(learner.model, probe)

    def response_forward(model: Any, *args: Any, **kwargs: Any) -> Any:
        return original_forward(model_proxy if model is learner.model else model, *args, **kwargs)

    patch(learner_mod, "response_forward", probe.wrap("logprob_head", response_forward))
    patch(learner_mod, "pad_rows", probe.wrap("pad_rows", learner_mod.pad_rows))
    patch(trainer_mod, "save_hf", probe.wrap("save_hf", trainer_mod.save_hf))
    patch(torch.Tensor, "backward", probe.wrap("backward", torch.Tensor.backward))
    patch(torch.nn.utils, "clip_grad_norm_", probe.wrap("grad_clip", torch.nn.utils.clip_grad_norm_))

    def remove() -> None:
        for fn in reversed(undo):
            fn()

    return remove


def _kinds(delta: dict[tuple[str, str], float]) -> dict[str, float]:
    """Per-kind seconds; `logprob_head` and `http_client` are made exclusive of what they enclose."""
    out: dict[str, float] = defaultdict(float)
    for (_phase, kind), sec in delta.items():
        if kind != "phase":
            out[kind] += sec
    out["logprob_head"] -= out.get("model_forward", 0.0)
    out["http_client"] -= out.get("http_wait", 0.0)
    return dict(out)


def _by_phase(delta: dict[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (phase, kind), sec in delta.items():
        if kind != "phase":
            out[phase][kind] += sec
    for kinds in out.values():
        kinds["logprob_head"] = kinds.get("logprob_head", 0.0) - kinds.get("model_forward", 0.0)
        kinds["http_client"] = kinds.get("http_client", 0.0) - kinds.get("http_wait", 0.0)
    return {p: {k: v for k, v in kinds.items() if v != 0.0} for p, kinds in out.items()}


def set_threads(n: int) -> None:
    """Pin torch (and OpenMP/MKL through the environment, for child processes) to `n` threads.

    On a shared, oversubscribed 2-core machine every multi-threaded op waits for all its threads to
    be scheduled, which turns the tiny model's microsecond ops into millisecond stalls and makes the
    timings swing; one thread keeps both sides of a comparison on the same, steadier footing."""
    import torch

    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # only settable before the first inter-op use
        torch.set_num_interop_threads(n)


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


# ---------------------------------------------------------------------------------- variants
# Candidate fixes, tried from here on the unchanged trainer so their gain is measured end to end in
# the same session as the baseline (`--modes grpo,grpo+no-fsdp,...`). Each names the change it
# stands for in the trainer. Fixes that the trainer has taken up are no longer variants here.


def _variant_no_fsdp(learner_mod: Any) -> None:
    """learner.load_model: skip `fully_shard` when the world size is 1 (plain module, no FSDP hooks)."""
    import torch
    from transformers import AutoModelForCausalLM

    def load_plain(path: Path, device: Any, *, dtype: str, activation_checkpointing: bool) -> Any:
        del dtype  # float32 on CPU either way
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.config.use_cache = True
        if activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.to(device)

    learner_mod.load_model = load_plain


VARIANTS_BEFORE: dict[str, Callable[[Any], None]] = {
    "no-fsdp": _variant_no_fsdp,
}
VARIANTS_AFTER: dict[str, Callable[[Any], None]] = {}
"""Variants applied to the built trainer (none at present: the run-stats request they tried is gone)."""


def parse_mode(mode: str) -> tuple[str, list[str]]:
    """`exgrpo` or `grpo`, then `+variant` names."""
    base, *variants = mode.split("+")
    if base not in ("exgrpo", "grpo"):
        raise ValueError(f"mode must start with exgrpo or grpo, got {mode!r}")
    unknown = [v for v in variants if v not in VARIANTS_BEFORE and v not in VARIANTS_AFTER]
    if unknown:
        raise ValueError(f"unknown variants {unknown}: known {sorted({**VARIANTS_BEFORE, **VARIANTS_AFTER})}")
    return base, variants


# ----------------------------------------------------------------------------------- one run
def run_once(mode: str, p: Params, model: Path, folder: Path) -> dict[str, Any]:
    """Warm-up + measured steps of one trainer process in `mode` (exgrpo | grpo, + variants)."""
    import torch

    from exgrpo_client import Client
    from exgrpo_trainer import learner as learner_mod
    from exgrpo_trainer.config import load_config
    from exgrpo_trainer.telemetry import MetricsLogger
    from exgrpo_trainer.trainer import Trainer

    base, variants = parse_mode(mode)
    set_threads(p.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the parity grader's module
    folder.mkdir(parents=True, exist_ok=True)
    rss_start_kb = _rss_kb()
    for v in variants:
        if v in VARIANTS_BEFORE:
            VARIANTS_BEFORE[v](learner_mod)
    with pool_service(folder) as url, Client(url) as client:
        client.create_pool(
            "bench",
            config={"k": p.k, "batch_size": p.questions_per_step, "start_threshold": 0.0},
        )
        client.import_questions("bench", questions(p.questions))
        cfg = load_config(
            None,
            [
                f"run.pool_url={url}",
                "run.pool=bench",
                f"run.name={base}",
                f"run.seed={p.seed}",
                f"run.output_dir={folder / 'run'}",
                f"run.steps={p.warmup + p.steps + p.trace_steps}",
                f"model.path={model}",
                "model.activation_checkpointing=false",
                f"rollout.max_new_tokens={p.max_new_tokens}",
                f"rollout.min_new_tokens={p.max_new_tokens}",  # every response is exactly this long
                f"rollout.grader={GRADER}",
                "rollout.grading_workers=0",
                f"experience.enabled={'true' if base == 'exgrpo' else 'false'}",
                f"optim.lr={p.lr}",
                f"optim.mini_batches={p.mini_batches}",
                f"schedule.publish_every={p.publish_every}",
                "schedule.checkpoint_every=0",
                "logging.tensorboard=false",
                "logging.progress=false",
                "logging.send_to_service=true",
            ],
        )
        trainer = Trainer(cfg, client=client)
        probe = Probe()
        remove = instrument(trainer, probe)
        for v in variants:
            if v in VARIANTS_AFTER:
                VARIANTS_AFTER[v](trainer)
        try:
            trainer.attach()
            logger = MetricsLogger(trainer.out, cfg.logging, cfg.run.steps, cfg.public_dict())
            logger.log = probe.wrap("metrics_log", logger.log)  # type: ignore[method-assign]  # timing probe
            steps: list[dict[str, Any]] = []
            total = p.warmup + p.steps + p.trace_steps
            for i in range(total):
                tracing = i >= p.warmup + p.steps
                if tracing and not tracemalloc.is_tracing():
                    tracemalloc.start()
                if tracing:
                    tracemalloc.reset_peak()
                before, bg_before = probe.snapshot(), probe.background()
                t0, c0 = time.perf_counter(), time.process_time()
                metrics = trainer.train_step()
                probe.phase = "outside"
                logger.log(trainer.step, metrics)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                bg_wall, bg_cpu = (a - b for a, b in zip(probe.background(), bg_before, strict=True))
                delta, delta_cpu = Probe.delta(before, probe.snapshot())
                phases = {ph: metrics.get(f"timing/{ph}", 0.0) for ph in PHASES if ph != "outside"}
                phases["outside"] = wall - sum(phases.values())
                phases_cpu = {ph: delta_cpu.get((ph, "phase"), 0.0) for ph in PHASES if ph != "outside"}
                phases_cpu["outside"] = cpu - sum(phases_cpu.values())
                rec: dict[str, Any] = {
                    "step": trainer.step,
                    "warmup": i < p.warmup,
                    "traced": tracing,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "background_wall_s": bg_wall,  # HTTP on the metrics sender's thread meanwhile
                    "background_cpu_s": bg_cpu,  # (its CPU is in cpu_s too)
                    "train_step_s": metrics["timing/step"],
                    "phases": phases,
                    "phases_cpu": phases_cpu,
                    "kinds": _kinds(delta),
                    "kinds_cpu": _kinds(delta_cpu),
                    "by_phase": _by_phase(delta),
                    "by_phase_cpu": _by_phase(delta_cpu),
                    "rss_kb": _rss_kb(),
                    "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                    "mixed": metrics.get("phase/mixed", 0.0),
                    "replayed_questions": metrics.get("batch/replayed_questions", 0.0),
                    "rows": metrics.get("batch/rows", 0.0),
                    "solved": metrics.get("batch/solved", 0.0),
                    "loss": metrics.get("loss/total", 0.0),
                    "old_entropy": metrics.get("actor/old_entropy", 0.0),
                }
                if tracing:
                    rec["tracemalloc_peak_kb"] = tracemalloc.get_traced_memory()[1] // 1024
                steps.append(rec)
            if tracemalloc.is_tracing():
                tracemalloc.stop()
            logger.close()
        finally:
            remove()
            trainer.close()
    return {
        "mode": mode,
        "params": asdict(p),
        "torch_threads": torch.get_num_threads(),
        "rss_start_kb": rss_start_kb,
        "steps": steps,
        "summary": summarize(steps),
    }


# --------------------------------------------------------------------------------- summaries
UPDATE_PARTS = (
    "model_forward",
    "logprob_head",
    "loss",
    "pad_rows",
    "backward",
    "grad_clip",
    "optimizer_step",
)


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _mean(values: Any) -> float:
    values = list(values)
    return float(statistics.fmean(values)) if values else 0.0


VIEWS = {
    "wall": ("wall_s", "phases", "kinds", "by_phase", "background_wall_s"),
    "cpu": ("cpu_s", "phases_cpu", "kinds_cpu", "by_phase_cpu", "background_cpu_s"),
}
"""Two views of every step: wall-clock seconds, and CPU seconds of the trainer process."""


def _view(timed: list[dict[str, Any]], view: str) -> dict[str, Any]:
    step_key, phases_key, kinds_key, by_phase_key, background_key = VIEWS[view]
    total = [s[step_key] for s in timed]
    compute = [sum(s[kinds_key].get(k, 0.0) for k in COMPUTE_KINDS) for s in timed]
    head = [s[kinds_key].get("logprob_head", 0.0) for s in timed]
    over = [w - c for w, c in zip(total, compute, strict=True)]
    upd = [s[by_phase_key].get("update", {}) for s in timed]
    fbo = ("model_forward", "backward", "grad_clip", "optimizer_step", "zero_grad")
    upd_fbo = [sum(u.get(k, 0.0) for k in fbo) for u in upd]
    upd_total = [s[phases_key]["update"] for s in timed]
    kinds = (*COMPUTE_KINDS, *OVERHEAD_KINDS)
    phase_names = sorted({ph for s in timed for ph in s[by_phase_key]})
    return {
        "step_s_median": _median(total),
        "step_s_mean": _mean(total),
        "phases_mean": {ph: _mean(s[phases_key][ph] for s in timed) for ph in PHASES},
        "kinds_mean": {k: _mean(s[kinds_key].get(k, 0.0) for s in timed) for k in kinds},
        "by_phase_mean": {
            ph: {k: _mean(s[by_phase_key].get(ph, {}).get(k, 0.0) for s in timed) for k in kinds}
            for ph in phase_names
        },
        "compute_s_mean": _mean(compute),
        "overhead_s_mean": _mean(over),
        "background_s_mean": _mean(s.get(background_key, 0.0) for s in timed),
        "overhead_pct": 100.0 * sum(over) / sum(total),
        "overhead_pct_strict": 100.0 * (sum(over) + sum(head)) / sum(total),
        "update_overhead_pct": 100.0 * (sum(upd_total) - sum(upd_fbo)) / max(sum(upd_total), 1e-12),
    }


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Means and medians over the measured steps (no warm-up, no traced steps) of one run."""
    timed = [s for s in steps if not s["warmup"] and not s["traced"]]
    if not timed:
        return {}
    traced = [s["tracemalloc_peak_kb"] for s in steps if "tracemalloc_peak_kb" in s]
    return {
        "steps": len(timed),
        **{view: _view(timed, view) for view in VIEWS},
        "maxrss_mb": max(s["maxrss_kb"] for s in steps) / 1024,
        "rss_mb_last": steps[-1]["rss_kb"] / 1024,
        "rss_mb_per_step": [round(s["rss_kb"] / 1024, 1) for s in steps],
        "maxrss_mb_per_step": [round(s["maxrss_kb"] / 1024, 1) for s in steps],
        "tracemalloc_peak_mb": (max(traced) / 1024) if traced else None,
        "replayed_questions_mean": _mean(s["replayed_questions"] for s in timed),
        "rows_mean": _mean(s["rows"] for s in timed),
    }


def _combine_view(views: list[dict[str, Any]]) -> dict[str, Any]:
    phases = sorted({ph for v in views for ph in v["by_phase_mean"]})
    kinds = list(views[0]["kinds_mean"])
    scalar = (
        "step_s_mean",
        "compute_s_mean",
        "overhead_s_mean",
        "background_s_mean",
        "overhead_pct",
        "overhead_pct_strict",
        "update_overhead_pct",
    )
    return {
        "step_s_median": _median([v["step_s_median"] for v in views]),
        "step_s_runs": [round(v["step_s_median"], 3) for v in views],
        **{k: _median([v[k] for v in views]) for k in scalar},
        "overhead_pct_runs": [round(v["overhead_pct"], 2) for v in views],
        "phases_mean": {ph: _median([v["phases_mean"][ph] for v in views]) for ph in PHASES},
        "kinds_mean": {k: _median([v["kinds_mean"][k] for v in views]) for k in kinds},
        "by_phase_mean": {
            ph: {k: _median([v["by_phase_mean"].get(ph, {}).get(k, 0.0) for v in views]) for k in kinds}
            for ph in phases
        },
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians across repeated runs of one mode (each run's own means/medians first)."""
    ss = [r["summary"] for r in runs]
    return {
        "repeats": len(runs),
        **{view: _combine_view([s[view] for s in ss]) for view in VIEWS},
        "maxrss_mb": _median([s["maxrss_mb"] for s in ss]),
        "rss_mb_per_step": ss[0]["rss_mb_per_step"],
        "tracemalloc_peak_mb": _median([s["tracemalloc_peak_mb"] or 0.0 for s in ss]),
        "replayed_questions_mean": _median([s["replayed_questions_mean"] for s in ss]),
        "rows_mean": _median([s["rows_mean"] for s in ss]),
    }


def machine() -> dict[str, Any]:
    import torch
    import transformers

    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "loadavg_start": [round(x, 2) for x in load],
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------- printing
def format_table(results: dict[str, dict[str, Any]]) -> str:
    modes = list(results)
    width = max(12, *(len(m) + 2 for m in modes))
    lines: list[str] = []
    wall = {m: results[m]["wall"] for m in modes}
    cpu = {m: results[m]["cpu"] for m in modes}

    def header(title: str) -> None:
        head = f"{title:<36}" + "".join(f"{m:>{width}}" for m in modes)
        lines.extend(["", head, "-" * len(head)])

    def row(label: str, values: list[float | None], kind: str = "s") -> None:
        fmt = {"s": f"{{:>{width}.3f}}", "%": f"{{:>{width - 1}.2f}}%", "n": f"{{:>{width}.1f}}"}[kind]
        cells = [f"{'-':>{width}}" if v is None else fmt.format(v) for v in values]
        lines.append(f"{label:<36}" + "".join(cells))

    for title, v in (("wall seconds per step (mean)", wall), ("CPU seconds per step (mean)", cpu)):
        header(title)
        for ph in PHASES:
            row(f"  {ph}", [v[m]["phases_mean"][ph] for m in modes])
        row("step (mean)", [v[m]["step_s_mean"] for m in modes])
        row("step (median)", [v[m]["step_s_median"] for m in modes])
        row("overhead % of step", [v[m]["overhead_pct"] for m in modes], "%")
    header("inside update (wall s)")
    for k in UPDATE_PARTS:
        row(f"  {k}", [wall[m]["by_phase_mean"].get("update", {}).get(k, 0.0) for m in modes])
    row(
        "  rest (batching, metrics merge)",
        [
            wall[m]["phases_mean"]["update"]
            - sum(
                wall[m]["by_phase_mean"].get("update", {}).get(k, 0.0) for k in (*UPDATE_PARTS, "zero_grad")
            )
            for m in modes
        ],
    )
    row("overhead % of update", [wall[m]["update_overhead_pct"] for m in modes], "%")
    header("by kind of work (wall s per step)")
    for k in COMPUTE_KINDS:
        row(f"  compute: {k}", [wall[m]["kinds_mean"][k] for m in modes])
    for k in OVERHEAD_KINDS:
        row(f"  overhead: {k}", [wall[m]["kinds_mean"][k] for m in modes])
    row(
        "  overhead: rest (unattributed)",
        [wall[m]["overhead_s_mean"] - sum(wall[m]["kinds_mean"][k] for k in OVERHEAD_KINDS) for m in modes],
    )
    row("compute", [wall[m]["compute_s_mean"] for m in modes])
    row("overhead", [wall[m]["overhead_s_mean"] for m in modes])
    row("overhead % of step (wall)", [wall[m]["overhead_pct"] for m in modes], "%")
    row("  with the log-prob head as overhead", [wall[m]["overhead_pct_strict"] for m in modes], "%")
    row("overhead % of step (CPU)", [cpu[m]["overhead_pct"] for m in modes], "%")
    row("background HTTP, wall s (not in step)", [wall[m].get("background_s_mean", 0.0) for m in modes])
    row("background HTTP, CPU s (in step CPU)", [cpu[m].get("background_s_mean", 0.0) for m in modes])
    header("batch and memory")
    row("replayed questions / step", [results[m]["replayed_questions_mean"] for m in modes], "n")
    row("rows / step", [results[m]["rows_mean"] for m in modes], "n")
    row("peak RSS, getrusage (MB)", [results[m]["maxrss_mb"] for m in modes], "n")
    row("tracemalloc peak / step (MB)", [results[m]["tracemalloc_peak_mb"] for m in modes], "n")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- A/B in-process
# The same work done two ways, alternated call by call in one process (A, B, A, B, ...), so both see
# the same machine; the gain is the median of the per-pair ratios B/A, in wall and in CPU time.


def _pairs(a: Callable[[], Any], b: Callable[[], Any], reps: int) -> dict[str, Any]:
    a()
    b()  # warm both paths
    wa, wb, ca, cb = [], [], [], []
    for _ in range(reps):
        for fn, w, c in ((a, wa, ca), (b, wb, cb)):
            t, u = time.perf_counter(), time.process_time()
            fn()
            w.append(time.perf_counter() - t)
            c.append(time.process_time() - u)
    return {
        "reps": reps,
        "a_wall_s": _median(wa),
        "b_wall_s": _median(wb),
        "a_cpu_s": _median(ca),
        "b_cpu_s": _median(cb),
        "ratio_wall": _median([y / x for x, y in zip(wa, wb, strict=True)]),
        "ratio_cpu": _median([y / x for x, y in zip(ca, cb, strict=True)]),
    }


def full_logits_forward(
    model: Any, input_ids: Any, attention_mask: Any, response_ids: Any, positions: Any, *, with_entropy: bool
) -> tuple[Any, Any]:
    """The trainer's scoring forward as it was before the LM head ran on response positions only:
    logits of every position (prompt included), then the response positions gathered. The reference
    side of the `head` A/B and of `head-memory`."""
    from exgrpo_trainer.algo import token_entropy, token_logprobs

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    sel = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1])).float()
    return token_logprobs(sel, response_ids), token_entropy(sel) if with_entropy else None


def run_ab(p: Params, model_path: Path, reps: int) -> dict[str, dict[str, Any]]:
    """In-process A/B checks of changes to how work is done: A = the other way, B = the way the
    trainer does it now (or, for `no-fsdp`, a candidate the trainer does not take)."""
    import torch
    from transformers import AutoModelForCausalLM

    from exgrpo_rollout.engines.base import SamplingConfig
    from exgrpo_rollout.engines.hf import TransformersEngine
    from exgrpo_trainer import dist
    from exgrpo_trainer.algo import ExGRPOLoss, LossConfig
    from exgrpo_trainer.model import (
        generation_view,
        load_model,
        load_tokenizer,
        pad_rows,
        response_forward,
        unsharded,
    )

    set_threads(p.threads)
    device = dist.init()
    tok = load_tokenizer(model_path)
    fsdp_model = load_model(model_path, device, dtype="auto", activation_checkpointing=False)
    plain_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    plain_model.config.use_cache = True
    opt = {
        "fsdp": torch.optim.AdamW(fsdp_model.parameters(), lr=p.lr, fused=True),
        "plain": torch.optim.AdamW(plain_model.parameters(), lr=p.lr, fused=True),
    }
    # "fsdp": generating through the sharded module's own forward (FSDP2 hooks on every call), as the
    # trainer did; "view": through its hook-free generation view, as it does now
    engines = {
        "fsdp": TransformersEngine(fsdp_model, tok, record=False),
        "view": TransformersEngine(generation_view(fsdp_model), tok, record=False),
    }
    qs = questions(p.questions)[: p.questions_per_step]
    prompts = []
    for q in qs:
        text = tok.apply_chat_template(q["prompt"], add_generation_prompt=True, tokenize=False)
        prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    sampling = SamplingConfig(n=p.k, max_new_tokens=p.max_new_tokens, min_new_tokens=p.max_new_tokens, seed=1)
    gen = engines["plain"].generate(prompts, sampling)
    rows_p = [prompts[i] for i, cs in enumerate(gen) for _ in cs]
    rows_r = [c.token_ids for cs in gen for c in cs]
    loss_fn = ExGRPOLoss(LossConfig(max_response_len=p.max_new_tokens))
    adv = torch.randn(len(rows_r))
    out: dict[str, dict[str, Any]] = {}

    def update(name: str, forward: Callable[..., Any] = response_forward) -> Callable[[], None]:
        model = fsdp_model if name == "fsdp" else plain_model

        def step() -> None:
            ids, att, rids, rmask, pos = pad_rows(rows_p, rows_r, int(tok.pad_token_id), device)
            lp, ent = forward(model, ids, att, rids, pos, with_entropy=True)
            zeros = torch.zeros_like(lp)
            loss, _ = loss_fn(
                lp.float(),
                old_logprobs=lp.detach(),
                advantages=adv,
                loss_mask=rmask,
                mixed_phase=False,
                replay_mask=torch.zeros_like(rmask),
                past_logprobs=zeros,
                entropy=ent,
                num_loss_tokens=float(rmask.sum()),
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt[name].step()
            opt[name].zero_grad(set_to_none=True)

        return step

    def generate(engine: Any, model: Any, jobs: list[tuple[list[list[int]], Any]]) -> Callable[[], None]:
        def call() -> None:
            with unsharded(model), torch.no_grad():
                for job_prompts, job_sampling in jobs:
                    engine.generate(job_prompts, job_sampling)

        return call

    def say(what: str) -> None:
        print(f"[trainer-bench ab] {what}", file=sys.stderr, flush=True)

    say("update step: LM head over every position (A) vs over response positions only (B)")
    out["head: update (fwd+loss+bwd+optimizer)"] = _pairs(
        update("fsdp", full_logits_forward), update("fsdp"), reps
    )
    say("update step: FSDP2 at world size 1 (A) vs plain module (B)")
    out["no-fsdp: update (fwd+loss+bwd+optimizer)"] = _pairs(update("fsdp"), update("plain"), reps)
    gen_reps = max(3, reps // 2)
    say("generate: the FSDP2 module with its hooks (A) vs the hook-free generation view (B)")
    out["view: generate"] = _pairs(
        generate(engines["fsdp"], fsdp_model, [(prompts, sampling)]),
        generate(engines["view"], fsdp_model, [(prompts, sampling)]),
        gen_reps,
    )
    say("generate: sampler log-prob/entropy processors on (A) vs off (B)")
    recording = TransformersEngine(generation_view(fsdp_model), tok)
    out["record off: generate"] = _pairs(
        generate(recording, fsdp_model, [(prompts, sampling)]),
        generate(engines["view"], fsdp_model, [(prompts, sampling)]),
        gen_reps,
    )
    half = len(prompts) // 2
    fewer = SamplingConfig(
        n=p.k - 1, max_new_tokens=p.max_new_tokens, min_new_tokens=p.max_new_tokens, seed=2
    )
    one = SamplingConfig(n=1, max_new_tokens=p.max_new_tokens, min_new_tokens=p.max_new_tokens, seed=3)
    flat = [x for x in prompts[:half] for _ in range(p.k - 1)] + [
        x for x in prompts[half:] for _ in range(p.k)
    ]
    say("mixed-phase generate: 2 calls (n=K-1, n=K) (A) vs 1 call with a row per sample (B)")
    out["one call: mixed-phase generate"] = _pairs(
        generate(engines["view"], fsdp_model, [(prompts[:half], fewer), (prompts[half:], sampling)]),
        generate(engines["view"], fsdp_model, [(flat, one)]),
        gen_reps,
    )
    return out


# ------------------------------------------------------------------------- LM head memory
HEAD_PATHS = ("full", "response")


def head_memory_once(
    path: str, model_path: Path, rows: int, prompt_len: int, response_len: int
) -> dict[str, Any]:
    """One forward + backward of the scoring pass over `rows` rows of `prompt_len` + `response_len`
    random tokens, with the LM head over every position (`full`) or the response positions only
    (`response`), in this process. Returns the RSS before the pass and the high-water mark after."""
    import torch
    from transformers import AutoModelForCausalLM

    from exgrpo_trainer.model import pad_rows, response_forward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (rows, prompt_len)).tolist()
    responses = torch.randint(0, vocab, (rows, response_len)).tolist()
    batch = pad_rows(prompts, responses, 0, torch.device("cpu"))
    forward = full_logits_forward if path == "full" else response_forward
    before_kb = _rss_kb()
    peak_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    lp, ent = forward(model, *batch[:3], batch[4], with_entropy=True)
    (lp[batch[3]].sum() + 0.001 * ent[batch[3]].sum()).backward()
    return {
        "path": path,
        "vocab": vocab,
        "rss_before_mb": before_kb / 1024,
        "peak_before_mb": peak_before_kb / 1024,
        "peak_after_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": time.perf_counter() - t,
    }


def run_head_memory(
    model_path: Path, rows: int, prompt_len: int, response_len: int, threads: int
) -> dict[str, Any]:
    """`head_memory_once` for both paths, each in a fresh process (its own high-water mark).

    glibc serves large allocations from its heap once its mmap threshold has adapted upwards, and
    reuses that memory in ways that make the RSS high-water mark depend on allocation order; a
    fixed threshold of 128 KiB gives every tensor larger than that its own mapping, returned to the
    system when freed, so the high-water mark is the peak of live tensors (plus a fixed base)."""
    out: dict[str, Any] = {}
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
    }
    for path in HEAD_PATHS:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            args = [str(model_path), str(rows), str(prompt_len), str(response_len), str(result)]
            cmd = [sys.executable, str(Path(__file__).resolve()), "_head", path, *args]
            subprocess.run(cmd, check=True, cwd=ROOT, env=env)
            out[path] = json.loads(result.read_text())
    return out


def format_ab(res: dict[str, dict[str, Any]]) -> str:
    cols = "".join(f"{c:>10}" for c in ("A wall", "B wall", "B/A wall", "A CPU", "B CPU", "B/A CPU"))
    head = f"{'A/B (medians)':<44}{cols}"
    lines = [head, "-" * len(head)]
    for name, r in res.items():
        lines.append(
            f"{name:<44}{r['a_wall_s']:>10.3f}{r['b_wall_s']:>10.3f}{r['ratio_wall']:>10.3f}"
            f"{r['a_cpu_s']:>10.3f}{r['b_cpu_s']:>10.3f}{r['ratio_cpu']:>10.3f}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ driver
def child_env(p: Params) -> dict[str, str]:
    n = str(p.threads)
    return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}


def spawn_run(mode: str, p: Params, model: Path, folder: Path) -> dict[str, Any]:
    """`run_once` in a fresh interpreter (its own RSS high-water mark and torch state).

    A mode may end in `@DIR`: that run imports the `exgrpo_*` packages from DIR first (put at the
    front of PYTHONPATH), e.g. a folder of links to another checkout's packages, so two versions of
    the trainer can be measured in the same invocation."""
    mode, _, source = mode.partition("@")
    env = child_env(p)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (source, env.get("PYTHONPATH", "")) if x)
    out = folder / "result.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_run",
        "--mode",
        mode,
        "--params",
        json.dumps(asdict(p)),
        "--model",
        str(model),
        "--folder",
        str(folder),
        "--json",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return json.loads(out.read_text())


def params_from_args(args: argparse.Namespace) -> Params:
    p = Params(
        hidden=args.hidden,
        layers=args.layers,
        k=args.k,
        questions_per_step=args.questions_per_step,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        steps=args.steps,
        trace_steps=args.trace_steps,
        publish_every=args.publish_every,
        mini_batches=args.mini_batches,
        threads=args.threads,
    )
    if args.quick:
        p = Params(**{**asdict(p), "steps": 4, "warmup": 3, "trace_steps": 1})
    return p


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    d = Params()
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--k", type=int, default=d.k, help="rollouts per question (K)")
    ap.add_argument("--questions-per-step", type=int, default=d.questions_per_step, help="B")
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--steps", type=int, default=d.steps, help="measured steps per run")
    ap.add_argument("--trace-steps", type=int, default=d.trace_steps)
    ap.add_argument("--publish-every", type=int, default=d.publish_every)
    ap.add_argument("--mini-batches", type=int, default=d.mini_batches)
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 4 measured steps")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_run":  # one run in this process (used by the driver and trl_compare)
        ap = argparse.ArgumentParser(prog="trainer_bench.py _run")
        ap.add_argument("--mode", required=True)
        ap.add_argument("--params", required=True)
        ap.add_argument("--model", required=True, type=Path)
        ap.add_argument("--folder", required=True, type=Path)
        ap.add_argument("--json", required=True, type=Path)
        a = ap.parse_args(argv[1:])
        result = run_once(a.mode, Params(**json.loads(a.params)), a.model, a.folder)
        a.json.write_text(json.dumps(result, indent=1))
        return 0

    if argv and argv[0] == "_head":  # one path of head-memory in this process
        path, model, rows, prompt_len, response_len, out = argv[1:7]
        res = head_memory_once(path, Path(model), int(rows), int(prompt_len), int(response_len))
        Path(out).write_text(json.dumps(res))
        return 0

    if argv and argv[0] == "head-memory":  # peak memory of the scoring pass, LM head over all vs responses
        ap = argparse.ArgumentParser(prog="trainer_bench.py head-memory")
        ap.add_argument("--model", type=Path, default=ROOT / "exgrpo-data/cache/smollm2-135m-instruct")
        ap.add_argument("--rows", type=int, default=8)
        ap.add_argument("--prompt-len", type=int, default=192)
        ap.add_argument("--response-len", type=int, default=64)
        ap.add_argument("--threads", type=int, default=1)
        ap.add_argument("--out", type=Path, default=OUT / "trainer_head_memory.json")
        args = ap.parse_args(argv[1:])
        res = run_head_memory(args.model, args.rows, args.prompt_len, args.response_len, args.threads)
        print(
            f"{args.model.name}: {args.rows} rows x ({args.prompt_len} prompt + {args.response_len} "
            f"response) tokens, vocabulary {res['full']['vocab']}, one forward + backward"
        )
        for path in HEAD_PATHS:
            r = res[path]
            grew = r["peak_after_mb"] - r["rss_before_mb"]
            note = (
                ""
                if r["peak_after_mb"] > r["peak_before_mb"]
                else " (below the load-time peak: inconclusive)"
            )
            print(
                f"  LM head over {path:<8} positions: peak +{grew:7.0f} MB over the RSS before, "
                f"{r['seconds']:.1f} s{note}"
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
        return 0

    if argv and argv[0] == "ab":  # in-process A/B checks of changes
        ap = argparse.ArgumentParser(prog="trainer_bench.py ab")
        add_workload_args(ap)
        ap.add_argument("--reps", type=int, default=12)
        ap.add_argument("--out", type=Path, default=OUT / "trainer_ab.json")
        args = ap.parse_args(argv[1:])
        p = params_from_args(args)
        info = machine()
        res = run_ab(p, ensure_model(p), args.reps)
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        print(format_ab(res))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": info, "params": asdict(p), "ab": res}, indent=1))
        print(f"wrote {args.out}")
        return 0

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument(
        "--modes",
        default="exgrpo,grpo",
        help="comma-separated modes (exgrpo or grpo, +variants, optionally @DIR), each optionally "
        "labelled: label=mode",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT / "trainer_bench.json")
    args = ap.parse_args(argv)
    p = params_from_args(args)
    repeats = 1 if args.quick else args.repeats
    specs: dict[str, str] = {}  # label -> mode
    for item in (x.strip() for x in args.modes.split(",")):
        if item:
            label, _, mode = item.rpartition("=")
            parse_mode(mode.partition("@")[0])  # fail early on a bad name
            specs[label or mode] = mode
    modes = list(specs)
    info = machine()
    model = ensure_model(p)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trainer-bench-", dir=WORK) as tmp:
        for r in range(repeats):
            for m in modes if r % 2 == 0 else list(reversed(modes)):
                print(f"[trainer-bench] repeat {r + 1}/{repeats}: {m}", file=sys.stderr, flush=True)
                folder = Path(tmp) / f"mode{modes.index(m)}-{r}"
                runs[m].append(spawn_run(specs[m], p, model, folder))
    results = {m: combine(rs) for m, rs in runs.items()}
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    table = format_table(results)
    print(
        f"\ntiny Qwen2 hidden={p.hidden} layers={p.layers}, K={p.k}, B={p.questions_per_step}, "
        f"{p.max_new_tokens} new tokens, {p.steps} measured steps after {p.warmup} warm-up, "
        f"medians of {repeats} runs per mode\n"
    )
    print(table)
    for m, res in results.items():
        w, c = res["wall"]["overhead_pct"], res["cpu"]["overhead_pct"]
        verdict = "met" if w < GOAL_OVERHEAD_PCT else "missed"
        print(
            f"{m}: overhead {w:.2f}% of a step (wall; {c:.2f}% of CPU), "
            f"goal < {GOAL_OVERHEAD_PCT}%: {verdict}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": info, "params": asdict(p), "results": results, "runs": runs}, indent=1)
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
