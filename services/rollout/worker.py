"""Rollout worker: claims generation tasks of a run from the pool service, generates, grades, completes.

The loop, one iteration:

1. follow the run's policy: when a newer published version than the loaded one exists, load its
   weights (a `file://` uri, on a filesystem shared with the trainer) into the engine;
2. claim up to `tasks_per_claim` tasks with a lease of `lease_seconds`;
   none available: sleep with exponential back-off and jitter (capped), then start over;
3. render each task's prompt with the model's chat template (`exgrpo_rollout.prompts`), generate
   `task.num_samples` samples per task (one engine call per distinct sample count), grade them
   (a `GradingPool` with hard time limits, or in process);
4. complete each task with its rollouts: token ids, log-probs, reward, mean entropy, finish reason.

Leases: a background thread renews the lease of every in-flight task every `lease_seconds / 3`.
If a renewal or the completion answers 409 the lease was lost (it expired and another worker took
the task): the result is dropped, the other worker's counts. A worker that dies without a word
loses nothing either: its leases expire and the tasks go back to the queue.

Stopping: SIGTERM or SIGINT (see `install_signal_handlers`) stops claiming, interrupts generation
or grading, fails the in-flight tasks back with `retry=true` (they are pending again at once, their
attempt counted) and makes `run()` return 0. `request_stop()` does the same from another thread,
without interrupting an engine call.

The same thread emits a heartbeat log line every `heartbeat_s` (tasks done, generation tokens/s,
grading latency). Logs are structured (`exgrpo_rollout.logs`); Prometheus metrics are optional
(`WorkerMetrics`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from exgrpo_client import Client, rollout
from exgrpo_client.errors import BadRequest, Conflict, ExgrpoError, NotFound
from exgrpo_client.schemas import RolloutResult, TaskPublic
from exgrpo_rollout.engines.base import Completion, GenerationEngine, SamplingConfig
from exgrpo_rollout.logs import fields
from exgrpo_rollout.prompts import render_prompt
from exgrpo_rollout.weights import path_from_uri

if TYPE_CHECKING:
    from exgrpo_rollout.engines.factory import EngineName
    from exgrpo_rollout.graders import Grade, GradingPool

__all__ = [
    "RolloutWorker",
    "WorkerConfig",
    "WorkerMetrics",
    "WorkerStats",
    "default_worker_id",
    "path_from_uri",
    "run_worker",
]

log = logging.getLogger(__name__)

TEST_DELAY_ENV = "EXGRPO_WORKER_TEST_DELAY_S"
"""Test hook: seconds to wait after claiming, before generating (the task is held mid-flight)."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(kw_only=True)
class WorkerConfig:
    pool: str
    run: str
    worker_id: str = field(default_factory=default_worker_id)
    """Name sent with claims (shown in the service's task table)."""
    lease_seconds: float = 120.0
    """Lease asked for at claim and at each renewal (every lease_seconds / 3)."""
    tasks_per_claim: int = 1
    """Tasks claimed (and generated together) at once."""
    max_tasks: int | None = None
    """Stop after completing this many tasks (None: run until stopped)."""
    idle_exit_s: float | None = None
    """Stop after this many seconds without a claimable task (None: wait forever)."""
    grader: str = "math_think"
    grading_timeout_s: float = 5.0
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    max_prompt_len: int | None = 1024
    """Prompts are cut from the left to this many tokens (the trainer's model.max_prompt_len)."""
    drop_system: bool = False
    """Drop system messages before the chat template (training keeps them)."""
    follow_policy: bool = True
    """Load newer published policy versions of the run."""
    policy_poll_s: float = 10.0
    heartbeat_s: float = 30.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_consecutive_errors: int = 3
    """Engine failures in a row (tasks failed back each time) before the worker gives up."""
    test_delay_s: float = 0.0
    """Test hook (EXGRPO_WORKER_TEST_DELAY_S): wait this long after claiming."""

    def __post_init__(self) -> None:
        if self.lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        if self.tasks_per_claim < 1:
            raise ValueError("tasks_per_claim must be >= 1")
        if self.max_tasks is not None and self.max_tasks < 1:
            raise ValueError("max_tasks must be >= 1")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        # fail on bad sampling settings here, not at the first task
        SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
        )


