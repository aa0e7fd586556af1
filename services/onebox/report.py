"""Run report: plots of a run folder's metrics and evaluations, and a Markdown summary.

Inputs: `metrics.jsonl` (one line per step, written by the trainer), `eval.jsonl` (one line per
held-out evaluation: {"step": int, "accuracy": float, "per_source": {...}}) and `diagnostics.jsonl`
(one line per step: what was replayed, `exgrpo_onebox.diagnostics`). Outputs next to them:
`report.md` and `plots/*.png`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def save_figure(fig: Any, path: Path, *, dpi: int = 110) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def make_plots(run_dir: Path) -> dict[str, Path]:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = _series(evals, "accuracy")
    if xs:
        ax.plot(xs, ys, "o-", label="held-out accuracy", color="tab:blue")
    xs, ys = _series(metrics, "batch/solved")
    if xs:
        ax.plot(xs, ys, "-", label="batch solved fraction", color="tab:orange", alpha=0.8)
    switch = next((int(r["step"]) for r in metrics if r.get("phase/switched")), None)
    if switch is not None:
        ax.axvline(switch, color="grey", ls="--", lw=1, label=f"switch to mixed (step {switch})")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1)
    ax.set_title("Accuracy")
    ax.legend(loc="best", fontsize=8)
    plots["accuracy"] = save_figure(fig, out / "accuracy.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    buckets = sorted(
        {int(k.rsplit("_", 1)[1]) for r in metrics for k in r if k.startswith("experience/bucket_")}
    )
    steps = [int(r["step"]) for r in metrics]
    if buckets and steps:
        stack = [[float(r.get(f"experience/bucket_{b}", 0.0)) for r in metrics] for b in buckets]
        ax.stackplot(steps, stack, labels=[f"k={b}" for b in buckets])
        ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.set_xlabel("step")
    ax.set_ylabel("questions")
    ax.set_title("Bucket histogram over time (eligible questions by latest success count)")
    plots["buckets"] = save_figure(fig, out / "buckets.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("experience/eligible", "eligible"), ("experience/retired", "retired")):
        xs, ys = _series(metrics, key)
        if xs:
            ax.plot(xs, ys, label=label)
    ax2 = ax.twinx()
    xs, ys = _series(metrics, "experience/replay_share")
    if xs:
        ax2.plot(xs, ys, color="tab:green", ls=":", label="replay share")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("replay share")
    ax.set_xlabel("step")
    ax.set_ylabel("questions")
    ax.set_title("Experience pool")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    plots["pool"] = save_figure(fig, out / "pool.png")
    plots["diagnostics"] = diagnostics_figure(metrics, read_jsonl(run_dir / "diagnostics.jsonl"), evals, out)
    return plots


def _keyed(rows: list[dict[str, Any]], prefix: str) -> list[int]:
    return sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith(prefix)})


def diagnostics_figure(
    metrics: list[dict[str, Any]], diag: list[dict[str, Any]], evals: list[dict[str, Any]], out: Path
) -> Path:
    """Per step: policy entropy and the importance weights of replayed tokens; replayed questions by
    bucket; staleness and repeats of replays; held-out accuracy by level."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    ax = axes[0][0]
    xs, ys = _series(metrics, "actor/entropy")
    if xs:
        ax.plot(xs, ys, color="tab:blue", label="entropy (update)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean token entropy")
    ax2 = ax.twinx()
    for key, style in (("is/w_mean", "-"), ("is/fw_mean", ":")):
        xs, ys = _series(metrics, key)
        if xs:
            ax2.plot(xs, ys, style, color="tab:red", label=key, lw=1)
    ax2.set_ylabel("importance weight (replayed tokens)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    ax.set_title("Entropy and importance weights")

    ax = axes[0][1]
    buckets = _keyed(diag, "replay/bucket_")
    steps = [int(r["step"]) for r in diag]
    if buckets and steps:
        stack = [[float(r.get(f"replay/bucket_{b}", 0.0)) for r in diag] for b in buckets]
        ax.stackplot(steps, stack, labels=[f"k={b}" for b in buckets])
        ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.set_xlabel("step")
    ax.set_ylabel("replayed questions")
    ax.set_title("Replayed questions by bucket (latest success count)")

    ax = axes[1][0]
    for key, label in (("replay/age_mean", "age, mean"), ("replay/age_max", "age, max")):
        xs, ys = _series(diag, key)
        if xs:
            ax.plot(xs, ys, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("steps since collection")
    ax2 = ax.twinx()
    xs, ys = _series(diag, "replay/times_mean")
    if xs:
        ax2.plot(xs, ys, color="tab:purple", ls=":", label="times replayed (mean)")
    ax2.set_ylabel("times replayed so far")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax.set_title("Staleness and repeats of replayed trajectories")

    ax = axes[1][1]
    sources = sorted({k for e in evals for k in e.get("per_source", {})})
    for src in sources:
        pts = [(int(e["step"]), float(e["per_source"][src])) for e in evals if src in e.get("per_source", {})]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=src)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    if sources:
        ax.legend(fontsize=7)
    ax.set_title("Held-out accuracy by level")
    return save_figure(fig, out / "diagnostics.png")


def write_report(run_dir: Path, *, title: str, facts: dict[str, Any]) -> Path:
    plots = make_plots(run_dir)
    evals = read_jsonl(run_dir / "eval.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    lines = [f"# {title}", ""]
    for k, v in facts.items():
        lines.append(f"- **{k}**: {v}")
    if evals:
        first, last = evals[0], evals[-1]
        lines += ["", "## Held-out accuracy", "", "| step | accuracy |", "|---|---|"]
        lines += [f"| {e['step']} | {e['accuracy']:.3f} |" for e in evals]
        lines += [
            "",
            f"From {first['accuracy']:.3f} (step {first['step']}) to {last['accuracy']:.3f} "
            f"(step {last['step']}).",
        ]
        sources = sorted(last.get("per_source", {}))
        if sources:
            lines += [
                "",
                "| data source | " + " | ".join(f"step {e['step']}" for e in (first, last)) + " |",
                "|---|---|---|",
            ]
            for src in sources:
                a = first.get("per_source", {}).get(src, float("nan"))
                b = last["per_source"][src]
                lines.append(f"| {src} | {a:.3f} | {b:.3f} |")
    if metrics:
        last_m = metrics[-1]
        lines += ["", "## Last step", ""]
        for key in (
            "batch/solved",
            "experience/eligible",
            "experience/retired",
            "experience/replay_share",
            "loss/total",
            "actor/entropy",
            "is/w_mean",
            "is/w_max",
            "response/length_mean",
            "timing/step",
        ):
            if key in last_m:
                lines.append(f"- `{key}`: {last_m[key]:.4g}")
    lines += ["", "## Plots", ""]
    lines += [f"![{name}](plots/{p.name})" for name, p in plots.items()]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
