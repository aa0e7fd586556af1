"""Rollout worker processes of a run: `exgrpo rollout` children serving one trainer's run (the main
job's `--workers N`, and tests that run the disaggregated path with real processes).

    with WorkerFleet(url, cfg, model, folder, count=2) as fleet:   # starts, waits until each serves
        run_training(cfg, ...)                                      # rollout.engine=remote
    fleet.exit_codes                                                # after SIGTERM (then SIGKILL)

Each worker is started from `model` (the job's prepared model) and then loads, for every task,
exactly the policy version the task names (published by the trainer), with the task's sampling
settings; the flags built here from the trainer config are only the fallbacks the worker uses for
tasks that carry none. Worker `i` logs to `<folder>/w<i>.log`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from exgrpo_trainer.config import TrainConfig

STARTED_EVENT = "worker_started"
"""The log event of a worker whose engine is loaded and that claims tasks."""


def worker_command(
    url: str,
    cfg: TrainConfig,
    worker_id: str,
    model: Path,
    *,
    lease_seconds: float = 60.0,
    log_format: str = "json",
    extra: list[str] | None = None,
) -> list[str]:
    """`exgrpo rollout` serving the run of `cfg` on `url`, started from `model`: the trainer's
    grader and prompt rendering, its sampling settings as the fallback, its retry budget."""
    r = cfg.rollout
    threads = ["--torch-threads", "1"] if (os.cpu_count() or 1) <= 2 else []
    return [
        sys.executable, "-m", "exgrpo_cli.main", "--url", url, "rollout",
        "--pool", cfg.run.pool, "--run", cfg.run.name, "--model", str(model),
        "--worker-id", worker_id, "--grader", r.grader, "--grading-workers", str(r.grading_workers),
        "--temperature", str(r.temperature), "--top-p", str(r.top_p),
        "--max-new-tokens", str(r.max_new_tokens), "--min-new-tokens", str(r.min_new_tokens),
        "--max-prompt-len", str(cfg.model.max_prompt_len),
        *(["--drop-system"] if cfg.model.drop_system_prompt else []),
        "--lease-seconds", str(lease_seconds), "--backoff-max", "0.5", "--policy-poll", "1",
        "--heartbeat", "10", "--retry-budget-s", str(cfg.run.retry_budget_s),
        "--log-format", log_format, *threads, *(extra or []),
    ]  # fmt: skip


class WorkerFleet:
    """`count` worker processes of one run, logs in `folder` (w1.log ... w<count>.log).

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
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        if count < 1:
            raise ValueError(f"a fleet has at least one worker, got {count}")
        self.url, self.cfg, self.model, self.folder = url, cfg, model, folder
        self.names = [f"w{i}" for i in range(1, count + 1)]
        self.log_format = log_format
        self.lease_seconds = lease_seconds
        self.env = env
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exit_codes: dict[str, int] = {}
        self._offsets: dict[str, int] = {}

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def command(self, name: str) -> list[str]:
        return worker_command(
            self.url, self.cfg, name, self.model, lease_seconds=self.lease_seconds, log_format=self.log_format
        )

    def launch(self, name: str) -> subprocess.Popen[bytes]:
        """Start worker `name` (again, after it died: its log is appended to)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.log(name)
        self._offsets[name] = log.stat().st_size if log.exists() else 0
        with log.open("ab") as out:
            proc = subprocess.Popen(self.command(name), stdout=out, stderr=subprocess.STDOUT, env=self.env)
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
                with self.log(name).open("rb") as f:
                    f.seek(self._offsets[name])
                    text = f.read().decode(errors="replace")
                if STARTED_EVENT in text:
                    waiting.discard(name)
                elif self.procs[name].poll() is not None:
                    raise RuntimeError(
                        f"rollout worker {name} exited with {self.procs[name].returncode} before serving; "
                        f"its log ({self.log(name)}) ends:\n{text[-3000:]}"
                    )
            if waiting and time.monotonic() > end:
                raise RuntimeError(
                    f"rollout workers {sorted(waiting)} did not start in {self.start_timeout_s:.0f} s"
                )
            time.sleep(0.2)

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def kill9(self, name: str) -> None:
        """SIGKILL worker `name` (a crashed worker: its leases expire, its tasks go back)."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self) -> dict[str, int]:
        """SIGTERM to every running worker, SIGKILL to those still running after `stop_timeout_s`;
        the exit codes (-9 for a killed one)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + self.stop_timeout_s
        for name, proc in self.procs.items():
            try:
                self.exit_codes[name] = proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                self.exit_codes[name] = proc.wait(timeout=30)
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
