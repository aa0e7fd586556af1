"""Check the NCCL weight update into vLLM for real (two GPUs and vLLM), and time it.

    python scripts/vllm_nccl_check.py                     # builds a tiny Qwen2 in a temporary folder
    python scripts/vllm_nccl_check.py --model DIR --versions 5

Run it with the python of the environment that has vLLM (see docs/rollout.md), on a host with at
least two GPUs: vLLM's worker takes the first visible GPU, the trainer side (`NcclWeightSender`)
the second; a NCCL communicator cannot hold one device twice. It

1. starts `VLLMEngine` (tensor parallel 1) and generates greedily for a few prompts;
2. builds the trainer's weight-update group with the vLLM worker (`vllm_nccl.connect`);
3. per version: moves every weight of a float32 copy of the model on the trainer GPU, broadcasts the
   state dict (`push_weights`: vLLM's collective RPC receives and loads it), timed;
4. checks that greedy generation after the NCCL update equals generation after loading the same
   weights from a safetensors folder (`load_weights`) and from a shared-memory segment
   (`load_policy_uri("shm://...")`, the worker fetches it itself), and differs from the original;
5. prints one JSON line (it starts with `{"check"`) with the times: NCCL update, folder reload,
   shared-memory reload; exits 0 when every check passes, 1 otherwise.

`exgrpo_rollout` need not be installed in that environment (see scripts/vllm_check.py).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_check import make_importable


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF model folder (default: build a tiny Qwen2)")
    p.add_argument("--workdir", type=Path, help="where to write the tiny model and the weight folders")
    p.add_argument("--versions", type=int, default=3, help="NCCL updates timed")
    p.add_argument("--port", type=int, default=29631, help="TCP port of the weight-update group's store")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    make_importable()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from exgrpo_rollout.engines.vllm import VLLMEngine
    from exgrpo_rollout.engines.vllm_nccl import connect, push_weights
    from exgrpo_rollout.weights import SHM_ROOT, encoded_layout, write_state

    if torch.cuda.device_count() < 2:
        print(json.dumps({"check": "vllm_nccl", "ok": False, "error": "needs two visible GPUs"}))
        return 1
    work = args.workdir or Path(tempfile.mkdtemp(prefix="exgrpo-nccl-"))
    model_dir = args.model
    if model_dir is None:
        from exgrpo_onebox.tiny import build_tiny_model

        model_dir = build_tiny_model(work / "tiny", hidden=128, layers=2)
    engine = VLLMEngine(
        str(model_dir), seed=0, enforce_eager=True, gpu_memory_utilization=args.gpu_memory_utilization
    )
    import vllm

    n_new = args.max_new_tokens
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=n_new, min_tokens=n_new)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]

    def tokens() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in engine.llm.generate(prompts, greedy, use_tqdm=False)]

    original = tokens()
    trainer_gpu = torch.device("cuda:1")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(trainer_gpu).eval()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    sender = connect(engine, "127.0.0.1", args.port, trainer_gpu, workers=1)
    nccl_s: list[float] = []
    torch.manual_seed(0)
    state: dict[str, Any] = {}
    for _ in range(args.versions):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        torch.cuda.synchronize(trainer_gpu)
        start = time.perf_counter()
        counts = push_weights(engine, sender, state)
        nccl_s.append(time.perf_counter() - start)
        if counts != [len(state)]:
            raise AssertionError(f"the worker loaded {counts} tensors, {len(state)} were sent")
    after_nccl = tokens()

    cpu_state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    folder = work / "perturbed"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(cpu_state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine.load_weights(str(model_dir))
    back_to_original = tokens()
    start = time.perf_counter()
    engine.load_weights(str(folder))
    folder_s = time.perf_counter() - start
    after_folder = tokens()

    engine.load_weights(str(model_dir))
    segment = f"exgrpo-nccl-check-{os.getpid()}.v000001"
    prefix, placed, total = encoded_layout(cpu_state)
    with open(SHM_ROOT / segment, "w+b") as f:
        f.truncate(total)
        with mmap.mmap(f.fileno(), total) as mm:
            write_state(prefix, placed, mm)
    try:
        start = time.perf_counter()
        engine.load_policy_uri(f"shm://{segment}")
        shm_s = time.perf_counter() - start
        after_shm = tokens()
    finally:
        (SHM_ROOT / segment).unlink()

    checks = {
        "file_reload_restores_the_original": back_to_original == original,
        "nccl_changed_the_weights": after_nccl != original,
        "nccl_equals_folder_reload": after_nccl == after_folder,
        "nccl_equals_shm_reload": after_nccl == after_shm,
    }
    mb = sum(t.numel() * t.element_size() for t in cpu_state.values()) / 2**20
    print(
        json.dumps(
            {
                "check": "vllm_nccl",
                "ok": all(checks.values()),
                "checks": checks,
                "model": str(model_dir),
                "mb_sent_float32": round(mb, 1),
                "nccl_update_s_median": round(statistics.median(nccl_s), 4),
                "nccl_update_s": [round(x, 4) for x in nccl_s],
                "folder_reload_s": round(folder_s, 4),
                "shm_reload_s": round(shm_s, 4),
                "vllm": vllm.__version__,
                "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
            }
        )
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
