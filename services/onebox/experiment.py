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
    console = console or Console(stderr=True, soft_wrap=True)  # no wrapping at 80 columns off a terminal
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
    diagnostics: list[dict[str, Any]] = field(default_factory=list)
    """Per step: what was replayed (`exgrpo_onebox.diagnostics`); empty for runs before it existed."""
    replay_counts: dict[str, int] = field(default_factory=dict)
    """Questions replayed n times, per n, at the end of the run."""

    @property
    def switch_step(self) -> int | None:
        return next((int(m["step"]) for m in self.metrics if m.get("phase/switched")), None)


def load_runs(out: Path, arm: str, seeds: Sequence[int]) -> list[RunResult]:
    runs = []
    for seed in seeds:
        folder = _run_dir(out, arm, seed)
        if not (folder / "summary.json").exists():
            continue
        summary = json.loads((folder / "summary.json").read_text())
        runs.append(
            RunResult(
                seed,
                read_jsonl(folder / "eval.jsonl"),
                read_jsonl(folder / "metrics.jsonl"),
                read_jsonl(folder / "diagnostics.jsonl"),
                dict(summary.get("replay_counts") or {}),
            )
        )
    return runs


def auc(run: RunResult) -> float:
    """Area under held-out accuracy vs generated rollouts (trapezoids from the evaluation before
    training to the last), divided by the rollouts spanned: the run's mean accuracy over its budget."""
    xs = [float(e["rollouts"]) for e in run.evals]
    ys = [float(e["accuracy"]) for e in run.evals]
    if len(xs) < 2 or xs[-1] <= xs[0]:
        return ys[-1]
    area = sum((xs[i + 1] - xs[i]) * (ys[i + 1] + ys[i]) / 2 for i in range(len(xs) - 1))
    return area / (xs[-1] - xs[0])


def rollouts_to_reach(run: RunResult, target: float) -> float | None:
    """Generated rollouts at the first evaluation whose accuracy is >= `target` (None: never)."""
    return next((float(e["rollouts"]) for e in run.evals if float(e["accuracy"]) >= target), None)


def grpo_target(run: RunResult) -> float:
    """GRPO's final accuracy as a target to reach: the mean of its last three evaluations (one
    evaluation alone has a sampling error of about 0.02-0.03)."""
    return _late(run)


PHASES = ("early", "middle", "late")
DIAG_KEYS = (
    ("actor/entropy", "metrics"),
    ("is/w_mean", "metrics"),
    ("is/w_max", "metrics"),
    ("is/fw_mean", "metrics"),
    ("batch/solved", "metrics"),
    ("replay/age_mean", "diagnostics"),
    ("replay/age_max", "diagnostics"),
    ("replay/times_mean", "diagnostics"),
)
"""Per-step series averaged per third of a run (`phase_diagnostics`)."""


