"""The one-box main job (`exgrpo run`): embedded pool service, a model and data, ExGRPO training with
held-out evaluation before, during and after, and a report. Needs no services and no arguments.

    run folder
    ├── config.yaml  metrics.jsonl  eval.jsonl  report.md  plots/*.png
    ├── pool.db               the experience pool (SQLite); `exgrpo serve --database-url ...` reopens it
    ├── data/train.parquet data/heldout.parquet
    ├── checkpoints/  published/  eval/step-*.jsonl (per-sample records)
    └── service.log
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from rich.console import Console

import exgrpo_trainer
from exgrpo_client import Client, PoolConfig
from exgrpo_client.io import read_questions
from exgrpo_onebox.report import write_report
from exgrpo_onebox.synthetic import make_splits, write_parquet
from exgrpo_pool.config import Settings
from exgrpo_pool.embedded import serve_in_thread
from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.evaluate import aggregate, evaluate, load_rows, write_jsonl
from exgrpo_trainer import TrainConfig, apply_overrides

if TYPE_CHECKING:
    from exgrpo_trainer import Trainer

log = logging.getLogger("exgrpo.run")
RECIPES = Path(__file__).parent / "recipes"


@dataclass
class MainJobOptions:
    quick: bool = False
    """About a minute end to end (smaller model budget, fewer steps, smaller held-out set)."""
    model: Path | None = None
    """A Hugging Face model folder; default: the warm-started tiny model (built and cached)."""
    data: Path | None = None
    """Questions in the verl/ExGRPO parquet layout or JSONL; default: synthetic arithmetic."""
    out: Path | None = None
    """Run folder; default exgrpo-data/runs/<time>."""
    serve: bool = False
    """Keep the pool service up at the end (Ctrl-C stops it)."""
    experience: bool = True
    """False trains plain on-policy GRPO."""
    seed: int = 0
    heldout: int | None = None
    """Held-out questions (default from the recipe)."""
    rollouts: int | None = None
    """Rollout budget: stop once this many rollouts were generated (instead of after run.steps), and
    evaluate at equal rollout counts (every eval_every * K * B rollouts) so runs compare fairly."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides: `pool.*` pool rules (e.g. pool.weighting=uniform), `job.*` job sizes
    (e.g. job.eval_max_new_tokens=256), anything else the trainer config (e.g. run.steps=20)."""
    cache: Path = Path("exgrpo-data/cache")


@dataclass
class JobPlan:
    """Sizes of the job, from the recipe file's `job:` section."""

    train_questions: int = 2000
    heldout_questions: int = 128
    eval_every: int = 10
    eval_max_new_tokens: int = 96
    eval_temperature: float = 0.6
    pool_k: int = 8
    pool_batch_size: int = 16


def _recipe(opts: MainJobOptions) -> tuple[Path, JobPlan]:
    path = RECIPES / ("cpu_demo_quick.yaml" if opts.quick else "cpu_demo.yaml")
    job = yaml.safe_load(path.read_text()).get("job", {}) if path.exists() else {}
    return path, JobPlan(**job)


