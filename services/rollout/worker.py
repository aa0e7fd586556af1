"""Rollout worker: claims generation tasks from one or more pools, generates each task with the
policy version it names, grades, completes. One worker (one GPU) can serve every run of a pool.

The loop, one iteration:

1. claim up to `tasks_per_claim` tasks with a lease of `lease_seconds` from the next pool, in turn
   (a pool-wide claim over the configured runs, or all of them: the service picks the run of each
   answer fairly; with a single run, that run's own claim). Nothing in any pool: sleep with
   exponential back-off and jitter (capped), then start over;
2. group the claimed tasks by (run, policy version, exact or not, sampling settings) and, per group,
   make the engine hold the right weights (`choose_policy`):
   - an exact task (synchronous mode) is generated with exactly its `policy_version` of its run,
     loaded from the task's `policy_uri` (or the run's list of published versions). It is never
     generated with other weights: a version that cannot be found or loaded fails the group back
     (retry) with the reason;
   - an asynchronous task (`policy_exact` false; its `policy_version` is the oldest allowed) keeps
     the loaded weights when they are of the same pool and run and at least that version, else the
     run's newest published version is loaded;
   what the engine holds is tracked as (pool, run, version): runs have weights of their own;
3. render each task's prompt with the model's chat template (`exgrpo_rollout.prompts`), generate
   `task.num_samples` samples per task with the task's sampling settings (the worker's own settings
   only for tasks that carry none; one engine call per distinct sample count), grade them
   (a `GradingPool` with hard time limits, or in process);
4. complete each task with its rollouts (token ids, the sampler's log-probs, reward, mean entropy,
   finish reason) and the policy version they were generated with.

Weights always go through `RolloutWorker._load_policy(uri)` (`exgrpo_rollout.weights.load_policy`).

Leases: a background thread renews the lease of every in-flight task every `lease_seconds / 3`.
If a renewal or the completion answers 409 the lease was lost (it expired and another worker took
the task): the result is dropped, the other worker's counts. A worker that dies without a word
loses nothing either: its leases expire and the tasks go back to the queue.

Pool outages: the worker's clients retry connection errors and 429/502/503/504 answers with back-off
for up to `retry_budget_s` per call. A claim, renewal or completion still failing after that is
logged and the loop goes on: the worker never exits because the pool was unreachable. A completion
is sent again with the same lease token (the service answers a repeated completion idempotently)
until it gets an answer. Only refusals no retry can change (bad names, settings or token: 4xx other
than 409 and 429) stop the worker.

Stopping: SIGTERM or SIGINT (see `install_signal_handlers`) stops claiming, interrupts a claim,
generation or grading, fails the in-flight tasks back with `retry=true` (they are pending again at
once, their attempt counted) and makes `run()` return 0. `request_stop()` does the same from another
thread, without interrupting an engine call.

The same thread emits a heartbeat log line every `heartbeat_s` (tasks done, per run too, generation
tokens/s, grading latency, loaded policy). Logs are structured (`exgrpo_rollout.logs`); Prometheus
metrics are optional (`WorkerMetrics`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

from exgrpo_client import Client, rollout
from exgrpo_client.errors import APIError, Conflict, ExgrpoError, NotFound
from exgrpo_client.schemas import PolicyVersionPublic, RolloutResult, SamplingParams, TaskPublic
from exgrpo_rollout.engines.base import Completion, GenerationEngine, SamplingConfig
from exgrpo_rollout.logs import fields
from exgrpo_rollout.prompts import render_prompt
from exgrpo_rollout.weights import fetch_model_dir, load_policy, path_from_uri

if TYPE_CHECKING:
    from exgrpo_rollout.engines.factory import EngineName
    from exgrpo_rollout.graders import Grade, GradingPool

__all__ = [
    "PolicyChoice",
    "RolloutWorker",
    "TaskGroup",
    "Weights",
    "WorkerConfig",
    "WorkerMetrics",
    "WorkerStats",
    "choose_policy",
    "default_worker_id",
    "group_tasks",
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
    pools: list[str]
    """Pools to serve; each claim asks the next one in turn."""
    runs: list[str] | None = None
    """Runs to serve in every pool (None: all of the pool's runs, chosen fairly by the service)."""
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
    """Sampling settings: used only for tasks that carry none (tasks carry the trainer's)."""
    top_p: float = 1.0
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    max_prompt_len: int | None = 1024
    """Prompts are cut from the left to this many tokens (the trainer's model.max_prompt_len)."""
    drop_system: bool = False
    """Drop system messages before the chat template (training keeps them)."""
    policy_poll_s: float = 10.0
    """Seconds a run's list of published versions is reused before it is asked for again."""
    retry_budget_s: float = 600.0
    """Seconds one pool call keeps retrying through an outage before the worker logs it and goes on."""
    heartbeat_s: float = 30.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_consecutive_errors: int = 3
    """Engine failures in a row (tasks failed back each time) before the worker gives up."""
    test_delay_s: float = 0.0
    """Test hook (EXGRPO_WORKER_TEST_DELAY_S): wait this long after claiming."""

    def __post_init__(self) -> None:
        if not self.pools or len(set(self.pools)) != len(self.pools):
            raise ValueError(f"pools: give one or more distinct pool names, got {self.pools!r}")
        if self.runs is not None and (not self.runs or len(set(self.runs)) != len(self.runs)):
            raise ValueError(
                f"runs: give one or more distinct run names (or None: all runs), got {self.runs!r}"
            )
        if self.lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        if self.tasks_per_claim < 1:
            raise ValueError("tasks_per_claim must be >= 1")
        if self.max_tasks is not None and self.max_tasks < 1:
            raise ValueError("max_tasks must be >= 1")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.retry_budget_s < 0:
            raise ValueError("retry_budget_s must be >= 0")
        # fail on bad sampling settings here, not at the first task
        SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
        )

    def sampling(self, n: int, asked: SamplingParams | None) -> SamplingConfig:
        """Engine settings for `n` samples per prompt: the task's own (`asked`), else this config's.
        ValueError for settings the engines cannot sample with (temperature 0)."""
        if asked is None:
            temperature, top_p = self.temperature, self.top_p
            max_new, min_new = self.max_new_tokens, self.min_new_tokens
        else:
            temperature, top_p = asked.temperature, asked.top_p
            max_new, min_new = asked.max_tokens, asked.min_tokens
        return SamplingConfig(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new,
            min_new_tokens=min(min_new, max_new),
        )


