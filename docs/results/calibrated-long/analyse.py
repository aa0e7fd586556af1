"""Tables of the long calibrated runs (docs/results.md, "Calibrated setting") that the experiment's
own report does not print: accuracy per seed at fixed rollout counts, paired final and area
differences against GRPO and ExGRPO for arms from several experiment folders (the late-start arm is
an `exgrpo` arm run with `experience.start_threshold=0.45` in a folder of its own), accuracy by
level, the run cut into sixths (held-out accuracy at each sixth's end next to entropy, importance
weights, staleness, repeats, replay by bucket and the pool's bucket histogram), distinct training
questions and how often questions were replayed.

    python docs/results/calibrated-long/analyse.py \
        --arm grpo=exgrpo-data/calibrated-long/grpo --arm exgrpo=exgrpo-data/calibrated-long/exgrpo \
        --arm late-start-0.45=exgrpo-data/calibrated-long-late/exgrpo --seeds 0-4 \
        --json docs/results/calibrated-long/analysis.json --plot docs/results/calibrated-long/arms.png

Prints markdown; `--partial` also reads runs that have not finished (no summary.json).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exgrpo_onebox.experiment import (
    RunResult,
    _diagnostics_plot,
    _level_plot,
    auc,
    grpo_target,
    parse_seeds,
    rollouts_to_reach,
)
from exgrpo_onebox.report import read_jsonl

SEGMENTS = 6
PARTS = 5
"""The per-seed table reads each run's evaluation nearest to 0, 1/5, ..., 4/5 of the budget, and its last."""


def truncate(run: RunResult, budget: float) -> RunResult:
    """The run as a run of `budget` generated rollouts would have been: up to its first evaluation at
    or past the budget (where such a run stops and evaluates), the steps up to that evaluation.
    Replay counts are the whole run's, so they are dropped when anything was cut."""
    cut = next((i for i, e in enumerate(run.evals) if float(e["rollouts"]) >= budget), None)
    if cut is None or cut == len(run.evals) - 1:
        return run
    last = float(run.evals[cut]["step"])
    return RunResult(
        run.seed,
        run.evals[: cut + 1],
        [m for m in run.metrics if float(m["step"]) <= last],
        [d for d in run.diagnostics if float(d["step"]) <= last],
        {},
    )


def load(folder: Path, seeds: Sequence[int], partial: bool, budget: float | None = None) -> list[RunResult]:
    runs = []
    for seed in seeds:
        run = folder / f"seed-{seed}"
        summary = run / "summary.json"
        if not (summary.exists() or (partial and (run / "eval.jsonl").exists())):
            continue
        counts = json.loads(summary.read_text()).get("replay_counts") or {} if summary.exists() else {}
        result = RunResult(
            seed,
            read_jsonl(run / "eval.jsonl"),
            read_jsonl(run / "metrics.jsonl"),
            read_jsonl(run / "diagnostics.jsonl"),
            {str(k): int(v) for k, v in counts.items()},
        )
        runs.append(result if budget is None else truncate(result, budget))
    return runs


def stats(xs: Sequence[float]) -> dict[str, float]:
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "sd": sd, "min": min(xs), "max": max(xs), "n": n}


def pm(s: dict[str, float], sign: bool = False) -> str:
    return f"{s['mean']:+.3f} ± {s['sd']:.3f}" if sign else f"{s['mean']:.3f} ± {s['sd']:.3f}"


def at(run: RunResult, rollouts: float) -> dict[str, Any]:
    """The evaluation nearest to `rollouts` generated rollouts."""
    return min(run.evals, key=lambda e: abs(float(e["rollouts"]) - rollouts))


def late(run: RunResult) -> float:
    tail = run.evals[1:][-3:] or run.evals
    return sum(float(e["accuracy"]) for e in tail) / len(tail)


