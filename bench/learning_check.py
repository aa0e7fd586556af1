"""Does the trainer learn? ExGRPO on the warm-started tiny model, on 2 CPU cores, in minutes.

1. Warm start (`exgrpo_onebox.warmstart.prepare_model`, cached in OUT/model).
2. A pool service on a loopback port in a thread (SQLite in OUT), a pool with K = 8 and B = 16,
   and 800 training questions (levels 1-4 weighted 1:3:3:3, written to OUT/train.parquet and read
   back with the project's question reader).
3. Held-out accuracy before: `warmstart.heldout_problems()` (200 problems, levels 1-4), 4 samples
   each at temperature 1.0 and 2 at 0.6, with the transformers engine and the `arithmetic` grader.
4. The real trainer (`run_training`) with the one-box job's `cpu_demo` recipe (or `cpu_demo_quick`),
   plus any `key=value` overrides, resolved by `exgrpo_onebox.config.resolve`.
5. Held-out accuracy of the final published weights, the same way; OUT/report.json.

    OMP_NUM_THREADS=1 python bench/learning_check.py --out /tmp/lc
    OMP_NUM_THREADS=1 python bench/learning_check.py --out /tmp/lcq --quick
    OMP_NUM_THREADS=1 python bench/learning_check.py --out /tmp/lc2 optim.lr=1e-3 run.steps=80
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_client import Client
from exgrpo_client.io import read_questions
from exgrpo_onebox.config import MainJobOptions, resolve
from exgrpo_onebox.main_job import prepare_pool
from exgrpo_onebox.synthetic import make_problems, write_parquet
from exgrpo_onebox.warmstart import evaluate_accuracy, heldout_problems, prepare_model
from exgrpo_pool.config import Settings
from exgrpo_pool.embedded import serve_in_thread
from exgrpo_trainer import run_training


def accuracy(folder: Path, seed: int) -> dict[str, dict[str, float]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    heldout = heldout_problems()
    return {
        "t1.0": evaluate_accuracy(model, tok, heldout, temperature=1.0, samples=4, seed=seed),
        "t0.6": evaluate_accuracy(model, tok, heldout, temperature=0.6, samples=2, seed=seed),
    }


def _round(d: Any) -> Any:
    return {k: _round(v) for k, v in d.items()} if isinstance(d, dict) else round(d, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="the quick warm start and cpu_demo_quick")
    parser.add_argument("--seed", type=int, default=0, help="warm-start seed (and run.seed)")
    parser.add_argument("--model", type=Path, default=None, help="a warm-started model folder to reuse")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    args.out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    start = time.perf_counter()

    model = args.model or prepare_model(args.out / "model", seed=args.seed, quick=args.quick)
    timings["warm_start"] = time.perf_counter() - start
    warm = json.loads((model / "warmstart.json").read_text())

    train = make_problems(800, 0, {1: 1, 2: 3, 3: 3, 4: 3}, split="train")
    path = write_parquet(args.out / "train.parquet", [p.to_row(i, "train") for i, p in enumerate(train)])
    t = time.perf_counter()
    before = accuracy(model, seed=1)
    timings["eval_before"] = time.perf_counter() - t

    run_dir = args.out / f"run-{int(time.time())}"
    recipe = "cpu_demo_quick" if args.quick else "cpu_demo"
    options = MainJobOptions(
        quick=args.quick, model=model, out=run_dir, seed=args.seed, overrides=args.overrides
    )
    cfg = resolve(options).config  # K = 8, B = 16 and the rest, as `exgrpo run` would train
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{args.out / 'pool.db'}",
        allow_anonymous=True,
        host="127.0.0.1",
        port=0,
        log_level="WARNING",
    )
    with serve_in_thread(settings) as srv, Client(srv.url) as client:
        cfg.run.pool_url = srv.url
        cfg.run.pool = f"arith-{run_dir.name}"
        prepare_pool(client, cfg, [q for chunk in read_questions(path) for q in chunk], "learning check")
        t = time.perf_counter()
        run_training(cfg, client=client)
        timings["train"] = time.perf_counter() - t
    final = run_dir / "published" / cfg.run.pool / cfg.run.name / f"v{cfg.run.steps:06d}"
    t = time.perf_counter()
    after = accuracy(final, seed=1)
    timings["eval_after"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - start

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [round(m["batch/solved"], 2) for m in metrics]
    report = {
        "recipe": recipe,
        "overrides": args.overrides,
        "steps": cfg.run.steps,
        "warm_start": {k: warm.get(k) for k in ("parameters", "train_seconds", "accuracy")},
        "before": _round(before),
        "after": _round(after),
        "batch_solved": curve,
        "switched_at": next((m["step"] for m in metrics if m.get("phase/switched")), None),
        "entropy": [round(m["actor/entropy"], 3) for m in metrics],
        "seconds": {k: round(v, 1) for k, v in timings.items()},
        "step_seconds": round(sum(m["timing/step"] for m in metrics) / len(metrics), 2),
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