@dataclass
class WorkerStats:
    tasks_completed: int = 0
    tasks_failed: int = 0
    """Failed back to the queue after an engine error, or because their policy could not be loaded."""
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
    """Version the engine holds (-1: the weights the worker started with, or none known)."""
    completed_ids: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)
    """Attempt number of each claimed task (as counted by the service at the claim)."""
    generated_with: dict[int, int | None] = field(default_factory=dict)
    """Policy version each completed task was generated with (None: the start model, unversioned)."""
    completed_by_run: dict[str, int] = field(default_factory=dict)
    """Tasks completed per `pool/run`."""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0


# ------------------------------------------------------------------------- policies of task groups
@dataclass(frozen=True)
class Weights:
    """What the engine holds: version `version` of run `pool`/`run`, published at `uri`; or the model
    the worker started with (`run` None, version -1: no published version of any run)."""

    pool: str | None
    run: str | None
    version: int
    uri: str | None

    @property
    def published(self) -> bool:
        return self.run is not None

    @property
    def label(self) -> str:
        return f"{self.pool}/{self.run}@v{self.version}" if self.published else "start model"


SamplingKey = tuple[float, float, int, int] | None


@dataclass
class TaskGroup:
    """Claimed tasks generated together: same run, policy version, exactness and sampling settings."""

    pool: str
    run: str
    policy_version: int
    policy_exact: bool
    sampling: SamplingParams | None
    tasks: list[TaskPublic]

    @property
    def policy_uri(self) -> str | None:
        return next((t.policy_uri for t in self.tasks if t.policy_uri), None)


def _sampling_key(p: SamplingParams | None) -> SamplingKey:
    return None if p is None else (p.temperature, p.top_p, p.max_tokens, p.min_tokens)


def group_tasks(pool: str, tasks: Sequence[TaskPublic]) -> list[TaskGroup]:
    """The tasks of one claim by (run, policy version, exact, sampling), in order of first appearance."""
    groups: dict[tuple[str, int, bool, SamplingKey], TaskGroup] = {}
    for t in tasks:
        key = (t.run, t.policy_version, t.policy_exact, _sampling_key(t.sampling))
        if key not in groups:
            groups[key] = TaskGroup(pool, t.run, t.policy_version, t.policy_exact, t.sampling, [])
        groups[key].tasks.append(t)
    return list(groups.values())