def _thirds(n: int) -> list[range]:
    return [range(n * i // 3, n * (i + 1) // 3) for i in range(3)]


def phase_diagnostics(runs: Sequence[RunResult]) -> dict[str, dict[str, float]]:
    """Per third of the runs (by step): the mean over steps and seeds of entropy, importance weights,
    batch solved fraction, staleness and repeats of replays; the share of replayed questions from
    each bucket and of the pool's eligible questions in each bucket."""
    out: dict[str, dict[str, float]] = {}
    for p, name in enumerate(PHASES):
        vals: dict[str, list[float]] = {}
        replay_b: dict[int, float] = {}
        pool_b: dict[int, float] = {}
        for r in runs:
            for source in ("metrics", "diagnostics"):
                rows = r.metrics if source == "metrics" else r.diagnostics
                part = [rows[i] for i in _thirds(len(rows))[p]]
                for key, src in DIAG_KEYS:
                    if src == source:
                        vals.setdefault(key, []).extend(float(m[key]) for m in part if key in m)
                for m in part:
                    for k, v in m.items():
                        if k.startswith("replay/bucket_"):
                            b = int(k.rsplit("_", 1)[1])
                            replay_b[b] = replay_b.get(b, 0.0) + float(v)
                        elif k.startswith("experience/bucket_"):
                            b = int(k.rsplit("_", 1)[1])
                            pool_b[b] = pool_b.get(b, 0.0) + float(v)
        entry = {k: sum(v) / len(v) for k, v in vals.items() if v}
        for prefix, counts in (("replay_share_bucket_", replay_b), ("pool_share_bucket_", pool_b)):
            total = sum(counts.values())
            for b, c in sorted(counts.items()):
                entry[f"{prefix}{b}"] = c / total if total else 0.0
        out[name] = entry
    return out


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
        entry["auc"] = _stats([auc(r) for r in runs])
        grpo_runs = bases["grpo"]
        if grpo_runs:
            reach: list[float | None] = []
            budget: list[float] = []
            paired_auc: list[float] = []
            for r in runs:
                g = grpo_runs.get(r.seed)
                if g is None:
                    continue
                reach.append(rollouts_to_reach(r, grpo_target(g)))
                budget.append(float(g.evals[-1]["rollouts"]))
                paired_auc.append(auc(r) - auc(g))
            got = [x for x in reach if x is not None]
            entry["reach"] = {
                "per_seed": reach,
                "reached": len(got),
                "of": len(reach),
                "fraction_of_grpo_budget": [
                    None if x is None else x / b for x, b in zip(reach, budget, strict=True)
                ],
            }
            if got:
                entry["reach"]["rollouts"] = _stats(got)
            if paired_auc and arm.name != "grpo":
                entry["auc_vs_grpo"] = _stats(paired_auc)
        entry["phases"] = phase_diagnostics(runs)
        counts: dict[int, int] = {}
        for r in runs:
            for n, c in r.replay_counts.items():
                counts[int(n)] = counts.get(int(n), 0) + int(c)
        if counts:
            entry["replay_counts"] = {str(n): c for n, c in sorted(counts.items())}
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
    lines += [
        "",
        "## Rollouts to reach GRPO's final accuracy, and area under the curve",
        "",
        "| arm | seeds that reach it | rollouts to reach (mean over those) | share of GRPO's budget "
        "(per seed) | AUC (mean accuracy over the budget) | AUC vs GRPO (paired) |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in table.items():
        reach = e.get("reach")
        if reach is None:
            continue
        rollouts = reach.get("rollouts")
        shares = ", ".join("—" if x is None else f"{x:.2f}" for x in reach["fraction_of_grpo_budget"])
        vs = e.get("auc_vs_grpo")
        reach_text = "—" if rollouts is None else f"{rollouts['mean']:.0f}"
        vs_text = "—" if vs is None else f"{vs['mean']:+.3f} ± {vs['std']:.3f}"
        lines.append(
            f"| {name} | {reach['reached']} of {reach['of']} | {reach_text} | {shares} | "
            f"{_pm(e['auc'])} | {vs_text} |"
        )
    lines += [
        "",
        "Target per seed: the mean of GRPO's last three evaluations on that seed. Reached: the first",
        "evaluation at or above it. AUC: trapezoids of accuracy vs generated rollouts over the budget.",
    ]
    lines += ["", "## Diagnostics per third of the run (mean over steps and seeds)", ""]
    keys = [k for k, _ in DIAG_KEYS]
    lines.append(
        "| arm | third | " + " | ".join(keys) + " | replayed from buckets 6-7 | pool in buckets 6-7 |"
    )
    lines.append("|---|---|" + "---|" * (len(keys) + 2))
    for name, e in table.items():
        for phase, d in e.get("phases", {}).items():
            cells = [f"{d[k]:.3g}" if k in d else "—" for k in keys]
            hi_r = sum(v for k, v in d.items() if k in ("replay_share_bucket_6", "replay_share_bucket_7"))
            hi_p = sum(v for k, v in d.items() if k in ("pool_share_bucket_6", "pool_share_bucket_7"))
            lines.append(f"| {name} | {phase} | " + " | ".join(cells) + f" | {hi_r:.2f} | {hi_p:.2f} |")
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


def _mean_series(rows_per_run: list[list[dict[str, Any]]], key: str, smooth: int = 1) -> tuple[list, list]:
    """(step, mean over runs of `key`) over the steps every run has, a trailing `smooth`-step mean."""
    n = min((len(r) for r in rows_per_run), default=0)
    xs, ys = [], []
    for i in range(n):
        vals = [float(r[i][key]) for r in rows_per_run if key in r[i]]
        if vals:
            xs.append(i + 1)
            ys.append(sum(vals) / len(vals))
    if smooth > 1:
        ys = [
            sum(ys[max(0, i - smooth + 1) : i + 1]) / len(ys[max(0, i - smooth + 1) : i + 1])
            for i in range(len(ys))
        ]
    return xs, ys


def _stacked(ax: Any, rows_per_run: list[list[dict[str, Any]]], prefix: str, share: bool) -> None:
    """Stacked mean over runs of the `prefix<k>` series per step (as shares of their sum with `share`)."""
    n = min((len(r) for r in rows_per_run), default=0)
    keys = sorted(
        {int(k.rsplit("_", 1)[1]) for r in rows_per_run for m in r for k in m if k.startswith(prefix)}
    )
    if not n or not keys:
        return
    stack = []
    for b in keys:
        stack.append(
            [
                sum(float(r[i].get(f"{prefix}{b}", 0.0)) for r in rows_per_run) / len(rows_per_run)
                for i in range(n)
            ]
        )
    if share:
        totals = [sum(col) or 1.0 for col in zip(*stack, strict=True)]
        stack = [[v / t for v, t in zip(row, totals, strict=True)] for row in stack]
    colors = [plt.get_cmap("viridis")(b / 8) for b in keys]  # one colour per bucket in every panel
    ax.stackplot(list(range(1, n + 1)), stack, labels=[f"k={b}" for b in keys], colors=colors)
    ax.legend(loc="upper left", fontsize=6, ncol=4)


def _diagnostics_plot(out: Path, table: dict[str, Any], runs: dict[str, list[RunResult]]) -> Path | None:
    """Late-run diagnostics: entropy, importance weights, staleness and repeats per step for every
    arm; ExGRPO's pool bucket histogram and replayed questions by bucket over the run; held-out
    accuracy by level for GRPO and ExGRPO."""
    if not table:
        return None
    replaying = next((n for n in ("exgrpo", *table) if n in table and n != "grpo"), None)
    fig, axes = plt.subplots(2, 3, figsize=(17, 8.5))
    for name in table:
        metrics = [r.metrics for r in runs[name]]
        diag = [r.diagnostics for r in runs[name]]
        axes[0][0].plot(*_mean_series(metrics, "actor/entropy", 5), label=name, lw=1)
        if name != "grpo":
            axes[0][1].plot(*_mean_series(metrics, "is/w_mean", 5), label=f"{name} mean", lw=1)
            axes[1][0].plot(*_mean_series(diag, "replay/age_mean", 5), label=f"{name} age", lw=1)
            axes[1][1].plot(*_mean_series(diag, "replay/times_mean", 5), label=f"{name} times", lw=1)
    for ax, title, ylabel in (
        (axes[0][0], "Policy entropy (5-step mean over seeds)", "mean token entropy"),
        (axes[0][1], "Importance weight of replayed tokens", "w = pi_theta / pi_past, mean"),
        (axes[1][0], "Staleness of replayed trajectories", "steps since collection"),
        (axes[1][1], "Times the replayed questions have been replayed", "times so far (mean)"),
    ):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if replaying is not None:
        _stacked(axes[0][2], [r.metrics for r in runs[replaying]], "experience/bucket_", share=False)
        axes[0][2].set_title(f"{replaying}: pool bucket histogram (mean over seeds)")
        axes[0][2].set_xlabel("step")
        axes[0][2].set_ylabel("eligible questions")
        _stacked(axes[1][2], [r.diagnostics for r in runs[replaying]], "replay/bucket_", share=True)
        axes[1][2].set_title(f"{replaying}: replayed questions by bucket (share)")
        axes[1][2].set_xlabel("step")
        axes[1][2].set_ylabel("share of replayed questions")
    return save_figure(fig, out / "plots" / "diagnostics.png", dpi=90)


def _level_plot(out: Path, table: dict[str, Any], runs: dict[str, list[RunResult]]) -> Path | None:
    """Held-out accuracy by level vs rollouts, GRPO (dashed) and ExGRPO (solid), mean over seeds."""
    names = [n for n in ("grpo", "exgrpo") if n in table]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    colors: dict[str, Any] = {}
    for name in names:
        rs = runs[name]
        points = min(len(r.evals) for r in rs)
        sources = sorted({k for r in rs for e in r.evals for k in e.get("per_source", {})})
        for src in sources:
            xs = [sum(float(r.evals[i]["rollouts"]) for r in rs) / len(rs) for i in range(points)]
            ys = [
                sum(float(r.evals[i].get("per_source", {}).get(src, 0.0)) for r in rs) / len(rs)
                for i in range(points)
            ]
            (line,) = ax.plot(
                xs, ys, "--" if name == "grpo" else "-", color=colors.get(src), label=f"{name} {src}", lw=1.2
            )
            colors[src] = line.get_color()
    ax.set_xlabel("generated rollouts")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Held-out accuracy by level (dashed: GRPO)")
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, out / "plots" / "levels.png", dpi=90)


def write_results(out: Path, arms: Sequence[Arm], seeds: Sequence[int]) -> Path:
    table = summarize(out, arms, seeds)
    (out / "results.json").write_text(json.dumps(table, indent=2) + "\n")
    runs = {name: load_runs(out, name, seeds) for name in table}
    plots = _plots(out, table, runs)
    plots += [
        p for p in (_diagnostics_plot(out, table, runs), _level_plot(out, table, runs)) if p is not None
    ]
    body = ["# GRPO vs ExGRPO and ablations", "", _markdown(table)]
    body += [f"![{p.stem}](plots/{p.name})" for p in plots]
    path = out / "results.md"
    path.write_text("\n".join(body) + "\n")
    return path
