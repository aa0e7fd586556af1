"""Grading throughput: in-process vs. GradingPool, on realistic synthetic responses.

Responses are built from the gold answers of ``test.id.parquet`` (AIME, AMC, MATH-500, Minerva,
OlympiadBench): a think block of a few thousand characters of reasoning with inline LaTeX, then
``</think>``, a short solution and a boxed final answer (correct for about 60 % of the items,
otherwise a perturbed answer, an unboxed number, or no ``</think>`` at all).

Usage: ``python bench/grading_bench.py [--items 1000] [--workers 2] [--graders math_think,boxed]``
"""

from __future__ import annotations

import argparse
import random
import time

import pyarrow.parquet as pq
from _data import TEST_ID

from exgrpo_rollout.graders import GradingPool, grade_one

_FILLER = [
    "Let me reconsider the constraint on $x$ and check whether $x^2 + 3x - 4 = 0$ has integer roots.",
    "We have $\\frac{a}{b} = \\frac{3}{4}$, so $4a = 3b$ and both are multiples of the gcd.",
    "Wait, that does not look right. Let me recompute $2^{10} = 1024$ and subtract $24$.",
    "By the triangle inequality, $|a - b| \\le c \\le a + b$, so the side lengths are bounded.",
    "Summing the arithmetic series gives $\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}$.",
    "Hmm, maybe I should try small cases: n = 1, 2, 3 give 1, 3, 6 respectively.",
    "So the area is $\\frac{1}{2} \\cdot 6 \\cdot 8 = 24$ and the hypotenuse is $10$.",
    "Alternatively, substitute $y = x - 1$ to get a depressed cubic in $y$.",
]


def _golds() -> list[str]:
    if TEST_ID.exists():
        rows = pq.read_table(TEST_ID, columns=["reward_model"]).column("reward_model").to_pylist()
        return sorted({r["ground_truth"] for r in rows})
    return ["204", "025", "142.0", "\\frac{14}{3}", "3\\sqrt{13}", "$\\frac{1}{2 n+2}$"]


def make_items(n: int, seed: int = 0, think_chars: int = 3000) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    golds = _golds()
    items: list[tuple[str, str]] = []
    for _ in range(n):
        gold = rng.choice(golds)
        answer = gold.strip("$")
        parts: list[str] = []
        size = 0
        while size < think_chars:
            sentence = rng.choice(_FILLER)
            parts.append(sentence)
            size += len(sentence) + 1
        think = " ".join(parts)
        roll = rng.random()
        if roll < 0.6:
            final = f"\\boxed{{{answer}}}"
        elif roll < 0.8:
            final = f"\\boxed{{{answer}1}}"
        elif roll < 0.9:
            final = f"The answer is {rng.randint(1, 999)}."
        else:
            items.append((think + "<|im_end|>", gold))  # truncated / no </think>
            continue
        solution = (
            f"\n</think>\n\nCombining the cases above, the result follows.\n\nTherefore {final}<|im_end|>"
        )
        items.append((think + solution, gold))
    return items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--graders", default="math_think,boxed")
    ap.add_argument("--inprocess-items", type=int, default=200)
    args = ap.parse_args()
    items = make_items(args.items)
    rows: list[tuple[str, str, int, float, float, str]] = []
    t0 = time.perf_counter()
    with GradingPool(args.workers) as pool:
        pool.warmup()
        startup = time.perf_counter() - t0
        for name in args.graders.split(","):
            t = time.perf_counter()
            grades = pool.grade_many(name, items, timeout_s=5.0)
            dt = time.perf_counter() - t
            acc = sum(g.reward for g in grades) / len(grades)
            reasons = sorted({g.reason for g in grades})
            note = f"acc={acc:.3f} {reasons}"
            rows.append((name, f"pool x{args.workers}", len(items), dt, len(items) / dt, note))
    for name in args.graders.split(","):
        sub = items[: args.inprocess_items]
        t = time.perf_counter()
        for response, gold in sub:
            grade_one(name, response, gold, timeout_s=5.0)
        dt = time.perf_counter() - t
        rows.append((name, "in-process", len(sub), dt, len(sub) / dt, ""))
    print(f"pool start-up + warm-up: {startup:.2f} s")
    print(f"{'grader':<12} {'mode':<12} {'items':>6} {'seconds':>8} {'items/s':>9}  notes")
    for name, mode, n, dt, rate, note in rows:
        print(f"{name:<12} {mode:<12} {n:>6} {dt:>8.2f} {rate:>9.1f}  {note}")


if __name__ == "__main__":
    main()
