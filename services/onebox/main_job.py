"""The one-box main job (`exgrpo run`): embedded pool service, a model and data, ExGRPO training with
held-out evaluation before, during and after, and a report. Needs no services and no arguments.

    run folder
    ├── config.yaml  the effective settings (trainer sections, pool rules, job sizes)
    ├── metrics.jsonl  eval.jsonl  report.md  summary.json  plots/*.png
    ├── pool.db               the experience pool (SQLite); `exgrpo serve --database-url ...` reopens it
    ├── data/train.parquet data/heldout.parquet
    ├── checkpoints/  published/  eval/step-*.jsonl (per-sample records)
    └── service.log

Settings come from `exgrpo_onebox.config.resolve` (recipe, flags, overrides); nothing here reads
a setting from anywhere but that config.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import torch
from rich.console import Console

import exgrpo_trainer
from exgrpo_client import Client
from exgrpo_client.io import read_questions
from exgrpo_client.logs import LogLines, configured_format, file_handler
from exgrpo_onebox.config import MainJobOptions, OneBoxConfig, ResolvedJob, resolve, warm_start_path
from exgrpo_onebox.diagnostics import RecordingClient, StepDiagnostics, replay_count_histogram
from exgrpo_onebox.fleet import WorkerFleet
from exgrpo_onebox.prepare import prepare_pool
from exgrpo_onebox.report import write_report
from exgrpo_onebox.synthetic import make_splits, write_parquet
from exgrpo_pool.config import Settings
from exgrpo_pool.embedded import serve_in_thread
from exgrpo_rollout.evaluate import EvalRow, aggregate, evaluate, load_rows, write_jsonl

if TYPE_CHECKING:
    from exgrpo_client import QuestionCreate
    from exgrpo_trainer import Trainer

__all__ = [
    "MainJobOptions",
    "one_thread_on_small_boxes",
    "prepare_pool",
    "run_main_job",
    "warm_started_model",
]

log = logging.getLogger("exgrpo.run")


def one_thread_on_small_boxes() -> None:
    """One torch thread on machines with at most two cores (unless OMP_NUM_THREADS says otherwise):
    a model this small runs many times slower with two threads on two shared cores."""
    if "OMP_NUM_THREADS" not in os.environ and (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_main_job(opts: MainJobOptions) -> Path:
    job = resolve(opts)  # bad settings fail here, before anything is prepared
    cfg = job.config
    console = job_console()
    started = time.perf_counter()
    one_thread_on_small_boxes()
    from transformers.utils import logging as hf_logging  # transformers: seconds to import, only when run

    hf_logging.disable_progress_bar()  # no per-load progress bars inside the job's own display
    out = cfg.run.output_dir
    out.mkdir(parents=True, exist_ok=True)
    _log_to(out / "service.log")

    console.rule("[bold]ExGRPO on one box")
    console.print(f"run folder: {out}")
    console.print(
        f"settings: K = {cfg.pool.k}, B = {cfg.experience.batch_size}, experience "
        f"{'on' if cfg.experience.enabled else 'off'} (ratio {cfg.experience.ratio}, start threshold "
        f"{cfg.experience.start_threshold}), all in {out / 'config.yaml'}"
    )
    model_dir = _prepare_model(job, opts, console)
    train_rows, heldout_rows, source = _prepare_data(opts.data, cfg, console)

    db_url = f"sqlite+aiosqlite:///{out / 'pool.db'}"
    settings = Settings(
        database_url=db_url, allow_anonymous=True, host="127.0.0.1", port=_free_port(), log_level="WARNING"
    )
    with serve_in_thread(settings) as srv, RecordingClient(srv.url) as client:
        console.print(f"pool service: {srv.url} (embedded, SQLite {out / 'pool.db'})")
        cfg.run.pool_url = srv.url
        (out / "config.yaml").write_text(cfg.to_yaml())  # the trainer writes the same at its start
        with console.status("importing training questions"):
            prepare_pool(client, cfg, train_rows, source)
        evaluator = _Evaluator(heldout_rows, cfg, client, console)
        evaluator.baseline(model_dir)
        budget = cfg.job.rollouts
        diagnostics = StepDiagnostics(client, out / "diagnostics.jsonl")

        def on_step(trainer: Trainer, metrics: dict[str, float]) -> bool:
            diagnostics.on_step(trainer.step)
            before = evaluator.rollouts
            evaluator.rollouts += int(metrics.get("batch/generated", 0))
            spent = budget is not None and evaluator.rollouts >= budget
            if budget is None:
                due = trainer.step % cfg.job.eval_every == 0
            else:
                due = evaluator.rollouts // cfg.rollouts_per_eval > before // cfg.rollouts_per_eval
            if due or spent or trainer.step >= cfg.run.steps:
                evaluator.during(trainer)
            return spent

        # the trainer's modules load here; on the job's client, the held-out accuracy it posts
        # carries the run's writer lease that the trainer holds
        with _workers(srv.url, cfg, model_dir, console) as fleet:
            exgrpo_trainer.run_training(cfg, client=client, on_step=on_step)
        elapsed = time.perf_counter() - started
        evals = evaluator.history
        facts = {
            "model": str(model_dir),
            "data": source,
            "run": cfg.run.name,
            "steps": evals[-1]["step"] if evals else cfg.run.steps,
            "rollouts generated": evaluator.rollouts,
            "questions per step": cfg.experience.batch_size,
            "rollouts per question": cfg.pool.k,
            "held-out questions": len(heldout_rows),
            "replays per question (times: questions)": replay_count_histogram(client.replays) or "none",
            "wall time": f"{elapsed / 60:.1f} min",
        }
        report = write_report(out, title=f"ExGRPO one-box run ({cfg.run.name})", facts=facts)
        summary = {
            "run_folder": str(out),
            "report": str(report),
            "pool_db": str(out / "pool.db"),
            "heldout_accuracy": [
                {"step": e["step"], "rollouts": e["rollouts"], "accuracy": e["accuracy"]} for e in evals
            ],
            "rollouts": evaluator.rollouts,
            "workers": {} if fleet is None else fleet.exit_codes,
            "replay_counts": {str(n): c for n, c in replay_count_histogram(client.replays).items()},
            "wall_seconds": round(elapsed, 1),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        console.rule("[bold]done")
        if evals:
            console.print(
                f"held-out accuracy: {evals[0]['accuracy']:.3f} (before) -> "
                f"{evals[-1]['accuracy']:.3f} (after {evals[-1]['step']} steps, "
                f"{evaluator.rollouts} rollouts)"
            )
        console.print(f"outputs:   {out}\nreport:    {report}\nmetrics:   {out / 'metrics.jsonl'}")
        console.print(
            f"browse the pool: exgrpo serve --anonymous --database-url '{db_url}'  "
            "then open http://127.0.0.1:8700/dashboard"
        )
        if opts.serve:
            console.print(f"the pool service stays up at {srv.url}/dashboard (Ctrl-C to stop)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    return out


def job_console() -> Console:
    """The job's display on stderr, never wrapped at a width (a file or a pipe gets 80 columns);
    when the process logs in json (exgrpo_client.logs), each display line is an INFO log record."""
    if configured_format() == "json":
        return Console(file=cast("IO[str]", LogLines(log)), soft_wrap=True)
    return Console(stderr=True, soft_wrap=True)


def _log_to(path: Path) -> None:
    """Every log record of the job (service, trainer, libraries) also to `path`, in its format."""
    logging.getLogger().addHandler(file_handler(path, configured_format() or "plain"))
    logging.getLogger("httpx").setLevel(logging.WARNING)


def warm_started_model(opts: MainJobOptions, console: Console) -> Path:
    """The cached warm-started model of the job (`--quick` or not), built on first use."""
    from exgrpo_onebox.warmstart import prepare_model  # imports transformers: only when a run needs it

    with console.status("preparing the warm-started model (first run only)"):
        return prepare_model(warm_start_path(opts), seed=0, quick=opts.quick)


@contextmanager
def _workers(url: str, cfg: OneBoxConfig, model: Path, console: Console) -> Iterator[WorkerFleet | None]:
    """`job.workers` rollout worker processes serving the run (None without workers), started from
    the job's model, logging to workers/w<i>.log; stopped at the end (SIGTERM, then SIGKILL)."""
    if cfg.job.workers == 0:
        yield None
        return
    folder = cfg.run.output_dir / "workers"
    fleet = WorkerFleet(
        url,
        cfg,
        model,
        folder,
        count=cfg.job.workers,
        log_format=configured_format() or "plain",
        engine=cfg.job.worker_engine,
        vllm_options=cfg.job.worker_vllm,
    )
    mode = (
        "synchronous: every batch generated with the trainer's current weights"
        if cfg.rollout.max_policy_lag == 0
        else f"asynchronous, at most {cfg.rollout.max_policy_lag} policy version(s) behind"
    )
    try:
        with console.status(
            f"starting {cfg.job.workers} rollout workers ({cfg.job.worker_engine}, logs in {folder})"
        ):
            fleet.start()
        console.print(f"rollout workers: {', '.join(fleet.names)} ({mode})")
        yield fleet
    finally:
        fleet.stop()
        console.print(f"rollout workers stopped (exit codes {fleet.exit_codes})")