@dataclass
class WorkerStats:
    tasks_completed: int = 0
    tasks_failed: int = 0
    """Failed back to the queue after an engine error."""
    tasks_released: int = 0
    """Failed back (retry) because the worker stopped."""
    tasks_lost: int = 0
    """Lease lost before completion: another worker got the task."""
    samples: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    grading_calls: int = 0
    grading_seconds: float = 0.0
    policy_reloads: int = 0
    loaded_version: int = -1
    """-1: the weights the worker started with, not a published version."""
    completed_ids: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)
    """Attempt number of each claimed task (as counted by the service at the claim)."""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0


class WorkerMetrics:
    """Prometheus metrics of one worker, in their own registry (served by `serve`)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.tokens_per_second = Gauge(
            "exgrpo_worker_tokens_per_second",
            "Generated tokens per second of the last engine call",
            registry=r,
        )
        self.generated_tokens = Counter("exgrpo_worker_generated_tokens", "Generated tokens", registry=r)
        self.grading_seconds = Histogram(
            "exgrpo_worker_grading_seconds",
            "Wall time to grade the samples of one claim",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.tasks_completed = Counter("exgrpo_worker_tasks_completed", "Tasks completed", registry=r)
        self.tasks_failed = Counter(
            "exgrpo_worker_tasks_failed", "Tasks failed back to the queue", registry=r
        )
        self.tasks_lost = Counter("exgrpo_worker_tasks_lost", "Tasks whose lease was lost", registry=r)
        self.policy_version = Gauge("exgrpo_worker_policy_version", "Loaded policy version", registry=r)
        self.policy_version.set(-1)
        self._server: Any = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import start_http_server

        served = start_http_server(port, addr=addr, registry=self.registry)
        self._server = served[0] if isinstance(served, tuple) else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Shutdown(BaseException):
    """Raised into the main loop by a stop signal (BaseException: nothing on the way swallows it)."""


@dataclass
class _Lease:
    token: str
    lost: bool = False


class RolloutWorker:
    """One worker: an engine, its tokenizer, and the pool run it serves.

    `client_factory` builds `exgrpo_client.Client`s: one for the main loop, one for the lease thread.
    `grading` is a `GradingPool` (hard per-item time limits in child processes), or None to grade
    in this process. `loaded_version` is the published version the engine holds (-1: none).
    """

    def __init__(
        self,
        config: WorkerConfig,
        engine: GenerationEngine,
        tokenizer: Any,
        *,
        client_factory: Callable[[], Client],
        grading: GradingPool | None = None,
        metrics: WorkerMetrics | None = None,
        loaded_version: int = -1,
    ) -> None:
        self.cfg = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.grading = grading
        self.metrics = metrics
        self.stats = WorkerStats(loaded_version=loaded_version)
        self._client_factory = client_factory
        self.client = client_factory()
        self._inflight: dict[int, _Lease] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._can_interrupt = False
        self._next_policy_poll = 0.0
        self._bad_versions: set[int] = set()
        self._empty_streak = 0
        self._idle_since: float | None = None
        self._errors_in_row = 0
        self._keeper = _LeaseKeeper(self)
        if metrics is not None:
            metrics.policy_version.set(loaded_version)

    # ------------------------------------------------------------------------------ control
    def request_stop(self) -> None:
        """Stop after the current engine call (from any thread); in-flight tasks are failed back."""
        self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the worker (main thread only). Generation and grading are interrupted."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        first = not self._stopping
        self._stopping = True
        if first:
            log.info("stop_requested", extra=fields(signal=signal.Signals(signum).name))
        if self._can_interrupt:
            self._can_interrupt = False
            raise _Shutdown()

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[None]:
        self._can_interrupt = True
        try:
            if self._stopping:
                raise _Shutdown()
            yield
        finally:
            self._can_interrupt = False

    def _sleep(self, seconds: float) -> None:
        """Sleep that ends early when a stop is requested."""
        end = time.monotonic() + seconds
        while not self._stopping:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    # --------------------------------------------------------------------------------- loop
    def run(self) -> int:
        """Serve tasks until stopped, `max_tasks` are done or `idle_exit_s` passes idle; returns 0."""
        log.info(
            "worker_started",
            extra=fields(
                worker=self.cfg.worker_id,
                pool=self.cfg.pool,
                run=self.cfg.run,
                engine=getattr(self.engine, "name", type(self.engine).__name__),
                grader=self.cfg.grader,
                lease_seconds=self.cfg.lease_seconds,
                policy_version=self.stats.loaded_version,
            ),
        )
        self._keeper.start()
        try:
            while not self._stopping and not self._done():
                self.follow_policy()
                tasks = self._claim()
                if tasks:
                    self._process(tasks)
                elif self._idle_too_long():
                    log.info("idle_exit", extra=fields(idle_s=self.cfg.idle_exit_s))
                    break
                else:
                    self._idle_wait()
        except _Shutdown:
            pass
        finally:
            self._can_interrupt = False
            self._release_inflight("worker stopped")
            self._keeper.stop()
            with contextlib.suppress(Exception):
                self.client.close()
            s = self.stats
            log.info(
                "worker_stopped",
                extra=fields(
                    tasks_completed=s.tasks_completed,
                    tasks_failed=s.tasks_failed,
                    tasks_released=s.tasks_released,
                    tasks_lost=s.tasks_lost,
                    generated_tokens=s.generated_tokens,
                    tokens_per_s=round(s.tokens_per_second, 1),
                    policy_version=s.loaded_version,
                    policy_reloads=s.policy_reloads,
                ),
            )
        return 0

    def _done(self) -> bool:
        return self.cfg.max_tasks is not None and self.stats.tasks_completed >= self.cfg.max_tasks

    def _idle_too_long(self) -> bool:
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        return self.cfg.idle_exit_s is not None and now - self._idle_since >= self.cfg.idle_exit_s

    def _idle_wait(self) -> None:
        self._empty_streak += 1
        base = min(self.cfg.backoff_max_s, self.cfg.backoff_initial_s * 2 ** min(self._empty_streak - 1, 30))
        self._sleep(base * random.uniform(0.5, 1.0))

    def _claim(self) -> list[TaskPublic]:
        want = self.cfg.tasks_per_claim
        if self.cfg.max_tasks is not None:
            want = min(want, self.cfg.max_tasks - self.stats.tasks_completed)
        try:
            claimed = self.client.claim_tasks(
                self.cfg.pool, self.cfg.run, self.cfg.worker_id, want, self.cfg.lease_seconds
            )
        except (BadRequest, NotFound):
            raise  # wrong pool/run names or settings: nothing will ever work
        except ExgrpoError as e:
            log.warning("claim_failed", extra=fields(error=str(e)))
            return []
        tasks = list(claimed.data)
        if tasks:
            self._empty_streak = 0
            self._idle_since = None
            with self._lock:
                for t in tasks:
                    assert t.lease_token is not None, "claimed tasks carry a lease token"
                    self._inflight[t.id] = _Lease(t.lease_token)
                    self.stats.attempts[t.id] = t.attempts
            log.info(
                "tasks_claimed",
                extra=fields(tasks=[t.id for t in tasks], attempts=[t.attempts for t in tasks]),
            )
        return tasks

    # ------------------------------------------------------------------------------- policy
    def follow_policy(self, force: bool = False) -> None:
        """Load the run's newest published policy if it is newer than the loaded one.

        Polls at most every `policy_poll_s` unless `force`. A version that fails to load is logged
        and skipped (the worker keeps its weights)."""
        if not self.cfg.follow_policy:
            return
        now = time.monotonic()
        if not force and now < self._next_policy_poll:
            return
        self._next_policy_poll = now + self.cfg.policy_poll_s
        try:
            versions = self.client.list_policy_versions(self.cfg.pool, self.cfg.run).data
        except ExgrpoError as e:
            log.warning("policy_poll_failed", extra=fields(error=str(e)))
            return
        candidates = [v for v in versions if v.version not in self._bad_versions]
        if not candidates:
            return
        latest = max(candidates, key=lambda v: v.version)
        if latest.version <= self.stats.loaded_version:
            return
        start = time.perf_counter()
        try:
            path = path_from_uri(latest.uri)
            self.engine.load_weights(path)
        except Exception as e:
            self._bad_versions.add(latest.version)
            log.error(
                "policy_load_failed",
                extra=fields(version=latest.version, uri=latest.uri, error=f"{type(e).__name__}: {e}"),
            )
            return
        self.stats.loaded_version = latest.version
        self.stats.policy_reloads += 1
        if self.metrics is not None:
            self.metrics.policy_version.set(latest.version)
        log.info(
            "policy_loaded",
            extra=fields(version=latest.version, path=path, seconds=round(time.perf_counter() - start, 3)),
        )

    # -------------------------------------------------------------------------------- tasks
    def _process(self, tasks: list[TaskPublic]) -> None:
        if self.cfg.test_delay_s > 0:
            with self._interruptible():
                self._sleep(self.cfg.test_delay_s)
        if self._stopping:
            raise _Shutdown()
        if max(t.policy_version for t in tasks) > self.stats.loaded_version:
            self.follow_policy(force=True)  # the batch was planned with newer weights: fetch them first
        try:
            with self._interruptible():
                results = self._generate_and_grade(tasks)
        except Exception as e:
            self._errors_in_row += 1
            log.exception("generation_failed", extra=fields(tasks=[t.id for t in tasks]))
            self._fail_back(tasks, f"{type(e).__name__}: {e}", released=False)
            if self._errors_in_row >= self.cfg.max_consecutive_errors:
                raise RuntimeError(f"{self._errors_in_row} engine failures in a row; last: {e}") from e
            return
        self._errors_in_row = 0
        for task, rollouts in zip(tasks, results, strict=True):
            self._complete(task, rollouts)

    def _generate_and_grade(self, tasks: list[TaskPublic]) -> list[list[RolloutResult]]:
        cfg = self.cfg
        prompts = [
            render_prompt(self.tokenizer, t.prompt, cfg.drop_system, cfg.max_prompt_len) for t in tasks
        ]
        completions: list[list[Completion]] = [[] for _ in tasks]
        by_n: dict[int, list[int]] = {}
        for i, t in enumerate(tasks):
            by_n.setdefault(t.num_samples, []).append(i)
        for n, idx in by_n.items():
            sampling = SamplingConfig(
                n=n,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens,
                min_new_tokens=min(cfg.min_new_tokens, cfg.max_new_tokens),
            )
            start = time.perf_counter()
            out = self.engine.generate([prompts[i] for i in idx], sampling)
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for cs in out for c in cs)
            self.stats.generated_tokens += tokens
            self.stats.generate_seconds += seconds
            self.stats.samples += sum(len(cs) for cs in out)
            if self.metrics is not None:
                self.metrics.generated_tokens.inc(tokens)
                self.metrics.tokens_per_second.set(tokens / seconds if seconds > 0 else 0.0)
            for i, cs in zip(idx, out, strict=True):
                completions[i] = cs
        items = [
            (self._text(c), t.ground_truth) for t, cs in zip(tasks, completions, strict=True) for c in cs
        ]
        start = time.perf_counter()
        grades = self._grade(items)
        seconds = time.perf_counter() - start
        self.stats.grading_calls += 1
        self.stats.grading_seconds += seconds
        if self.metrics is not None:
            self.metrics.grading_seconds.observe(seconds)
        it = iter(grades)
        results: list[list[RolloutResult]] = []
        for cs in completions:
            group = []
            for c in cs:
                entropy = c.mean_entropy
                group.append(
                    rollout(
                        next(it).reward,
                        c.token_ids,
                        c.logprobs,
                        entropy=None if entropy is None else max(0.0, entropy),
                        finish_reason=c.finish_reason,
                    )
                )
            results.append(group)
        return results

    def _text(self, c: Completion) -> str:
        if c.text:
            return c.text
        return str(self.tokenizer.decode(c.token_ids, skip_special_tokens=False))

    def _grade(self, items: list[tuple[str, str]]) -> list[Grade]:
        from exgrpo_rollout.graders import grade_items

        return grade_items(self.cfg.grader, items, self.cfg.grading_timeout_s, self.grading)

    def _complete(self, task: TaskPublic, rollouts: list[RolloutResult]) -> None:
        with self._lock:
            lease = self._inflight.get(task.id)
        if lease is None or lease.lost:
            self._lost(task.id, "lease lost before completion")
            return
        try:
            self.client.complete_task(self.cfg.pool, task.id, lease.token, rollouts)
        except (Conflict, NotFound) as e:
            self._lost(task.id, str(e))
            return
        except ExgrpoError as e:
            log.error("complete_failed", extra=fields(task=task.id, error=str(e)))
            self._fail_back([task], f"completion refused: {e}", released=False)
            return
        with self._lock:
            self._inflight.pop(task.id, None)
        self.stats.tasks_completed += 1
        self.stats.completed_ids.append(task.id)
        if self.metrics is not None:
            self.metrics.tasks_completed.inc()
        rewards = [r.reward for r in rollouts]
        log.info(
            "task_completed",
            extra=fields(
                task=task.id,
                question=task.question_id,
                samples=len(rollouts),
                reward_mean=round(sum(rewards) / len(rewards), 4),
                policy_version=self.stats.loaded_version,
            ),
        )

    def _lost(self, task_id: int, why: str) -> None:
        with self._lock:
            self._inflight.pop(task_id, None)
        self.stats.tasks_lost += 1
        if self.metrics is not None:
            self.metrics.tasks_lost.inc()
        log.warning("task_dropped", extra=fields(task=task_id, reason=why))

    def _fail_back(self, tasks: list[TaskPublic], error: str, *, released: bool) -> None:
        for t in tasks:
            with self._lock:
                lease = self._inflight.pop(t.id, None)
            if lease is not None:
                self._fail_one(t.id, lease, error, released=released)

    def _fail_one(self, task_id: int, lease: _Lease, error: str, *, released: bool) -> None:
        if lease.lost:
            return
        try:
            self.client.fail_task(self.cfg.pool, task_id, lease.token, error, retry=True)
        except ExgrpoError as e:  # lease already gone, or the service is unreachable: it will expire
            log.warning("fail_task_failed", extra=fields(task=task_id, error=str(e)))
            return
        if released:
            self.stats.tasks_released += 1
        else:
            self.stats.tasks_failed += 1
        if self.metrics is not None:
            self.metrics.tasks_failed.inc()
        log.info("task_failed_back", extra=fields(task=task_id, error=error, retry=True))

    def _release_inflight(self, error: str) -> None:
        with self._lock:
            held = list(self._inflight.items())
            self._inflight.clear()
        for task_id, lease in held:
            self._fail_one(task_id, lease, error, released=True)

    # -------------------------------------------------------------------- lease thread hooks
    def _renew_all(self, client: Client) -> None:
        with self._lock:
            held = [(tid, lease) for tid, lease in self._inflight.items() if not lease.lost]
        for task_id, lease in held:
            try:
                client.renew_task(self.cfg.pool, task_id, lease.token, self.cfg.lease_seconds)
            except (Conflict, NotFound) as e:
                lease.lost = True
                log.warning("lease_lost", extra=fields(task=task_id, error=str(e)))
            except ExgrpoError as e:
                log.warning("renew_failed", extra=fields(task=task_id, error=str(e)))

    def _heartbeat(self, last: dict[str, float], interval: float) -> dict[str, float]:
        s = self.stats
        now = {
            "tokens": float(s.generated_tokens),
            "gen_s": s.generate_seconds,
            "grade_calls": float(s.grading_calls),
            "grade_s": s.grading_seconds,
            "done": float(s.tasks_completed),
        }
        d = {k: now[k] - last.get(k, 0.0) for k in now}
        with self._lock:
            inflight = len(self._inflight)
        log.info(
            "heartbeat",
            extra=fields(
                tasks_completed=s.tasks_completed,
                tasks_completed_interval=int(d["done"]),
                tasks_failed=s.tasks_failed,
                tasks_lost=s.tasks_lost,
                inflight=inflight,
                gen_tokens_per_s=round(d["tokens"] / d["gen_s"], 1) if d["gen_s"] > 0 else 0.0,
                wall_tokens_per_s=round(d["tokens"] / interval, 1) if interval > 0 else 0.0,
                grading_latency_ms=round(1000 * d["grade_s"] / d["grade_calls"], 1)
                if d["grade_calls"]
                else None,
                policy_version=s.loaded_version,
            ),
        )
        return now


class _LeaseKeeper:
    """Background thread: renews in-flight leases every lease/3 s and writes the heartbeat."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="exgrpo-lease-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        cfg = self.worker.cfg
        renew_every = cfg.lease_seconds / 3
        client = self.worker._client_factory()
        start = time.monotonic()
        next_renew, next_beat = start + renew_every, start + cfg.heartbeat_s
        last_beat = start
        last: dict[str, float] = {}
        try:
            while True:
                wait = max(0.0, min(next_renew, next_beat) - time.monotonic())
                if self._halt.wait(wait):
                    return
                now = time.monotonic()
                if now >= next_renew:
                    try:
                        self.worker._renew_all(client)
                    except Exception:  # never let the keeper die: leases would silently expire
                        log.exception("renew_loop_error")
                    next_renew = time.monotonic() + renew_every
                if now >= next_beat:
                    last = self.worker._heartbeat(last, now - last_beat)
                    last_beat, next_beat = now, now + cfg.heartbeat_s
        finally:
            client.close()


