"""GRPO vs ExGRPO at an equal rollout budget, several seeds, and the paper's ablations
(`exgrpo experiment`).

Every arm is the one-box main job (`exgrpo run`) in its own folder with its own embedded pool, the
same warm-started model, the same rollout budget and the same evaluation points (every
eval_every * K * B generated rollouts). A seed fixes the data split (training and held-out
questions), the run's draws and the sampling, so arm A seed s and arm B seed s see the same
questions: differences between arms are paired per seed.

    OUT/<arm>/seed-<s>/     a main-job run folder (summary.json, eval.jsonl, metrics.jsonl, run.log)
    OUT/results.md          table: held-out accuracy at equal rollouts, mean and spread over seeds
    OUT/results.json        the same numbers, machine-readable
    OUT/plots/*.png         learning curves (held-out accuracy and batch solved fraction vs rollouts)

Finished runs (summary.json present) are kept and unfinished ones start again from scratch, so an
interrupted experiment continues where it stopped; `--report-only` rebuilds the table and plots
from what is there.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from rich.console import Console

from exgrpo_onebox.config import MainJobOptions, resolve
from exgrpo_onebox.main_job import one_thread_on_small_boxes, run_main_job, warm_started_model
from exgrpo_onebox.report import read_jsonl, save_figure


@dataclass(frozen=True)
class Arm:
    name: str
    settings: Mapping[str, Any]
    """The arm's settings on top of the recipe, as nested data (see `exgrpo_onebox.config`)."""
    what: str


ARMS: tuple[Arm, ...] = (
    Arm("grpo", {"experience": {"enabled": False}}, "on-policy GRPO (experience off)"),
    Arm("exgrpo", {}, "ExGRPO: entropy choice, Gaussian buckets, ratio 0.5, delayed start 0.35"),
    Arm(
        "choice-random",
        {"experience": {"metric": "random"}},
        "ExGRPO, random trajectory instead of lowest entropy",
    ),
    Arm(
        "buckets-uniform",
        {"pool": {"weighting": "uniform"}},
        "ExGRPO, uniform bucket weights instead of Gaussian",
    ),
    Arm("ratio-0.25", {"experience": {"ratio": 0.25}}, "ExGRPO, experience ratio 0.25"),
    Arm("ratio-0.75", {"experience": {"ratio": 0.75}}, "ExGRPO, experience ratio 0.75"),
    Arm(
        "no-delayed-start",
        {"experience": {"start_threshold": 0.0}},
        "ExGRPO, mixed from the first solved batch",
    ),
    # the warm-started model solves ~45% of its first batch, past the default 0.35, so the default run
    # switches after step 1 like no-delayed-start; a later switch shows what delaying does here
    Arm(
        "delayed-start-0.6",
        {"experience": {"start_threshold": 0.6}},
        "ExGRPO, switch when a batch solves > 60%",
    ),
    Arm("shaping-beta-1", {"loss": {"beta": 1.0}}, "ExGRPO, policy shaping beta 1.0 instead of 0.1"),
)
ARM_NAMES = tuple(a.name for a in ARMS)


def parse_seeds(text: str) -> tuple[int, ...]:
    """Seeds from the command line: ``N`` (N seeds, 0..N-1), a list ``3,4,5``, a range ``10-14``
    (inclusive), or a mix ``0,5-7``. ValueError on anything else, repeats included."""
    text = text.strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError("--seeds: give at least one seed")
        return tuple(range(n))
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--seeds {text!r}: expected N, a list like 3,4,5 or a range like 10-14")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"--seeds {text!r}: range {part} is empty")
        seeds.extend(range(first, last + 1))
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: a seed is given twice")
    return tuple(seeds)


@dataclass
class ExperimentOptions:
    out: Path = Path("exgrpo-data/experiment")
    seeds: tuple[int, ...] = (0, 1, 2)
    """The seeds of every arm (`parse_seeds` reads the command line's)."""
    family: str | None = None
    """Synthetic task family of every run (`job.family`); None: the recipe's (arithmetic)."""
    arms: tuple[str, ...] = ARM_NAMES
    rollouts: int = 7680
    """Rollout budget of every run (default: 60 steps of GRPO at K = 8, B = 16)."""
    heldout: int = 512
    jobs: int = 1
    """Runs at a time (one torch thread each)."""
    quick: bool = False
    report_only: bool = False
    overrides: list[str] = field(default_factory=list)
    """`key=value` settings of every run, over the arm's (see `exgrpo run`)."""


