"""Per-step metrics to JSONL, TensorBoard and (when installed and asked for) Weights & Biases,
plus a live progress bar with a one-line summary per step."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from exgrpo_trainer.config import LoggingSection

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
        self.server, self.thread = start_http_server(port, registry=self.registry)

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
        self.console = Console(stderr=True)
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
        if cfg.progress:
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
        line = (
            f"step {step:>4} "
            + " ".join(f"{short}={fmt.format(clean[k])}" for k, short, fmt in SUMMARY_KEYS if k in clean)
            + f" phase={'mixed' if clean.get('phase/mixed') else 'on_policy'}"
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
