"""Per-step metrics to JSONL, TensorBoard and (when installed and asked for) Weights & Biases,
plus a one-line summary per step (a `step` log record, or on a terminal a line under a live progress
bar), and a background sender of the metrics that reach the pool service after a step's commit."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from exgrpo_client.logs import configured_format, fields, progress_allowed
from exgrpo_trainer.config import LoggingSection

if TYPE_CHECKING:
    from exgrpo_client import Client

log = logging.getLogger("exgrpo.trainer")

SUMMARY_KEYS = (
    ("batch/solved", "solved", "{:.3f}"),
    ("experience/replay_share", "replay", "{:.2f}"),
    ("experience/eligible", "elig", "{:.0f}"),
    ("experience/retired", "ret", "{:.0f}"),
    ("loss/total", "loss", "{:+.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("response/length_mean", "len", "{:.0f}"),
    ("timing/step", "s", "{:.1f}"),
)


class PrometheusExporter:
    """`exgrpo_trainer_step_seconds{part}` and `exgrpo_trainer_solved_fraction` on an HTTP port."""

    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.step_seconds = Gauge(
            "exgrpo_trainer_step_seconds",
            "Seconds of the last step, by part.",
            ["part"],
            registry=self.registry,
        )
        self.solved = Gauge(
            "exgrpo_trainer_solved_fraction", "Solved fraction of the last batch.", registry=self.registry
        )
        self.step = Gauge("exgrpo_trainer_step", "Last completed step.", registry=self.registry)
        # EXGRPO_METRICS_HOST: the address to bind (127.0.0.1 on a host network), as the workers'
        addr = os.environ.get("EXGRPO_METRICS_HOST") or "0.0.0.0"
        self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if k.startswith("timing/"):
                self.step_seconds.labels(k.split("/", 1)[1]).set(v)
        if "batch/solved" in metrics:
            self.solved.set(metrics["batch/solved"])
        self.step.set(step)

    def close(self) -> None:
        self.server.shutdown()


def metrics_port(configured: int | None) -> int | None:
    if configured is not None:
        return configured
    raw = os.environ.get("EXGRPO_TRAINER_METRICS_PORT")
    return int(raw) if raw else None


class MetricsLogger:
    def __init__(
        self, out_dir: Path, cfg: LoggingSection, total_steps: int, run_config: dict[str, Any]
    ) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        # on a terminal the summary lines are for people; elsewhere they are log records. Never
        # wrapped at the console's width (80 columns when stderr is a file or a pipe)
        self.human = progress_allowed() or configured_format() is None
        self.console = Console(stderr=True, soft_wrap=True)
        self.jsonl = (out_dir / "metrics.jsonl").open("a") if cfg.jsonl else None
        self.tb: Any = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            except ImportError:
                log.warning(
                    "tensorboard is not installed: TensorBoard logging is off (pip install tensorboard)"
                )
        self.wandb: Any = None
        if cfg.wandb:
            try:
                import wandb

                self.wandb = wandb.init(project=cfg.wandb_project, config=run_config, dir=str(out_dir))
            except ImportError:
                log.warning("wandb is not installed: W&B logging is off")
        port = metrics_port(cfg.metrics_port)
        self.prometheus = PrometheusExporter(port) if port is not None else None
        self.progress: Progress | None = None
        self.task: Any = None
        if cfg.progress and progress_allowed():  # a bar only on a terminal, and not between JSON lines
            self.progress = Progress(
                TextColumn("[bold]train[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=total_steps, info="")

    def advance_to(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "time": round(time.time(), 3), **clean}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.prometheus is not None:
            self.prometheus.update(step, clean)
        phase = "mixed" if clean.get("phase/mixed") else "on_policy"
        if not self.human:
            summary = {k: float(fmt.format(clean[k])) for k, _, fmt in SUMMARY_KEYS if k in clean}
            log.info("step", extra=fields(step=step, **summary, phase=phase))
            return
        line = (
            f"step {step:>4} "
            + " ".join(f"{short}={fmt.format(clean[k])}" for k, short, fmt in SUMMARY_KEYS if k in clean)
            + f" phase={phase}"
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=f"solved={clean.get('batch/solved', 0):.3f}")
            self.progress.console.print(line)
        else:
            self.console.print(line)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.prometheus is not None:
            self.prometheus.close()


class RunMetricsSender:
    """Posts each step's late metrics (its timings and pool stats, known only after its commit) to
    the pool service from one background thread, so the next step does not wait for that round trip.

    Steps go out one at a time in the order `send` got them, each once: a post that fails (after
    the client's own retries, which carry an idempotency key, so the service applies it once) is
    logged with its step and not tried again; the step's metrics stay in the local metrics log. At
    most `max_pending` steps wait: `send` then blocks until the service catches up, so nothing is
    dropped. `flush()` waits for the queue to empty; `close()` sends what is queued and joins the
    thread."""

    def __init__(self, client: Client, pool: str, run: str, *, max_pending: int = 16) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self._client, self._pool, self._run = client, pool, run
        self._queue: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(max_pending)
        self._closed = False
        self.num_sent = 0
        self.failed_steps: list[int] = []
        self._thread = threading.Thread(target=self._loop, name="exgrpo-run-metrics", daemon=True)
        self._thread.start()

    def send(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._closed:
            raise RuntimeError("this RunMetricsSender is closed")
        self._queue.put((step, dict(metrics)))

    def flush(self) -> None:
        """Wait until every step queued so far has been posted (or has failed and been logged)."""
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        if self.failed_steps:
            log.error(
                "the run metrics of %d of %d steps did not reach the pool service (steps %s); "
                "they are in the local metrics log only",
                len(self.failed_steps),
                len(self.failed_steps) + self.num_sent,
                self.failed_steps,
            )

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                step, metrics = item
                try:
                    self._client.post_run_metrics(self._pool, self._run, step, metrics)
                except Exception:
                    self.failed_steps.append(step)
                    log.exception("posting the run metrics of step %d to the pool service failed", step)
                else:
                    self.num_sent += 1
            finally:
                self._queue.task_done()