def _run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed-{seed}"


def run_options(arm: Arm, seed: int, opts: ExperimentOptions) -> MainJobOptions:
    """The main job of one arm and seed."""
    settings: dict[str, Any] = dict(arm.settings)
    if opts.family is not None:
        settings["job"] = {**dict(settings.get("job") or {}), "family": opts.family}
    return MainJobOptions(
        quick=opts.quick,
        out=_run_dir(opts.out, arm.name, seed),
        seed=seed,
        heldout=opts.heldout,
        rollouts=opts.rollouts,
        settings=settings,
        overrides=list(opts.overrides),
    )


CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "COLUMNS": "100"}
"""Every run in its own process with one torch thread (set before torch starts its thread pool);
COLUMNS sets the width of the run's log."""


def _child_env() -> None:
    os.environ.update(CHILD_ENV)


def run_logged(options: MainJobOptions) -> tuple[int, float]:
    """One run in this process (a fresh child of the experiment), everything it prints going to
    `run.log` in its folder. Returns (0, seconds), or (1, seconds) with the traceback in the log."""
    assert options.out is not None
    folder = options.out
    if folder.exists():  # a run that stopped before its summary: start it again from scratch
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    started = time.perf_counter()
    with (folder / "run.log").open("w") as log:
        log.write(f"# {options}\n")
        log.flush()
        os.dup2(log.fileno(), 1)  # the process's own stdout and stderr, C libraries included
        os.dup2(log.fileno(), 2)
        try:
            run_main_job(options)
            rc = 0
        except Exception:
            traceback.print_exc()
            rc = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
    return rc, time.perf_counter() - started


def run_experiment(opts: ExperimentOptions, console: Console | None = None) -> Path:
    console = console or Console(stderr=True)
    unknown = [a for a in opts.arms if a not in ARM_NAMES]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARM_NAMES)}")
    if not opts.seeds or any(s < 0 for s in opts.seeds) or len(set(opts.seeds)) != len(opts.seeds):
        raise ValueError(f"--seeds: give distinct seeds >= 0, got {list(opts.seeds)}")
    if opts.jobs < 1 or opts.rollouts < 1:
        raise ValueError("--jobs and --rollouts must be positive")
    arms = [a for a in ARMS if a.name in opts.arms]
    for arm in arms:
        resolve(run_options(arm, opts.seeds[0], opts))  # bad settings fail before the first run
    opts.out.mkdir(parents=True, exist_ok=True)
    todo = [
        (arm, seed)
        for seed in opts.seeds
        for arm in arms
        if not (_run_dir(opts.out, arm.name, seed) / "summary.json").exists()
    ]
    total = len(arms) * len(opts.seeds)
    failed: list[str] = []
    if not opts.report_only and todo:
        # build the cached warm-started model once, before parallel runs would race to build it
        one_thread_on_small_boxes()
        warm_started_model(MainJobOptions(quick=opts.quick), console)
        console.print(
            f"experiment: {len(todo)} of {total} runs to do ({len(arms)} arms x {len(opts.seeds)} seeds), "
            f"{opts.rollouts} rollouts each, {opts.jobs} at a time -> {opts.out}"
        )
        done = total - len(todo)
        # a fresh process per run (spawned: no state inherited from this one), `jobs` at a time
        with ProcessPoolExecutor(
            opts.jobs,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_child_env,
            max_tasks_per_child=1,
        ) as pool:
            pending: dict[Future[tuple[int, float]], tuple[Arm, int]] = {
                pool.submit(run_logged, run_options(arm, seed, opts)): (arm, seed) for arm, seed in todo
            }
            for fut in as_completed(pending):
                arm, seed = pending[fut]
                done += 1
                folder = _run_dir(opts.out, arm.name, seed)
                try:
                    rc, secs = fut.result()
                except BrokenProcessPool:
                    rc, secs = -1, 0.0
                if rc != 0:
                    failed.append(f"{arm.name}/seed-{seed}")
                    how = "the process died" if rc < 0 else "an error"
                    console.print(
                        f"[red][{done}/{total}] {arm.name} seed {seed}: FAILED ({how}), "
                        f"see {folder / 'run.log'}"
                    )
                    continue
                acc = [
                    e["accuracy"]
                    for e in json.loads((folder / "summary.json").read_text())["heldout_accuracy"]
                ]
                console.print(
                    f"[{done}/{total}] {arm.name} seed {seed}: held-out {acc[0]:.3f} -> {acc[-1]:.3f} "
                    f"({secs / 60:.1f} min)"
                )
    report = write_results(opts.out, arms, opts.seeds)
    console.print(f"results: {report}")
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: {', '.join(failed)}")
    return report