def segment_rows(run: RunResult, n: int) -> list[dict[str, float]]:
    """Per n-th of the run (by step): means of the per-step diagnostics, the pool's bucket
    histogram at the segment's last step and the held-out accuracy of the last evaluation in it."""
    steps = len(run.metrics)
    out = []
    for i in range(n):
        lo, hi = steps * i // n, steps * (i + 1) // n
        metrics, diag = run.metrics[lo:hi], run.diagnostics[lo:hi]
        row: dict[str, float] = {}
        for key in ("actor/entropy", "is/w_mean", "is/w_max", "is/w_min", "batch/solved"):
            vals = [float(m[key]) for m in metrics if key in m]
            if vals:
                row[key] = sum(vals) / len(vals)
        for key in ("replay/age_mean", "replay/age_max", "replay/times_mean"):
            vals = [float(d[key]) for d in diag if key in d]
            if vals:
                row[key] = sum(vals) / len(vals)
        replayed = {b: sum(float(d.get(f"replay/bucket_{b}", 0.0)) for d in diag) for b in range(1, 8)}
        total = sum(replayed.values())
        for name, group in (("1-2", (1, 2)), ("3-5", (3, 4, 5)), ("6-7", (6, 7))):
            row[f"replay_{name}"] = sum(replayed[b] for b in group) / total if total else math.nan
        row["replay_share"] = sum(
            float(m.get("batch/replayed_questions", 0.0)) / max(1.0, float(m.get("batch/questions", 1.0)))
            for m in metrics
        ) / max(1, len(metrics))
        last = metrics[-1] if metrics else {}
        for b in range(1, 8):
            row[f"pool_{b}"] = float(last.get(f"experience/bucket_{b}", 0.0))
        last_step = float(last.get("step", 0.0))
        evals = [e for e in run.evals if float(e["step"]) <= last_step]
        row["accuracy"] = float(evals[-1]["accuracy"]) if evals else math.nan
        row["rollouts"] = float(evals[-1]["rollouts"]) if evals else math.nan
        out.append(row)
    return out


