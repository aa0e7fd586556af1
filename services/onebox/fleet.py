"""Rollout worker processes of a run: `exgrpo_rollout.worker.run_worker` in spawned processes, each
serving one trainer's run (the main job's `--workers N`, and tests of the disaggregated path with
real processes that can be killed).

    with WorkerFleet(url, cfg, model, folder, count=2) as fleet:   # starts, waits until each serves
        run_training(cfg, ...)                                      # rollout.engine=remote
    fleet.exit_codes                                                # after SIGTERM (then SIGKILL)

Each worker is started from `model` (the job's prepared model) and then loads, for every task,
exactly the policy version the task names (published by the trainer), with the task's sampling
settings; the sampling settings `worker_config` copies from the trainer config are only the
fallbacks for tasks that carry none. Worker `i` logs to `<folder>/w<i>.log` (stdout and stderr of
its process too, so a crash's traceback is there).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exgrpo_rollout.engines.factory import EngineName
    from exgrpo_rollout.worker import WorkerConfig
    from exgrpo_trainer import TrainConfig

STARTED_EVENT = "worker_started"
"""The log event of a worker whose engine is loaded and that claims tasks."""


def worker_config(cfg: TrainConfig, worker_id: str, *, lease_seconds: float = 60.0) -> WorkerConfig:
    """The worker settings serving the run of `cfg`: the trainer's grader and prompt rendering, its
    sampling settings as the fallback, its retry budget; short idle back-off and policy polling."""
    from exgrpo_rollout.worker import WorkerConfig

    r = cfg.rollout
    return WorkerConfig(
        pools=[cfg.run.pool],
        runs=[cfg.run.name],
        worker_id=worker_id,
        lease_seconds=lease_seconds,
        grader=r.grader,
        grading_timeout_s=r.grading_timeout_s,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        min_new_tokens=r.min_new_tokens,
        max_prompt_len=cfg.model.max_prompt_len,
        drop_system=cfg.model.drop_system_prompt,
        policy_poll_s=1.0,
        retry_budget_s=cfg.run.retry_budget_s,
        heartbeat_s=10.0,
        backoff_initial_s=0.2,
        backoff_max_s=0.5,
    )


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process runs (sent to the spawned process)."""

    config: WorkerConfig
    model: Path
    url: str
    log: Path
    log_format: str = "json"
    token: str | None = None
    grading_workers: int = 0
    torch_threads: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    engine: EngineName = "transformers"
    vllm_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword settings of `vllm.LLM` (engine vllm)."""


def serve(spec: WorkerSpec) -> None:
    """A worker process's body: its output to its log, the log format, then `run_worker` (SIGTERM
    stops it: it gives its in-flight tasks back and exits 0)."""
    os.environ.update(spec.env)
    fd = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from exgrpo_client.logs import configure_logging
    from exgrpo_rollout.worker import run_worker

    configure_logging("plain" if spec.log_format == "plain" else "json", "INFO")
    code = run_worker(
        spec.config,
        model=str(spec.model),
        url=spec.url,
        token=spec.token,
        grading_workers=spec.grading_workers,
        torch_threads=spec.torch_threads,
        engine=spec.engine,
        vllm_options=dict(spec.vllm_options) or None,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


class WorkerFleet:
    """`count` worker processes of one run, logs in `folder` (w1.log ... w<count>.log); `env`:
    environment variables set in each worker process.

    `start()` waits until every worker serves (`start_timeout_s`; a worker that exits first raises
    RuntimeError with its log's end); `stop()` sends SIGTERM (a worker fails its in-flight tasks
    back and exits 0), then SIGKILL after `stop_timeout_s`."""

    def __init__(
        self,
        url: str,
        cfg: TrainConfig,
        model: Path,
        folder: Path,
        *,
        count: int,
        log_format: str = "json",
        lease_seconds: float = 60.0,
        env: Mapping[str, str] | None = None,
        token: str | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
        engine: EngineName = "transformers",
        vllm_options: Mapping[str, Any] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"a fleet has at least one worker, got {count}")
        self.url, self.cfg, self.model, self.folder = url, cfg, model, folder
        self.names = [f"w{i}" for i in range(1, count + 1)]
        self.log_format = log_format
        self.lease_seconds = lease_seconds
        self.env = dict(env or {})
        self.token = token
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.engine: EngineName = engine
        self.vllm_options = dict(vllm_options or {})
        self.procs: dict[str, BaseProcess] = {}
        self.exit_codes: dict[str, int] = {}
        self._offsets: dict[str, int] = {}

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def spec(self, name: str) -> WorkerSpec:
        return WorkerSpec(
            config=worker_config(self.cfg, name, lease_seconds=self.lease_seconds),
            model=self.model,
            url=self.url,
            log=self.log(name),
            log_format=self.log_format,
            token=self.token,
            grading_workers=self.cfg.rollout.grading_workers,
            torch_threads=1 if self.engine == "transformers" and (os.cpu_count() or 1) <= 2 else None,
            env=self.env,
            engine=self.engine,
            vllm_options=self.vllm_options,
        )

    def launch(self, name: str) -> BaseProcess:
        """Start worker `name` (again, after it died: its log is appended to). A spawned process:
        nothing of this one (threads, the embedded service, torch's state) is copied into it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.log(name)
        self._offsets[name] = log.stat().st_size if log.exists() else 0
        proc = multiprocessing.get_context("spawn").Process(target=serve, args=(self.spec(name),), name=name)
        proc.start()
        self.procs[name] = proc
        return proc

    def start(self) -> WorkerFleet:
        for name in self.names:
            self.launch(name)
        self.wait_serving(self.names)
        return self

    def wait_serving(self, names: list[str]) -> None:
        """Until each of `names` logged that it serves since its latest start."""
        end = time.monotonic() + self.start_timeout_s
        waiting = set(names)
        while waiting:
            for name in sorted(waiting):
                text = ""
                if self.log(name).exists():  # the process opens it as it starts
                    with self.log(name).open("rb") as f:
                        f.seek(self._offsets[name])
                        text = f.read().decode(errors="replace")
                if STARTED_EVENT in text:
                    waiting.discard(name)
                elif not self.procs[name].is_alive():
                    raise RuntimeError(
                        f"rollout worker {name} exited with {self.procs[name].exitcode} before serving; "
                        f"its log ({self.log(name)}) ends:\n{text[-3000:]}"
                    )
            if waiting and time.monotonic() > end:
                raise RuntimeError(
                    f"rollout workers {sorted(waiting)} did not start in {self.start_timeout_s:.0f} s"
                )
            time.sleep(0.2)

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.is_alive()]

    def kill9(self, name: str) -> None:
        """SIGKILL worker `name` (a crashed worker: its leases expire, its tasks go back)."""
        proc = self.procs[name]
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=30)

    def stop(self) -> dict[str, int]:
        """SIGTERM to every running worker, SIGKILL to those still running after `stop_timeout_s`;
        the exit codes (-9 for a killed one)."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()  # SIGTERM
        end = time.monotonic() + self.stop_timeout_s
        for name, proc in self.procs.items():
            proc.join(timeout=max(0.1, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=30)
            self.exit_codes[name] = -int(signal.SIGKILL) if proc.exitcode is None else proc.exitcode
        return self.exit_codes

    def __enter__(self) -> WorkerFleet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