def split_overrides(items: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """`pool.*` (pool rules), `job.*` (JobPlan sizes) and the rest (trainer settings), values
    parsed as YAML scalars. Unknown pool/job keys fail here, before anything starts."""
    pool: dict[str, Any] = {}
    job: dict[str, Any] = {}
    rest: list[str] = []
    job_fields = {f.name: f for f in dataclasses.fields(JobPlan)}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value")
        if key.startswith("pool."):
            name = key.removeprefix("pool.")
            if name not in PoolConfig.model_fields:
                known = ", ".join(sorted(PoolConfig.model_fields))
                raise ValueError(f"override {item!r}: unknown pool rule {name!r} (known: {known})")
            pool[name] = yaml.safe_load(raw)
        elif key.startswith("job."):
            name = key.removeprefix("job.")
            if name not in job_fields:
                known = ", ".join(job_fields)
                raise ValueError(f"override {item!r}: unknown job size {name!r} (known: {known})")
            value = yaml.safe_load(raw)
            expected = type(getattr(JobPlan(), name))
            if expected is float and isinstance(value, int):
                value = float(value)
            if not isinstance(value, expected) or isinstance(value, bool):
                kind = "an integer" if expected is int else "a number"
                raise ValueError(f"override {item!r}: {name} must be {kind}")
            job[name] = value
        else:
            rest.append(item)
    return pool, job, rest


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
    console = Console(stderr=True)
    started = time.perf_counter()
    one_thread_on_small_boxes()
    from transformers.utils import logging as hf_logging  # transformers: seconds to import, only when run

    hf_logging.disable_progress_bar()  # no per-load progress bars inside the job's own display
    pool_rules, job_sizes, trainer_overrides = split_overrides(opts.overrides)
    recipe_path, job = _recipe(opts)
    job = dataclasses.replace(job, **job_sizes)
    if opts.heldout:
        job.heldout_questions = opts.heldout
    if opts.rollouts is not None and opts.rollouts < 1:
        raise ValueError(f"--rollouts must be positive, got {opts.rollouts}")
    pool_config = {"k": job.pool_k, "batch_size": job.pool_batch_size, **pool_rules}
    PoolConfig.model_validate(pool_config)  # bad pool rules fail before anything is prepared
    out = (opts.out or Path("exgrpo-data/runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _log_to(out / "service.log")

    console.rule("[bold]ExGRPO on one box")
    console.print(f"run folder: {out}")
    model_dir = _prepare_model(opts, console)
    train_rows, heldout_rows, source = _prepare_data(opts, job, out, console)

    db_url = f"sqlite+aiosqlite:///{out / 'pool.db'}"
    settings = Settings(
        database_url=db_url, allow_anonymous=True, host="127.0.0.1", port=_free_port(), log_level="WARNING"
    )
    with serve_in_thread(settings) as srv, Client(srv.url) as client:
        console.print(f"pool service: {srv.url} (embedded, SQLite {out / 'pool.db'})")
        run_name = "exgrpo" if opts.experience else "grpo"
        if not any(p.name == "main" for p in client.list_pools().data):
            client.create_pool("main", config=pool_config, description=f"one-box run on {source}")
            with console.status("importing training questions"):
                client.import_questions("main", train_rows)
        data = yaml.safe_load(recipe_path.read_text()) if recipe_path.exists() else {}
        data.pop("job", None)
        data = apply_overrides(
            data,
            [
                f"run.pool_url={srv.url}",
                "run.pool=main",
                f"run.name={run_name}",
                f"run.seed={opts.seed}",
                f"run.output_dir={out}",
                f"model.path={model_dir}",
                f"experience.enabled={opts.experience}",
                f"experience.batch_size={job.pool_batch_size}",  # B of the job, whatever the recipe says
                *_budget_steps(opts.rollouts, job),
                *trainer_overrides,
            ],
        )
        cfg = TrainConfig.model_validate(data)
        if not any(r.name == run_name for r in client.list_runs("main").data):
            # the trainer's experience settings (ratio, start threshold, ...) are the run's rules
            client.create_run("main", run_name, seed=opts.seed, overrides=cfg.run_overrides())
        evaluator = _Evaluator(heldout_rows, job, out, client, cfg, console)
        evaluator.baseline(model_dir)

        rollouts_per_eval = job.eval_every * job.pool_k * job.pool_batch_size

        def on_step(trainer: Trainer, metrics: dict[str, float]) -> bool:
            before = evaluator.rollouts
            evaluator.rollouts += int(metrics.get("batch/generated", 0))
            spent = opts.rollouts is not None and evaluator.rollouts >= opts.rollouts
            if opts.rollouts is None:
                due = trainer.step % job.eval_every == 0
            else:
                due = evaluator.rollouts // rollouts_per_eval > before // rollouts_per_eval
            if due or spent or trainer.step >= cfg.run.steps:
                evaluator.during(trainer)
            return spent

        exgrpo_trainer.run_training(cfg, on_step=on_step)  # the trainer's modules load here
        elapsed = time.perf_counter() - started
        evals = evaluator.history
        facts = {
            "model": str(model_dir),
            "data": source,
            "run": run_name,
            "steps": evals[-1]["step"] if evals else cfg.run.steps,
            "rollouts generated": evaluator.rollouts,
            "questions per step": job.pool_batch_size,
            "rollouts per question": job.pool_k,
            "held-out questions": len(heldout_rows),
            "wall time": f"{elapsed / 60:.1f} min",
        }
        report = write_report(out, title=f"ExGRPO one-box run ({run_name})", facts=facts)
        summary = {
            "run_folder": str(out),
            "report": str(report),
            "pool_db": str(out / "pool.db"),
            "heldout_accuracy": [
                {"step": e["step"], "rollouts": e["rollouts"], "accuracy": e["accuracy"]} for e in evals
            ],
            "rollouts": evaluator.rollouts,
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


def _budget_steps(budget: int | None, job: JobPlan) -> list[str]:
    """With a rollout budget the hook ends the run; run.steps only has to be out of its way (a step
    generates at least B * (K - 1) rollouts)."""
    if budget is None:
        return []
    per_step = job.pool_batch_size * (job.pool_k - 1)
    return [f"run.steps={-(-budget // per_step) + 1}"]


def _log_to(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)
    for name in ("exgrpo", "httpx"):
        lg = logging.getLogger(name)
        lg.addHandler(handler)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def warm_started_model(opts: MainJobOptions, console: Console) -> Path:
    """The cached warm-started model of the job (`--quick` or not), built on first use."""
    from exgrpo_onebox.warmstart import prepare_model  # imports transformers: only when a run needs it

    target = (opts.cache / ("warmstart-quick" if opts.quick else "warmstart")).resolve()
    with console.status("preparing the warm-started model (first run only)"):
        return prepare_model(target, seed=0, quick=opts.quick)


def _prepare_model(opts: MainJobOptions, console: Console) -> Path:
    if opts.model is not None:
        if not (opts.model / "config.json").exists():
            raise ValueError(f"--model {opts.model}: not a Hugging Face model folder (no config.json)")
        return opts.model.resolve()
    path = warm_started_model(opts, console)
    info = json.loads((path / "warmstart.json").read_text())
    console.print(f"model: {path} ({info.get('parameters', 0) / 1e6:.2f}M parameters, warm-started by SFT)")
    return path


def _prepare_data(
    opts: MainJobOptions, job: JobPlan, out: Path, console: Console
) -> tuple[list[Any], list[Any], str]:
    """Training questions (QuestionCreate) and held-out rows (EvalRow), disjoint."""
    data_dir = out / "data"
    data_dir.mkdir(exist_ok=True)
    if opts.data is None:
        train, heldout = make_splits(job.train_questions, job.heldout_questions, seed=opts.seed)
        train_path = write_parquet(
            data_dir / "train.parquet", [p.to_row(i, "train") for i, p in enumerate(train)]
        )
        held_path = write_parquet(
            data_dir / "heldout.parquet", [p.to_row(i, "heldout") for i, p in enumerate(heldout)]
        )
        source = "synthetic arithmetic"
        questions = [q for batch in read_questions(train_path) for q in batch]
        rows = load_rows(held_path)
    else:
        if not opts.data.exists():
            raise ValueError(f"--data {opts.data}: no such file")
        questions_all = [q for batch in read_questions(opts.data) for q in batch]
        rows_all = load_rows(opts.data)
        if len(rows_all) != len(questions_all):
            raise ValueError(f"--data {opts.data}: cannot align rows for a held-out split")
        n_held = min(job.heldout_questions, len(rows_all) // 4)
        rows, questions = rows_all[:n_held], questions_all[n_held : n_held + job.train_questions]
        source = str(opts.data)
    console.print(f"data: {source}: {len(questions)} training questions, {len(rows)} held-out rows")
    return questions, rows, source


class _Evaluator:
    def __init__(
        self, rows: list[Any], job: JobPlan, out: Path, client: Any, cfg: Any, console: Console
    ) -> None:
        self.rows = rows
        self.job = job
        self.out = out
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
        sampling = SamplingConfig(
            temperature=self.job.eval_temperature,
            top_p=1.0,
            max_new_tokens=self.job.eval_max_new_tokens,
            seed=1234 + step,
        )
        records = evaluate(engine, tokenizer, self.rows, sampling=sampling, drop_system=True)
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
        self._run(TransformersEngine(model, tok), tok, 0)
        del model

    def during(self, trainer: Trainer) -> None:
        with trainer.generation_engine() as engine:
            self._run(engine, trainer.tokenizer, trainer.step)


def options_from(**kw: Any) -> MainJobOptions:
    names = {f.name for f in dataclasses.fields(MainJobOptions)}
    return MainJobOptions(**{k: v for k, v in kw.items() if k in names and v is not None})