@dataclass(frozen=True)
class PolicyChoice:
    """How to serve a group: with the loaded weights (`keep`), after loading `weights` (`load`), or
    not at all (`refuse`: the group is failed back with `error`)."""

    action: Literal["keep", "load", "refuse"]
    weights: Weights | None = None
    error: str = ""


def choose_policy(
    group: TaskGroup,
    loaded: Weights | None,
    published: Sequence[PolicyVersionPublic] | None,
    start: Weights | None = None,
) -> PolicyChoice:
    """The weights to generate `group` with.

    `loaded`: what the engine holds (None: unknown, after a failed load). `published`: the run's
    published versions (None: not known). `start`: the model the worker started with, if it can be
    loaded again. An exact group gets exactly its version of its run, or is refused; an asynchronous
    one keeps the loaded weights if they are of its run and at least its version, else gets the run's
    newest published version. A run that has published nothing at all is served with the start
    model (the only policy there is); its completions then name no version."""
    pool, run, version = group.pool, group.run, group.policy_version
    same_run = loaded is not None and loaded.published and (loaded.pool, loaded.run) == (pool, run)
    known = list(published or ())
    if group.policy_exact:
        if same_run and loaded is not None and loaded.version == version:
            return PolicyChoice("keep", loaded)
        uri = group.policy_uri or next((p.uri for p in known if p.version == version), None)
        if uri is not None:
            return PolicyChoice("load", Weights(pool, run, version, uri))
    else:
        if same_run and loaded is not None and loaded.version >= version:
            return PolicyChoice("keep", loaded)
        newest = max((p for p in known if p.version >= version), key=lambda p: p.version, default=None)
        if newest is not None:
            return PolicyChoice("load", Weights(pool, run, newest.version, newest.uri))
        if group.policy_uri is not None:
            return PolicyChoice("load", Weights(pool, run, version, group.policy_uri))
    where = f"run {pool}/{run}"
    if published is None:
        return PolicyChoice(
            "refuse", error=f"policy version {version} of {where}: its published versions could not be listed"
        )
    if not known:
        if loaded is not None and not loaded.published:
            return PolicyChoice("keep", loaded)
        if start is not None and start.uri is not None:
            return PolicyChoice("load", start)
        return PolicyChoice(
            "refuse",
            error=f"{where} has published no policy version and this worker no longer holds the "
            "model it started with",
        )
    newest_version = max(p.version for p in known)
    if group.policy_exact:
        error = (
            f"policy version {version} of {where} is not published (newest: {newest_version}); "
            "an exact task is generated with its own version only"
        )
    else:
        error = f"{where} has no published policy version >= {version} (newest: {newest_version})"
    return PolicyChoice("refuse", error=error)


class _PolicyUnavailable(Exception):
    """The weights a task group needs could not be found or loaded."""


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
    pool: str
    lost: bool = False


def _definite(e: ExgrpoError) -> bool:
    """A refusal no retry changes: a 4xx other than 409 (state) and 429 (load)."""
    return isinstance(e, APIError) and 400 <= e.status < 500 and e.status not in (409, 429)


