"""Starting solve rate of a model on a multiple-choice question file, with the project's own
generation engine (transformers) and graders: `questions` questions x `samples` samples each.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python docs/results/smollm2-arc/start_rate.py \
        --model exgrpo-data/cache/smollm2-135m-instruct \
        --data ../shared/data/luffy_ood/valid.arc_c.parquet --questions 100 --samples 4 \
        --grader choice_letter --system keep --out exgrpo-data/smollm2-arc/start-rate.jsonl

It prints the solve rate, the share of responses with an answer the grader could read, the reasons,
and a few responses; `--out` keeps every graded response (JSON Lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.evaluate import evaluate, load_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--questions", type=int, default=100, help="the first N questions of the file")
    ap.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--grader", default="choice_letter")
    ap.add_argument("--system", choices=["keep", "drop"], default="keep", help="the system message")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=6, help="responses to print")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    rows = load_rows(args.data)[args.offset : args.offset + args.questions]
    rows = [r for r in rows for _ in range(args.samples)]  # identical prompts: one call with n = samples
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    sampling = SamplingConfig(
        temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    records = evaluate(
        TransformersEngine(model, tok),
        tok,
        rows,
        sampling=sampling,
        grader=args.grader,
        drop_system=args.system == "drop",
        prompts_per_call=16,
    )
    n = len(records)
    solved = sum(r.reward for r in records)
    per_question: dict[object, list[float]] = {}
    for r in records:
        per_question.setdefault(r.index, []).append(r.reward)
    reasons = Counter(r.reason for r in records)
    answered = n - reasons.get("no_answer", 0) - reasons.get("empty", 0)
    spread = Counter(int(sum(v)) for v in per_question.values())
    sys.stdout.write(
        json.dumps(
            {
                "grader": args.grader,
                "system": args.system,
                "temperature": args.temperature,
                "max_new_tokens": args.max_new_tokens,
                "questions": len(per_question),
                "samples": n,
                "solve_rate": round(solved / n, 4),
                "answered": round(answered / n, 4),
                "reasons": dict(reasons),
                "solved_of_samples_per_question": {str(k): spread[k] for k in sorted(spread)},
                "truncated": sum(r.finish_reason == "length" for r in records),
                "mean_tokens": round(sum(r.num_tokens for r in records) / n, 1),
            },
            indent=1,
        )
        + "\n"
    )
    for r in records[: args.show * args.samples : args.samples]:
        sys.stdout.write(f"--- gold {r.gold} reward {r.reward} ({r.reason}) ---\n{r.response[-400:]}\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in records))


if __name__ == "__main__":
    main()
