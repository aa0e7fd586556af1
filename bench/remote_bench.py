"""Remote rollouts: synchronous against asynchronous mode, step time and learning curve.

Runs the one-box main job (`exgrpo run`, the quick recipe unless told otherwise) with rollout worker
processes (`--workers 2`) once per mode, one after another in this invocation, with the same seed:
synchronous (`--max-policy-lag 0`, the default: generation and update alternate) and asynchronous
(`--max-policy-lag 1`, and every other lag given: the next batch is generated while the current one
trains). Every run writes its own folder; this script reads its `metrics.jsonl` (the per-step
`timing/*`, `rollout/*` and `actor/behav_*` keys), `eval.jsonl` (held-out accuracy at each
evaluation) and `summary.json`, and prints:

- per mode: median / p90 of `timing/step`, and the medians of its parts: waiting for the workers'
  results (`timing/generate`), the learner's forward passes and update (`timing/old_logprob` +
  `timing/ref_logprob` + `timing/update`), publishing the weights (`timing/publish`); the largest
  `rollout/policy_lag_max`, the mean `rollout/logprob_gap`, the decoupled loss's behaviour weights
  (mean of `actor/behav_weight_mean`, extremes of `_max` / `_min`, mean `actor/behav_capped_frac`);
  the sum of step times and the job's wall time;
- the ratio of each asynchronous mode's median and total step time to the synchronous one's;
- the held-out accuracy of every mode at each evaluation, side by side (the learning curves).

Usage: ``nice -n 10 python bench/remote_bench.py [--lags 0,1,2] [--workers 2] [--seed 0]
[KEY=VALUE ...]`` (overrides go to every run, e.g. ``run.steps=12``). Run folders go under
bench/out/remote_bench/lag<N> (logs next to them); writes bench/out/remote_bench.json.
``--report`` prints the tables again from those folders without running anything.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench/out"


def _mode(lag: int) -> str:
    return "sync" if lag == 0 else f"async lag {lag}"


def _run(lag: int, args: argparse.Namespace) -> tuple[Path, float, int]:
    """One main job; returns its folder, wall seconds and exit code (a failed run is reported, not
    hidden: its log is kept next to the folder)."""
    folder = OUT / "remote_bench" / f"lag{lag}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    exe = shutil.which(
        "exgrpo", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if exe is None:
        raise SystemExit("the exgrpo command is not installed (pip install -e '.[server,train,rollout]')")
    command = [exe, "run", "--workers", str(args.workers)]
    command += ["--max-policy-lag", str(lag), "--seed", str(args.seed), "--out", str(folder)]
    command += [*(["--quick"] if not args.full else []), *args.overrides]
    log = folder.parent / f"lag{lag}.log"
    print(f"[{_mode(lag)}] {' '.join(command[1:])}  (log: {log.relative_to(ROOT)})", flush=True)
    t = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t
    print(f"[{_mode(lag)}] exit code {rc} after {wall:.0f} s", flush=True)
    return folder, wall, rc


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _summary(folder: Path, wall: float, rc: int) -> dict[str, Any]:
    steps = [m for m in _jsonl(folder / "metrics.jsonl") if "timing/step" in m]

    def col(key: str) -> list[float]:
        return [float(m[key]) for m in steps if key in m]

    def med(key: str) -> float:
        xs = col(key)
        return statistics.median(xs) if xs else float("nan")

    learn = [
        sum(float(m.get(k, 0.0)) for k in ("timing/old_logprob", "timing/ref_logprob", "timing/update"))
        for m in steps
    ]
    step_times = col("timing/step")
    stamps = col("time")  # when each step's metrics were written: the cycle, hooks included
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    behav_max, behav_min = col("actor/behav_weight_max"), col("actor/behav_weight_min")
    return {
        "exit_code": rc,
        "wall_s": wall,
        "steps": len(steps),
        "step_median_s": statistics.median(step_times) if step_times else float("nan"),
        "step_p90_s": _pct(step_times, 0.9),
        "step_total_s": sum(step_times),
        "interval_median_s": statistics.median(gaps) if gaps else float("nan"),
        "span_s": stamps[-1] - stamps[0] if stamps else float("nan"),
        "generate_median_s": med("timing/generate"),
        "learn_median_s": statistics.median(learn) if learn else float("nan"),
        "publish_median_s": med("timing/publish"),
        "policy_lag_max": max(col("rollout/policy_lag_max"), default=float("nan")),
        "logprob_gap_mean": statistics.fmean(col("rollout/logprob_gap") or [float("nan")]),
        "behav_weight_mean": statistics.fmean(col("actor/behav_weight_mean") or [float("nan")]),
        "behav_weight_max": max(behav_max, default=float("nan")),
        "behav_weight_min": min(behav_min, default=float("nan")),
        "behav_capped_frac": statistics.fmean(col("actor/behav_capped_frac") or [float("nan")]),
        "solved": {int(m["step"]): float(m["batch/solved"]) for m in steps if "batch/solved" in m},
        "evals": [{"step": e["step"], "accuracy": e["accuracy"]} for e in _jsonl(folder / "eval.jsonl")],
    }


def _table(results: dict[int, dict[str, Any]]) -> str:
    rows = [
        ("exit code", "exit_code", "{:d}"),
        ("steps", "steps", "{:d}"),
        ("step time median (s)", "step_median_s", "{:.2f}"),
        ("step time p90 (s)", "step_p90_s", "{:.2f}"),
        ("  generate-wait median (s)", "generate_median_s", "{:.2f}"),
        ("  update median (s)", "learn_median_s", "{:.2f}"),
        ("  publish median (s)", "publish_median_s", "{:.3f}"),
        ("sum of step times (s)", "step_total_s", "{:.1f}"),
        ("step-to-step interval median (s)", "interval_median_s", "{:.2f}"),
        ("first to last step (s)", "span_s", "{:.1f}"),
        ("job wall time (s)", "wall_s", "{:.0f}"),
        ("rollout/policy_lag_max (max)", "policy_lag_max", "{:.0f}"),
        ("rollout/logprob_gap (mean)", "logprob_gap_mean", "{:.2e}"),
        ("actor/behav_weight_mean (mean)", "behav_weight_mean", "{:.4f}"),
        ("actor/behav_weight_max (max)", "behav_weight_max", "{:.3f}"),
        ("actor/behav_weight_min (min)", "behav_weight_min", "{:.3f}"),
        ("actor/behav_capped_frac (mean)", "behav_capped_frac", "{:.3f}"),
    ]
    lags = sorted(results)
    head = "| | " + " | ".join(_mode(lag) for lag in lags) + " |"
    lines = [head, "|---" * (len(lags) + 1) + "|"]
    for label, key, fmt in rows:
        cells = []
        for lag in lags:
            v = results[lag][key]
            cells.append("-" if isinstance(v, float) and v != v else fmt.format(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    base = results.get(0)
    ratios = [("median step time", "step_median_s"), ("sum of step times", "step_total_s"),
              ("first to last step", "span_s")]  # fmt: skip
    for lag in lags[1:] if base is not None else []:
        for label, key in ratios:
            cells = [f"{base[key] / results[lag][key]:.2f}x" if o == lag else "" for o in lags]
            lines.append(f"| {label}, sync / {_mode(lag)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _curves(results: dict[int, dict[str, Any]]) -> str:
    """Held-out accuracy at each evaluation and the training batches' solved share (the mean over
    the steps since the previous evaluation), per mode."""
    lags = sorted(results)
    at = {lag: {e["step"]: e["accuracy"] for e in results[lag]["evals"]} for lag in lags}
    steps = sorted({s for lag in lags for s in at[lag]})
    names = " | ".join(_mode(lag) for lag in lags)
    lines = [f"| step | held-out accuracy: {names} | batch/solved since last eval: {names} |"]
    lines.append("|---" * (2 * len(lags) + 1) + "|")
    for prev, s in zip([0, *steps], steps, strict=False):
        acc = [f"{at[lag][s]:.3f}" if s in at[lag] else "-" for lag in lags]
        solved = []
        for lag in lags:
            window = [v for k, v in results[lag]["solved"].items() if prev < int(k) <= s]
            solved.append(f"{statistics.fmean(window):.3f}" if window else "-")
        lines.append(f"| {s} | " + " | ".join(acc) + " | " + " | ".join(solved) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lags", default="0,1", help="rollout.max_policy_lag of each run, comma separated")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full", action="store_true", help="the cpu_demo recipe instead of --quick")
    p.add_argument(
        "--report",
        action="store_true",
        help="no runs: the tables again from the run folders and bench/out/remote_bench.json",
    )
    p.add_argument("overrides", nargs="*", help="KEY=VALUE settings for every run")
    args = p.parse_args()
    lags = [int(x) for x in args.lags.split(",")]
    results: dict[int, dict[str, Any]] = {}
    if args.report:
        before = json.loads((OUT / "remote_bench.json").read_text())["results"]
        for lag in lags:
            old = before[str(lag)]
            results[lag] = _summary(OUT / "remote_bench" / f"lag{lag}", old["wall_s"], old["exit_code"])
    for lag in [] if args.report else lags:
        folder, wall, rc = _run(lag, args)
        results[lag] = _summary(folder, wall, rc)
    print()
    print(_table(results))
    print()
    print(_curves(results))
    machine = {"cpus": os.cpu_count(), "load_avg_end": os.getloadavg(), "python": platform.python_version()}
    if args.report:
        return
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "remote_bench.json").write_text(
        json.dumps({"args": vars(args), "machine": machine, "results": results}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