def mean_rows(rows: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    merged = []
    for i in range(len(rows[0])):
        keys = {k for r in rows for k in r[i]}
        entry = {}
        for k in sorted(keys):
            vals = [r[i][k] for r in rows if k in r[i] and not math.isnan(r[i][k])]
            entry[k] = sum(vals) / len(vals) if vals else math.nan
        merged.append(entry)
    return merged


def table(title: str, columns: Sequence[str]) -> list[str]:
    """A markdown section title and the head of its table."""
    return [f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def fmt(x: float, digits: int = 3) -> str:
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def distinct_new(run: RunResult) -> int:
    """Training questions generated fresh (not replayed) over the run."""
    return int(
        sum(
            float(m.get("batch/questions", 0.0)) - float(m.get("batch/replayed_questions", 0.0))
            for m in run.metrics
        )
    )


def analyse(arms: dict[str, list[RunResult]]) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}
    md: list[str] = []
    grpo = {r.seed: r for r in arms.get("grpo", [])}
    exgrpo = {r.seed: r for r in arms.get("exgrpo", [])}

    budget = min(float(r.evals[-1]["rollouts"]) for runs in arms.values() for r in runs)
    checkpoints = [round(budget * k / PARTS / 1024) * 1024 for k in range(PARTS)]
    md += table(
        "Accuracy per seed at fixed rollout counts (nearest evaluation; last: the run's last)",
        ["arm", "seed", *(f"~{c:,}" for c in checkpoints), "last (rollouts)", "last three", "switch step"],
    )
    for name, runs in arms.items():
        for r in runs:
            points = " | ".join(fmt(float(at(r, c)["accuracy"])) for c in checkpoints)
            last = r.evals[-1]
            sw = r.switch_step
            md.append(
                f"| {name} | {r.seed} | {points} | {float(last['accuracy']):.3f} ({int(last['rollouts']):,}) "
                f"| {late(r):.3f} | {'—' if sw is None else sw} |"
            )
        for c in (*checkpoints, -1):
            key = "last" if c == -1 else str(c)
            vals = [float((r.evals[-1] if c == -1 else at(r, c))["accuracy"]) for r in runs]
            out.setdefault(name, {}).setdefault("accuracy_at", {})[key] = stats(vals)
    md.append("")

    md += table(
        "Paired against GRPO and ExGRPO (same seeds)",
        [
            "arm",
            "final",
            "vs GRPO final",
            "below GRPO",
            "last three vs GRPO",
            "AUC",
            "AUC vs GRPO",
            "vs ExGRPO final",
            "AUC vs ExGRPO",
            "reaches GRPO's final (seeds)",
            "rollouts to reach, share of GRPO's budget per seed",
        ],
    )
    for name, runs in arms.items():
        entry = out.setdefault(name, {})
        final = [float(r.evals[-1]["accuracy"]) for r in runs]
        entry["final"] = stats(final)
        entry["final_per_seed"] = {r.seed: f for r, f in zip(runs, final, strict=True)}
        entry["auc"] = stats([auc(r) for r in runs])
        cells = [pm(entry["final"]), "—", "—", "—", pm(entry["auc"]), "—", "—", "—", "—", "—"]
        for base_name, base in (("grpo", grpo), ("exgrpo", exgrpo)):
            if name == base_name:
                continue
            paired = [r for r in runs if r.seed in base]
            if not paired:
                continue
            d_final = [
                float(r.evals[-1]["accuracy"]) - float(base[r.seed].evals[-1]["accuracy"]) for r in paired
            ]
            d_auc = [auc(r) - auc(base[r.seed]) for r in paired]
            entry[f"vs_{base_name}"] = {"final": stats(d_final), "auc": stats(d_auc), "per_seed": d_final}
            if base_name == "grpo":
                d_late = [late(r) - late(base[r.seed]) for r in paired]
                entry["vs_grpo"]["late"] = stats(d_late)
                cells[1] = f"{pm(stats(d_final), True)} ({min(d_final):+.3f} to {max(d_final):+.3f})"
                cells[2] = f"{sum(d < 0 for d in d_final)} of {len(d_final)}"
                cells[3] = pm(stats(d_late), True)
                cells[5] = pm(stats(d_auc), True)
            else:
                cells[6] = pm(stats(d_final), True)
                cells[7] = pm(stats(d_auc), True)
        if grpo:
            reach = []
            for r in runs:
                g = grpo.get(r.seed)
                if g is None:
                    continue
                x = rollouts_to_reach(r, grpo_target(g))
                reach.append((r.seed, x, None if x is None else x / float(g.evals[-1]["rollouts"])))
            entry["reach"] = [{"seed": s, "rollouts": x, "share": f} for s, x, f in reach]
            got = [x for _, x, _ in reach if x is not None]
            cells[8] = f"{len(got)} of {len(reach)}"
            cells[9] = ", ".join("never" if f is None else f"{f:.2f}" for _, _, f in reach)
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    md += [
        "",
        "Target per seed: the mean of GRPO's last three evaluations on that seed; reached: the first "
        "evaluation at or above it.",
        "",
    ]

    md += table(
        "Held-out accuracy by level (mean over seeds): before, at ~1/3, ~2/3 and at the end",
        ["arm", "level", "before", "~1/3", "~2/3", "end"],
    )
    for name, runs in arms.items():
        sources = sorted({k for r in runs for e in r.evals for k in e.get("per_source", {})})
        budget = min(float(r.evals[-1]["rollouts"]) for r in runs)
        for src in sources:
            vals = []
            for point in (0.0, budget / 3, 2 * budget / 3):
                vals.append(sum(float(at(r, point)["per_source"].get(src, 0.0)) for r in runs) / len(runs))
            vals.append(sum(float(r.evals[-1]["per_source"].get(src, 0.0)) for r in runs) / len(runs))
            out[name].setdefault("levels", {})[src] = vals
            md.append(f"| {name} | {src} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    md.append("")

    md += table(
        f"The runs in {SEGMENTS} parts by step (mean over seeds)",
        [
            "arm",
            "part",
            "held-out at its end",
            "entropy",
            "batch solved",
            "replay share",
            "w mean",
            "w max",
            "w min",
            "staleness mean",
            "staleness max",
            "times replayed",
            "replayed from 1-2 / 3-5 / 6-7",
            "pool buckets 1..7 at its end",
        ],
    )
    for name, runs in arms.items():
        rows = mean_rows([segment_rows(r, SEGMENTS) for r in runs])
        out[name]["segments"] = rows
        for i, row in enumerate(rows):
            pool = " ".join(f"{row.get(f'pool_{b}', 0.0):.0f}" for b in range(1, 8))
            by = {k: row.get(k, math.nan) for k in ("replay_1-2", "replay_3-5", "replay_6-7")}
            md.append(
                f"| {name} | {i + 1} | {fmt(row['accuracy'])} ({fmt(row['rollouts'], 0)}) "
                f"| {fmt(row.get('actor/entropy', math.nan))} | {fmt(row.get('batch/solved', math.nan))} "
                f"| {fmt(row['replay_share'], 2)} | {fmt(row.get('is/w_mean', math.nan))} "
                f"| {fmt(row.get('is/w_max', math.nan), 2)} | {fmt(row.get('is/w_min', math.nan), 2)} "
                f"| {fmt(row.get('replay/age_mean', math.nan), 1)} "
                f"| {fmt(row.get('replay/age_max', math.nan), 1)} "
                f"| {fmt(row.get('replay/times_mean', math.nan), 2)} "
                f"| {fmt(by['replay_1-2'], 2)} / {fmt(by['replay_3-5'], 2)} / {fmt(by['replay_6-7'], 2)} "
                f"| {pool} |"
            )
    md += [
        "",
        "Staleness: policy versions (steps) between collecting a replayed trajectory and replaying it. "
        "w: per-token importance weight of replayed tokens (mean; max and min per step).",
        "",
    ]

    md += table(
        "Distinct training questions and repeats",
        ["arm", "fresh questions per run", "questions replayed n times (all seeds): n=count"],
    )
    for name, runs in arms.items():
        fresh = [distinct_new(r) for r in runs]
        counts: dict[int, int] = {}
        for r in runs:
            for n, c in r.replay_counts.items():
                counts[int(n)] = counts.get(int(n), 0) + int(c)
        out[name]["fresh_questions"] = fresh
        out[name]["replay_counts"] = {str(k): v for k, v in sorted(counts.items())}
        text = ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "—"
        md.append(f"| {name} | {', '.join(str(f) for f in fresh)} | {text} |")
    md.append("")
    return out, md


def plot(arms: dict[str, list[RunResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, runs in arms.items():
        points = min(len(r.evals) for r in runs)
        xs = [sum(float(r.evals[i]["rollouts"]) for r in runs) / len(runs) for i in range(points)]
        ys = [sum(float(r.evals[i]["accuracy"]) for r in runs) / len(runs) for i in range(points)]
        (line,) = ax.plot(xs, ys, lw=2, label=f"{name} (mean of {len(runs)} seeds)")
        for r in runs:
            ax.plot(
                [float(e["rollouts"]) for e in r.evals],
                [float(e["accuracy"]) for e in r.evals],
                lw=0.6,
                alpha=0.35,
                color=line.get_color(),
            )
    ax.set_xlabel("generated rollouts")
    ax.set_ylabel("held-out accuracy (mean over levels)")
    ax.set_title("Calibrated setting, long runs: held-out accuracy vs rollouts (thin: single seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arm", action="append", required=True, help="NAME=FOLDER holding seed-<s>/ run folders"
    )
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--partial", action="store_true")
    parser.add_argument("--max-rollouts", type=float, help="read every run as a run of this budget")
    parser.add_argument("--plots", type=Path, help="folder for the experiment's diagnostics and level plots")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    arms: dict[str, list[RunResult]] = {}
    for spec in args.arm:
        name, _, folder = spec.partition("=")
        runs = load(Path(folder), seeds, args.partial, args.max_rollouts)
        if runs:
            arms[name] = runs
    table, md = analyse(arms)
    sys.stdout.write("\n".join(md) + "\n")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    if args.plot:
        plot(arms, args.plot)
    if args.plots:
        # the experiment's own figures over these runs (they write to <folder>/plots/)
        (args.plots / "plots").mkdir(parents=True, exist_ok=True)
        _diagnostics_plot(args.plots, dict.fromkeys(arms), arms)
        _level_plot(args.plots, dict.fromkeys(arms), arms)


if __name__ == "__main__":
    main()