def run_worker(
    config: WorkerConfig,
    *,
    engine: EngineName = "transformers",
    model: str | None = None,
    url: str | None = None,
    token: str | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
    grading_workers: int = 2,
    device: str | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    torch_threads: int | None = None,
    vllm_options: dict[str, Any] | None = None,
) -> int:
    """Build the engine, grading pool and metrics, serve tasks until stopped (the `exgrpo rollout`
    command). Without `model`, the run's newest published policy is the model."""
    from exgrpo_rollout.engines.factory import load_engine
    from exgrpo_rollout.graders import GradingPool

    def client_factory() -> Client:
        return Client(url, token=token)

    loaded_version = -1
    if model is None:
        with client_factory() as c:
            versions = c.list_policy_versions(config.pool, config.run).data
        if not versions:
            raise ValueError(f"run {config.run!r} has no published policy version: give --model DIR")
        latest = max(versions, key=lambda v: v.version)
        model, loaded_version = path_from_uri(latest.uri), latest.version
    log.info("engine_loading", extra=fields(engine=engine, model=model))
    start = time.perf_counter()
    gen, tokenizer = load_engine(
        engine,
        model,
        device=device,
        dtype=dtype,
        seed=seed,
        torch_threads=torch_threads,
        vllm_options=vllm_options,
    )
    log.info("engine_ready", extra=fields(engine=engine, seconds=round(time.perf_counter() - start, 2)))
    metrics = None
    if metrics_port is not None:
        metrics = WorkerMetrics()
        metrics.serve(metrics_port, addr=metrics_host)
        log.info("metrics_serving", extra=fields(host=metrics_host, port=metrics_port))
    grading = GradingPool(grading_workers) if grading_workers > 0 else None
    try:
        worker = RolloutWorker(
            config,
            gen,
            tokenizer,
            client_factory=client_factory,
            grading=grading,
            metrics=metrics,
            loaded_version=loaded_version,
        )
        worker.install_signal_handlers()
        return worker.run()
    finally:
        if grading is not None:
            grading.close()
        if metrics is not None:
            metrics.close()