class RolloutWorker:
    """One worker: an engine, its tokenizer, and the pools (and runs) it serves.

    `client_factory` builds `exgrpo_client.Client`s: one for the main loop, one for the lease thread.
    `grading` is a `GradingPool` (hard per-item time limits in child processes), or None to grade
    in this process. `loaded` is what the engine holds at start: a published version of a run, or
    (default) the model it was built from, whose `uri` (if given) lets the worker load it again
    for runs that have published nothing.
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
        loaded: Weights | None = None,
    ) -> None:
        self.cfg = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.grading = grading
        self.metrics = metrics
        self.loaded: Weights | None = loaded if loaded is not None else Weights(None, None, -1, None)
        """What the engine holds (None: unknown, after a load that failed half-way)."""
        self._start = None if self.loaded.published else self.loaded
        self.stats = WorkerStats(loaded_version=self.loaded.version)
        self._client_factory = client_factory
        self.client = client_factory()
        self._inflight: dict[int, _Lease] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._can_interrupt = False
        self._versions: dict[tuple[str, str], tuple[float, list[PolicyVersionPublic]]] = {}
        self._next_pool = 0
        self._empty_streak = 0
        self._idle_since: float | None = None
        self._errors_in_row = 0
        self._keeper = _LeaseKeeper(self)
        if metrics is not None:
            metrics.policy_version.set(self.loaded.version)

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
    def _interruptible(self, *, unless_stopping: bool = True) -> Iterator[None]:
        """A stop signal raises `_Shutdown` inside the block; `unless_stopping`: so does entering it
        once a stop was requested."""
        self._can_interrupt = True
        try:
            if unless_stopping and self._stopping:
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
                pools=self.cfg.pools,
                runs=self.cfg.runs if self.cfg.runs is not None else "all",
                engine=getattr(self.engine, "name", type(self.engine).__name__),
                grader=self.cfg.grader,
                lease_seconds=self.cfg.lease_seconds,
                retry_budget_s=self.cfg.retry_budget_s,
                policy=self._label(),
            ),
        )
        self._keeper.start()
        try:
            while not self._stopping and not self._done():
                with self._interruptible():
                    pool, tasks = self._claim()
                if tasks:
                    self._process(pool, tasks)
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
                    runs=dict(s.completed_by_run),
                    generated_tokens=s.generated_tokens,
                    tokens_per_s=round(s.tokens_per_second, 1),
                    policy=self._label(),
                    policy_reloads=s.policy_reloads,
                ),
            )
        return 0

    def _label(self) -> str:
        return "unknown" if self.loaded is None else self.loaded.label

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

    def _claim(self) -> tuple[str, list[TaskPublic]]:
        """Claim from the pools in turn, starting after the one that gave tasks last; the first
        pool with tasks answers. Refusals no retry can change (unknown pool or run, bad settings or
        token) raise; anything else (the pool unreachable past the retry budget) is logged."""
        want = self.cfg.tasks_per_claim
        if self.cfg.max_tasks is not None:
            want = min(want, self.cfg.max_tasks - self.stats.tasks_completed)
        pools = self.cfg.pools
        for i in range(len(pools)):
            index = (self._next_pool + i) % len(pools)
            pool = pools[index]
            try:
                tasks = self._claim_from(pool, want)
            except ExgrpoError as e:
                if _definite(e):
                    raise
                log.warning("claim_failed", extra=fields(pool=pool, error=str(e)))
                continue
            if tasks:
                self._next_pool = (index + 1) % len(pools)
                self._claimed(pool, tasks)
                return pool, tasks
        return "", []

    def _claim_from(self, pool: str, want: int) -> list[TaskPublic]:
        cfg = self.cfg
        if cfg.runs is not None and len(cfg.runs) == 1:  # the run's own claim (any service version)
            return list(
                self.client.claim_tasks(pool, cfg.runs[0], cfg.worker_id, want, cfg.lease_seconds).data
            )
        claimed = self.client.claim_pool_tasks(pool, cfg.worker_id, want, cfg.lease_seconds, runs=cfg.runs)
        return list(claimed.data)

    def _claimed(self, pool: str, tasks: list[TaskPublic]) -> None:
        self._empty_streak = 0
        self._idle_since = None
        with self._lock:
            for t in tasks:
                assert t.lease_token is not None, "claimed tasks carry a lease token"
                self._inflight[t.id] = _Lease(t.lease_token, pool)
                self.stats.attempts[t.id] = t.attempts
        log.info(
            "tasks_claimed",
            extra=fields(
                pool=pool,
                runs=sorted({t.run for t in tasks}),
                tasks=[t.id for t in tasks],
                attempts=[t.attempts for t in tasks],
                policy_versions=sorted({t.policy_version for t in tasks}),
            ),
        )

    # ------------------------------------------------------------------------------- policy
    def _published(self, pool: str, run: str, *, fresh: bool) -> list[PolicyVersionPublic] | None:
        """The run's published versions, reused for `policy_poll_s` unless `fresh`. Through an
        outage the pool is asked again until it answers; None when it refuses or the worker stops."""
        cached = self._versions.get((pool, run))
        if not fresh and cached is not None and time.monotonic() < cached[0]:
            return cached[1]
        delay = self.cfg.backoff_initial_s
        while True:
            try:
                versions = list(self.client.list_policy_versions(pool, run).data)
                break
            except ExgrpoError as e:
                again = not (_definite(e) or self._stopping)
                log.warning("policy_list_failed", extra=fields(pool=pool, run=run, error=str(e), retry=again))
                if not again:
                    return None
                delay = self._pause(delay)
        self._versions[(pool, run)] = (time.monotonic() + self.cfg.policy_poll_s, versions)
        return versions

    def _pause(self, delay: float) -> float:
        """Back-off between two tries of a call that failed through an outage; the next delay."""
        self._sleep(delay * random.uniform(0.5, 1.0))
        return min(self.cfg.backoff_max_s, delay * 2)

    def choose(self, group: TaskGroup) -> PolicyChoice:
        """`choose_policy` for a group, asking the pool for the run's versions only when needed:
        not for a group the loaded weights serve, nor for an exact task that names its uri."""
        choice = choose_policy(group, self.loaded, None, self._start)
        if choice.action == "keep" or (group.policy_exact and choice.action == "load"):
            return choice
        choice = choose_policy(
            group, self.loaded, self._published(group.pool, group.run, fresh=False), self._start
        )
        if choice.action == "refuse":  # the list may be older than the task: ask again
            fresh = self._published(group.pool, group.run, fresh=True)
            choice = choose_policy(group, self.loaded, fresh, self._start)
        return choice

    def _prepare_policy(self, group: TaskGroup) -> Weights:
        """Make the engine hold the weights `group` must be generated with; `_PolicyUnavailable`
        when they cannot be found or loaded (the engine then holds no known weights)."""
        choice = self.choose(group)
        if choice.action == "refuse" or choice.weights is None:
            raise _PolicyUnavailable(choice.error)
        target = choice.weights
        if choice.action == "keep":
            return target
        assert target.uri is not None
        start = time.perf_counter()
        self.loaded = None  # a load cut short leaves weights of no known version
        self.stats.loaded_version = -1
        try:
            self._load_policy(target.uri)
        except Exception as e:
            log.error(
                "policy_load_failed",
                extra=fields(
                    pool=target.pool,
                    run=target.run,
                    version=target.version,
                    uri=target.uri,
                    error=f"{type(e).__name__}: {e}",
                ),
            )
            what = target.label if target.published else f"the start model ({target.uri})"
            raise _PolicyUnavailable(
                f"loading {what} from {target.uri} failed: {type(e).__name__}: {e}"
            ) from e
        self.loaded = target
        self.stats.loaded_version = target.version
        self.stats.policy_reloads += 1
        if self.metrics is not None:
            self.metrics.policy_version.set(target.version)
        log.info(
            "policy_loaded",
            extra=fields(
                pool=target.pool,
                run=target.run,
                version=target.version,
                uri=target.uri,
                seconds=round(time.perf_counter() - start, 3),
            ),
        )
        return target

    def _load_policy(self, uri: str) -> None:
        """The one way weights get into the engine (the transfer lives in `exgrpo_rollout.weights`)."""
        load_policy(self.engine, uri)

    # -------------------------------------------------------------------------------- tasks
    def _process(self, pool: str, tasks: list[TaskPublic]) -> None:
        if self.cfg.test_delay_s > 0:
            with self._interruptible():
                self._sleep(self.cfg.test_delay_s)
        if self._stopping:
            raise _Shutdown()
        for group in group_tasks(pool, tasks):
            if self._stopping:
                raise _Shutdown()
            self._serve(group)

    def _serve(self, group: TaskGroup) -> None:
        tasks = group.tasks
        try:
            samplings = {t.num_samples: self.cfg.sampling(t.num_samples, group.sampling) for t in tasks}
        except ValueError as e:  # settings no engine here samples with: no worker will do better
            self._fail_back(tasks, f"sampling settings {group.sampling}: {e}", released=False, retry=False)
            return
        try:
            with self._interruptible():
                weights = self._prepare_policy(group)
        except _PolicyUnavailable as e:
            log.error(
                "policy_unavailable",
                extra=fields(pool=group.pool, run=group.run, version=group.policy_version, error=str(e)),
            )
            self._fail_back(tasks, str(e), released=False)
            return
        try:
            with self._interruptible():
                results = self._generate_and_grade(tasks, samplings)
        except Exception as e:
            self._errors_in_row += 1
            log.exception("generation_failed", extra=fields(tasks=[t.id for t in tasks]))
            self._fail_back(tasks, f"{type(e).__name__}: {e}", released=False)
            if self._errors_in_row >= self.cfg.max_consecutive_errors:
                raise RuntimeError(f"{self._errors_in_row} engine failures in a row; last: {e}") from e
            return
        self._errors_in_row = 0
        version = weights.version if weights.published else None
        for task, rollouts in zip(tasks, results, strict=True):
            self._complete(group.pool, task, rollouts, version)

    def _generate_and_grade(
        self, tasks: list[TaskPublic], samplings: dict[int, SamplingConfig]
    ) -> list[list[RolloutResult]]:
        cfg = self.cfg
        prompts = [
            render_prompt(self.tokenizer, t.prompt, cfg.drop_system, cfg.max_prompt_len) for t in tasks
        ]
        completions: list[list[Completion]] = [[] for _ in tasks]
        by_n: dict[int, list[int]] = {}
        for i, t in enumerate(tasks):
            by_n.setdefault(t.num_samples, []).append(i)
        for n, idx in by_n.items():
            start = time.perf_counter()
            out = self.engine.generate([prompts[i] for i in idx], samplings[n])
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

    def _complete(
        self, pool: str, task: TaskPublic, rollouts: list[RolloutResult], version: int | None
    ) -> None:
        """Send the result; through an outage, again with the same lease token until the pool
        answers (a repeated completion is answered idempotently), the lease is lost or the worker stops."""
        delay = self.cfg.backoff_initial_s
        while True:
            with self._lock:
                lease = self._inflight.get(task.id)
            if lease is None or lease.lost:
                self._lost(task.id, "lease lost before completion")
                return
            try:
                # a result in hand is sent even after a stop request; a stop signal cuts a call
                # that is riding through an outage short (the task is then failed back, or expires)
                with self._interruptible(unless_stopping=False):
                    self.client.complete_task(pool, task.id, lease.token, rollouts, policy_version=version)
                break
            except NotFound as e:
                self._lost(task.id, str(e))
                return
            except Conflict as e:  # lease lost, or (never by construction) the version refused
                self._refused(pool, task, lease, e)
                return
            except ExgrpoError as e:
                if _definite(e):
                    log.error("complete_failed", extra=fields(task=task.id, error=str(e)))
                    self._fail_back([task], f"completion refused: {e}", released=False)
                    return
                if self._stopping:  # leave it: the lease expires and the task is redone
                    log.warning("complete_abandoned", extra=fields(task=task.id, error=str(e)))
                    return
                log.warning("complete_retry", extra=fields(task=task.id, error=str(e)))
                delay = self._pause(delay)
        with self._lock:
            self._inflight.pop(task.id, None)
        s = self.stats
        s.tasks_completed += 1
        s.completed_ids.append(task.id)
        s.generated_with[task.id] = version
        key = f"{pool}/{task.run}"
        s.completed_by_run[key] = s.completed_by_run.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.tasks_completed.inc()
        rewards = [r.reward for r in rollouts]
        log.info(
            "task_completed",
            extra=fields(
                pool=pool,
                run=task.run,
                task=task.id,
                question=task.question_id,
                samples=len(rollouts),
                reward_mean=round(sum(rewards) / len(rewards), 4),
                policy_version=version,
                policy_exact=task.policy_exact,
            ),
        )

    def _refused(self, pool: str, task: TaskPublic, lease: _Lease, e: Conflict) -> None:
        """A 409 on completion: usually the lease was lost; if the pool still holds the task for
        this worker (the completion itself was refused), fail it back instead of sitting on it."""
        with self._lock:
            self._inflight.pop(task.id, None)
        try:
            self.client.fail_task(pool, task.id, lease.token, f"completion refused: {e}", retry=True)
        except ExgrpoError:
            self._lost(task.id, str(e))
            return
        log.error("complete_refused", extra=fields(task=task.id, error=str(e)))
        self._count_failed(task.id, f"completion refused: {e}", released=False, retry=True)

    def _lost(self, task_id: int, why: str) -> None:
        with self._lock:
            self._inflight.pop(task_id, None)
        self.stats.tasks_lost += 1
        if self.metrics is not None:
            self.metrics.tasks_lost.inc()
        log.warning("task_dropped", extra=fields(task=task_id, reason=why))

    def _fail_back(self, tasks: list[TaskPublic], error: str, *, released: bool, retry: bool = True) -> None:
        for t in tasks:
            with self._lock:
                lease = self._inflight.pop(t.id, None)
            if lease is not None:
                self._fail_one(t.id, lease, error, released=released, retry=retry)

    def _fail_one(
        self, task_id: int, lease: _Lease, error: str, *, released: bool, retry: bool = True
    ) -> None:
        if lease.lost:
            return
        try:
            self.client.fail_task(lease.pool, task_id, lease.token, error, retry=retry)
        except ExgrpoError as e:  # lease already gone, or the service is unreachable: it will expire
            log.warning("fail_task_failed", extra=fields(task=task_id, error=str(e)))
            return
        self._count_failed(task_id, error, released=released, retry=retry)

    def _count_failed(self, task_id: int, error: str, *, released: bool, retry: bool) -> None:
        if released:
            self.stats.tasks_released += 1
        else:
            self.stats.tasks_failed += 1
        if self.metrics is not None:
            self.metrics.tasks_failed.inc()
        log.info("task_failed_back", extra=fields(task=task_id, error=error, retry=retry))

    def _release_inflight(self, error: str) -> None:
        """Fail the in-flight tasks back. Through an outage this can take a retry budget per task:
        a stop signal meanwhile abandons it (the leases then expire and the tasks are redone)."""
        with self._lock:
            held = list(self._inflight.items())
            self._inflight.clear()
        done = 0
        try:
            with self._interruptible(unless_stopping=False):
                for task_id, lease in held:
                    self._fail_one(task_id, lease, error, released=True)
                    done += 1
        except _Shutdown:
            log.warning("release_abandoned", extra=fields(tasks=[t for t, _ in held[done:]]))

    # -------------------------------------------------------------------- lease thread hooks
    def _renew_all(self, client: Client) -> None:
        with self._lock:
            held = [(tid, lease) for tid, lease in self._inflight.items() if not lease.lost]
        for task_id, lease in held:
            try:
                client.renew_task(lease.pool, task_id, lease.token, self.cfg.lease_seconds)
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
                runs=dict(s.completed_by_run),
                tasks_failed=s.tasks_failed,
                tasks_lost=s.tasks_lost,
                inflight=inflight,
                gen_tokens_per_s=round(d["tokens"] / d["gen_s"], 1) if d["gen_s"] > 0 else 0.0,
                wall_tokens_per_s=round(d["tokens"] / interval, 1) if interval > 0 else 0.0,
                grading_latency_ms=round(1000 * d["grade_s"] / d["grade_calls"], 1)
                if d["grade_calls"]
                else None,
                policy=self._label(),
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


def newest_published(client: Client, config: WorkerConfig) -> Weights | None:
    """The most recently published policy version among the runs `config` serves (None: none)."""
    best: tuple[PolicyVersionPublic, str, str] | None = None
    for pool in config.pools:
        runs = config.runs if config.runs is not None else [r.name for r in client.list_runs(pool).data]
        for run in runs:
            for v in client.list_policy_versions(pool, run).data:
                if best is None or (v.created_at, v.version) > (best[0].created_at, best[0].version):
                    best = (v, pool, run)
    if best is None:
        return None
    v, pool, run = best
    return Weights(pool, run, v.version, v.uri)


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
    command). Without `model`, the newest policy published by the served runs is the model."""
    from exgrpo_rollout.engines.factory import load_engine
    from exgrpo_rollout.graders import GradingPool

    def client_factory() -> Client:
        return Client(url, token=token, retry_budget_s=config.retry_budget_s)

    if model is None:
        with client_factory() as c:
            loaded = newest_published(c, config)
        if loaded is None or loaded.uri is None:
            raise ValueError(
                f"no run served ({', '.join(config.pools)}; runs: {config.runs or 'all'}) has a published "
                "policy version to start from: give --model DIR"
            )
        # a file:// policy is its folder; an http:// or shm:// one is written to a temporary folder
        # once, to build the engine from (the engine holds the weights in memory afterwards)
        start_dir = Path(tempfile.mkdtemp(prefix="exgrpo-worker-start-"))
        model = str(fetch_model_dir(loaded.uri, start_dir))
    else:
        loaded = Weights(None, None, -1, model)
        start_dir = None
    log.info("engine_loading", extra=fields(engine=engine, model=model))
    start = time.perf_counter()
    try:
        gen, tokenizer = load_engine(
            engine,
            model,
            device=device,
            dtype=dtype,
            seed=seed,
            torch_threads=torch_threads,
            vllm_options=vllm_options,
        )
    finally:
        if start_dir is not None:
            shutil.rmtree(start_dir, ignore_errors=True)
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
            loaded=loaded,
        )
        worker.install_signal_handlers()
        return worker.run()
    finally:
        if grading is not None:
            grading.close()
        if metrics is not None:
            metrics.close()