# ----------------------------------------------------------------------------------- results
def _stats(xs: Sequence[float]) -> dict[str, float]:
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(xs), "max": max(xs), "n": float(n)}


@dataclass
class RunResult:
    seed: int
    evals: list[dict[str, Any]]
    """[{step, rollouts, accuracy}] in order, the first before training."""
    metrics: list[dict[str, Any]]

    @property
    def switch_step(self) -> int | None:
        return next((int(m["step"]) for m in self.metrics if m.get("phase/switched")), None)


def load_runs(out: Path, arm: str, seeds: Sequence[int]) -> list[RunResult]:
    runs = []
    for seed in seeds:
        folder = _run_dir(out, arm, seed)
        if not (folder / "summary.json").exists():
            continue
        runs.append(RunResult(seed, read_jsonl(folder / "eval.jsonl"), read_jsonl(folder / "metrics.jsonl")))
    return runs


def summarize(out: Path, arms: Sequence[Arm], seeds: Sequence[int]) -> dict[str, Any]:
    """Per arm: held-out accuracy at each evaluation point (equal rollout counts across arms) and at
    the end, mean/std/min/max over seeds, and the per-seed paired differences to GRPO and (for the
    ablations) to ExGRPO. `late` is each run's mean over its last three evaluations (less sampling
    noise than the last one alone)."""
    table: dict[str, Any] = {}
    bases = {name: {r.seed: r for r in load_runs(out, name, seeds)} for name in ("grpo", "exgrpo")}
    for arm in arms:
        runs = load_runs(out, arm.name, seeds)
        if not runs:
            continue
        points = min(len(r.evals) for r in runs)
        curve = [
            {
                "rollouts": _stats([float(r.evals[i]["rollouts"]) for r in runs])["mean"],
                "accuracy": _stats([float(r.evals[i]["accuracy"]) for r in runs]),
            }
            for i in range(points)
        ]
        final = [float(r.evals[-1]["accuracy"]) for r in runs]
        start = [float(r.evals[0]["accuracy"]) for r in runs]
        mid = [float(r.evals[len(r.evals) // 2]["accuracy"]) for r in runs]
        entry: dict[str, Any] = {
            "what": arm.what,
            "seeds": [r.seed for r in runs],
            "start": _stats(start),
            "mid": _stats(mid),
            "final": _stats(final),
            "late": _stats([_late(r) for r in runs]),
            "gain": _stats([f - s for f, s in zip(final, start, strict=True)]),
            "rollouts": _stats([float(r.evals[-1]["rollouts"]) for r in runs]),
            "steps": _stats([float(r.evals[-1]["step"]) for r in runs]),
            "curve": curve,
        }
        for name, base in bases.items():
            if arm.name in ("grpo", name):
                continue
            paired = [
                float(r.evals[-1]["accuracy"]) - float(base[r.seed].evals[-1]["accuracy"])
                for r in runs
                if r.seed in base
            ]
            if paired:
                entry[f"vs_{name}"] = _stats(paired)
        switches = [r.switch_step for r in runs if r.switch_step is not None]
        if switches:
            entry["switch_step"] = _stats([float(x) for x in switches])
        replay = [
            float(m.get("batch/replayed_questions", 0.0)) / max(1.0, float(m.get("batch/questions", 1.0)))
            for r in runs
            for m in r.metrics
        ]
        entry["replay_share"] = sum(replay) / len(replay) if replay else 0.0
        table[arm.name] = entry
    return table


def _late(run: RunResult) -> float:
    tail = run.evals[1:][-3:] or run.evals
    return sum(float(e["accuracy"]) for e in tail) / len(tail)


def _pm(s: dict[str, float]) -> str:
    return f"{s['mean']:.3f} ± {s['std']:.3f}"


def _markdown(table: dict[str, Any]) -> str:
    lines = [
        "| arm | seeds | rollouts | steps | held-out before | at half budget | at full budget | "
        "last three evals | vs GRPO (paired) | vs ExGRPO (paired) | switch step | replay share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def paired(e: dict[str, Any], key: str) -> str:
        vs = e.get(key)
        return "—" if vs is None else f"{vs['mean']:+.3f} ± {vs['std']:.3f}"

    for name, e in table.items():
        sw = e.get("switch_step")
        sw_text = "—" if sw is None else f"{sw['mean']:.1f}"
        final = e["final"]
        lines.append(
            f"| {name} | {len(e['seeds'])} | {e['rollouts']['mean']:.0f} | {e['steps']['mean']:.0f} | "
            f"{_pm(e['start'])} | {_pm(e['mid'])} | {_pm(final)} (min {final['min']:.3f}, "
            f"max {final['max']:.3f}) | {_pm(e['late'])} | {paired(e, 'vs_grpo')} | "
            f"{paired(e, 'vs_exgrpo')} | {sw_text} | {e['replay_share']:.2f} |"
        )
    lines.append("")
    lines.append(
        "Held-out accuracy, mean ± sample standard deviation over seeds. 'vs GRPO' / 'vs ExGRPO': final"
    )
    lines.append(
        "accuracy minus that arm's on the same seed (same training and held-out questions). 'last three"
    )
    lines.append(
        "evals': each run's mean over its last three evaluations. 'replay share': replayed / all questions."
    )
    return "\n".join(lines) + "\n"


def _plots(out: Path, table: dict[str, Any], runs: dict[str, list[RunResult]]) -> list[Path]:
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    groups = {
        "grpo-vs-exgrpo": ["grpo", "exgrpo"],
        "ablations": [n for n in table if n != "grpo"],
    }
    for fname, names in groups.items():
        names = [n for n in names if n in table]
        if not names:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
        for name in names:
            xs = [p["rollouts"] for p in table[name]["curve"]]
            mean = [p["accuracy"]["mean"] for p in table[name]["curve"]]
            lo = [p["accuracy"]["min"] for p in table[name]["curve"]]
            hi = [p["accuracy"]["max"] for p in table[name]["curve"]]
            (line,) = ax1.plot(xs, mean, "o-", label=f"{name} (n={len(table[name]['seeds'])})")
            ax1.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
            # training curve: batch solved fraction vs cumulative rollouts, mean over seeds, smoothed
            series = []
            for r in runs[name]:
                cum, pts = 0.0, []
                for m in r.metrics:
                    cum += float(m.get("batch/generated", 0.0))
                    pts.append((cum, float(m.get("batch/solved", 0.0))))
                series.append(pts)
            n = min(len(s) for s in series)
            if n:
                x = [sum(s[i][0] for s in series) / len(series) for i in range(n)]
                y = [sum(s[i][1] for s in series) / len(series) for i in range(n)]
                w = 5
                ys = [sum(y[max(0, i - w + 1) : i + 1]) / len(y[max(0, i - w + 1) : i + 1]) for i in range(n)]
                ax2.plot(x, ys, "-", color=line.get_color(), label=name)
        ax1.set_xlabel("generated rollouts")
        ax1.set_ylabel("held-out accuracy")
        ax1.set_title("Held-out accuracy (mean over seeds, band = min..max)")
        ax1.legend(fontsize=8)
        ax2.set_xlabel("generated rollouts")
        ax2.set_ylabel("batch solved fraction (5-step mean)")
        ax2.set_title("Training batches")
        ax2.legend(fontsize=8)
        made.append(save_figure(fig, plots / f"{fname}.png", dpi=100))
    return made


def write_results(out: Path, arms: Sequence[Arm], seeds: Sequence[int]) -> Path:
    table = summarize(out, arms, seeds)
    (out / "results.json").write_text(json.dumps(table, indent=2) + "\n")
    runs = {name: load_runs(out, name, seeds) for name in table}
    plots = _plots(out, table, runs)
    body = ["# GRPO vs ExGRPO and ablations", "", _markdown(table)]
    body += [f"![{p.stem}](plots/{p.name})" for p in plots]
    path = out / "results.md"
    path.write_text("\n".join(body) + "\n")
    return path