def _prepare_model(job: ResolvedJob, opts: MainJobOptions, console: Console) -> Path:
    path = job.config.model.path
    if not job.warm_start:
        if not (path / "config.json").exists():
            raise ValueError(f"model.path {path}: not a Hugging Face model folder (no config.json)")
        return path
    path = warm_started_model(opts, console)
    info = json.loads((path / "warmstart.json").read_text())
    console.print(f"model: {path} ({info.get('parameters', 0) / 1e6:.2f}M parameters, warm-started by SFT)")
    return path


def _prepare_data(
    data: Path | None, cfg: OneBoxConfig, console: Console
) -> tuple[list[QuestionCreate], list[EvalRow], str]:
    """Training questions and held-out rows, disjoint: synthetic, or from the file `data`."""
    sizes = cfg.job
    data_dir = cfg.run.output_dir / "data"
    data_dir.mkdir(exist_ok=True)
    if data is None:
        train, heldout = make_splits(
            sizes.train_questions, sizes.heldout_questions, seed=cfg.run.seed, family=sizes.family
        )
        train_path = write_parquet(
            data_dir / "train.parquet", [p.to_row(i, "train") for i, p in enumerate(train)]
        )
        held_path = write_parquet(
            data_dir / "heldout.parquet", [p.to_row(i, "heldout") for i, p in enumerate(heldout)]
        )
        source = "synthetic arithmetic" if sizes.family == "arithmetic" else f"synthetic {sizes.family}"
        questions = [q for batch in read_questions(train_path) for q in batch]
        rows = load_rows(held_path)
    else:
        if not data.exists():
            raise ValueError(f"--data {data}: no such file")
        questions_all = [q for batch in read_questions(data) for q in batch]
        rows_all = load_rows(data)
        if len(rows_all) != len(questions_all):
            raise ValueError(f"--data {data}: cannot align rows for a held-out split")
        n_held = min(sizes.heldout_questions, len(rows_all) // 4)
        rows, questions = rows_all[:n_held], questions_all[n_held : n_held + sizes.train_questions]
        source = str(data)
    console.print(f"data: {source}: {len(questions)} training questions, {len(rows)} held-out rows")
    return questions, rows, source


class _Evaluator:
    def __init__(self, rows: list[EvalRow], cfg: OneBoxConfig, client: Client, console: Console) -> None:
        self.rows = rows
        self.out = out = cfg.run.output_dir
        self.client = client
        self.cfg = cfg
        self.console = console
        self.history: list[dict[str, Any]] = []
        self.rollouts = 0
        """Rollouts generated so far (fresh samples; replayed trajectories are not counted)."""
        (out / "eval").mkdir(exist_ok=True)
        (out / "eval.jsonl").write_text("")

    def _run(self, engine: Any, tokenizer: Any, step: int) -> None:
        t = time.perf_counter()
        sampling = self.cfg.eval_sampling(seed=1234 + step)
        records = evaluate(
            engine, tokenizer, self.rows, sampling=sampling, grader=self.cfg.job.eval_grader, drop_system=True
        )
        write_jsonl(records, self.out / "eval" / f"step-{step:06d}.jsonl")
        summary = aggregate(records)
        d = summary.to_dict()
        acc = float(d.get("average", 0.0))
        per = {b["data_source"]: float(b["accuracy"]) for b in d.get("benchmarks", [])}
        entry = {
            "step": step,
            "rollouts": self.rollouts,
            "accuracy": acc,
            "per_source": per,
            "seconds": round(time.perf_counter() - t, 1),
        }
        self.history.append(entry)
        with (self.out / "eval.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
        metrics = {"eval/accuracy": acc, **{f"eval/{k}": v for k, v in per.items()}}
        self.client.post_run_metrics(self.cfg.run.pool, self.cfg.run.name, step, metrics)
        self.console.print(
            f"[bold]held-out accuracy at step {step}: {acc:.3f}[/] "
            f"({len(self.rows)} rows, {entry['seconds']}s)"
        )

    def baseline(self, model_dir: Path) -> None:
        # transformers and the engine over it: seconds to import, only when a run starts
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from exgrpo_rollout.engines.hf import TransformersEngine

        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        if torch.cuda.is_available():  # on the GPU, in the trainer's compute dtype, as its later evaluations
            dtype = torch.float32 if self.cfg.model.dtype == "float32" else torch.bfloat16
            model = model.to("cuda", dtype=dtype)
        self._run(TransformersEngine(model, tok), tok, 0)
        del model

    def during(self, trainer: Trainer) -> None:
        with trainer.generation_engine() as engine:
            self._run(engine, trainer.tokenizer, trainer.step)
