"""Calibrate a task family's difficulty mix to a model: measure the starting solve rate per level and
pick level weights so that the model solves a target share of the training questions.

    python -m exgrpo_onebox.calibrate --family calibrated            # the main job's warm start
    python -m exgrpo_onebox.calibrate --model PATH --target 0.2 --per-level 64 --samples 4

The solve rate of a level is the mean reward of `samples` responses per question, sampled at the
training temperature, over `per_level` questions of the training partition (the partition the run
trains on). `pick_mix` then takes the levels whose rate lies in [`lowest`, `highest`] and weights
them `w(level) ~ exp(-t * rate(level))`, with `t` found so that the weighted mean rate is the target:
of all mixes with that mean it is the one closest to equal weights (largest entropy), so the mix
keeps every usable level and with it a spread of per-question solve rates, which is what spreads
the pool's questions over the buckets 1..K-1 once training starts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exgrpo_onebox.synthetic import get_family, make_problems

__all__ = ["measure_levels", "mix_rate", "pick_mix"]


def measure_levels(
    model_dir: Path,
    family: str = "calibrated",
    *,
    per_level: int = 64,
    samples: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
) -> dict[int, float]:
    """The model's solve rate per level of `family` on training-partition questions: mean reward of
    `samples` responses per question at `temperature` (the `arithmetic` grader)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds to import: only when run

    from exgrpo_onebox.warmstart import evaluate_accuracy

    fam = get_family(family)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    problems = [
        p for level in fam.levels for p in make_problems(per_level, seed, level, split="train", family=family)
    ]
    acc = evaluate_accuracy(
        model,
        tok,
        problems,
        temperature=temperature,
        samples=samples,
        max_new_tokens=max_new_tokens,
        seed=1000 + seed,
    )
    return {level: acc[f"{fam.prefix}_d{level}"] for level in fam.levels}


def mix_rate(rates: Mapping[int, float], mix: Mapping[int, float]) -> float:
    """The solve rate of a mix: the weighted mean of the levels' rates."""
    total = sum(mix.values())
    return sum(rates[k] * w for k, w in mix.items()) / total


def pick_mix(
    rates: Mapping[int, float],
    target: float = 0.2,
    *,
    lowest: float = 0.01,
    highest: float = 0.9,
    digits: int = 2,
) -> dict[int, float]:
    """Level weights (summing to 1, rounded to `digits`) over the levels whose rate lies in
    [`lowest`, `highest`], with weighted mean rate `target` where the usable levels allow it (else the
    closest they reach: all weight on the easiest or the hardest). ValueError when no level is usable."""
    usable = {k: r for k, r in sorted(rates.items()) if lowest <= r <= highest}
    if not usable:
        raise ValueError(f"no level has a solve rate in [{lowest}, {highest}]: {dict(rates)}")

    def weights(t: float) -> dict[int, float]:
        top = max(-t * r for r in usable.values())  # shifted exponent: no overflow for large |t|
        raw = {k: math.exp(-t * r - top) for k, r in usable.items()}
        total = sum(raw.values())
        return {k: w / total for k, w in raw.items()}

    lo, hi = -200.0, 200.0  # the mean rate falls as t grows
    for _ in range(100):
        mid = (lo + hi) / 2
        if mix_rate(usable, weights(mid)) > target:
            lo = mid
        else:
            hi = mid
    w = weights((lo + hi) / 2)
    rounded = {k: round(v, digits) for k, v in w.items()}
    return {k: v for k, v in rounded.items() if v > 0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m exgrpo_onebox.calibrate", description=__doc__)
    parser.add_argument("--family", default="calibrated")
    parser.add_argument("--model", type=Path, default=None, help="default: the main job's warm start")
    parser.add_argument("--target", type=float, default=0.2, help="solve rate of the mix")
    parser.add_argument("--per-level", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from rich.console import Console

        from exgrpo_onebox.config import MainJobOptions
        from exgrpo_onebox.main_job import one_thread_on_small_boxes, warm_started_model

        one_thread_on_small_boxes()
        model = warm_started_model(MainJobOptions(), Console(stderr=True))
    rates = measure_levels(
        model, args.family, per_level=args.per_level, samples=args.samples, temperature=args.temperature
    )
    mix = pick_mix(rates, args.target)
    result: dict[str, Any] = {
        "family": args.family,
        "model": str(model),
        "per_level": args.per_level,
        "samples": args.samples,
        "temperature": args.temperature,
        "rates": rates,
        "target": args.target,
        "mix": mix,
        "mix_rate": mix_rate(rates, mix),
    }
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":  # pragma: no cover - command-line entry
    main()
