"""Step time of our trainer against TRL's GRPOTrainer on the same tiny model and batch, on CPU.

One invocation runs, in turn and in fresh processes, three kinds of run and repeats the round
(``--repeats``, rotating the order each round), so all of them share the machine's conditions:

* ``ours/grpo``: our trainer with experience off (``bench/trainer_bench.py _run --mode grpo``);
* ``trl``: TRL's ``GRPOTrainer`` from its own virtual environment (``bench/.venv-trl``, made by
  ``bench/setup_trl_env.sh``; TRL is never installed into the project's ``.venv``);
* ``ours/exgrpo``: our trainer with experience on, in the mixed phase with replay.

Both sides get the same model folder (tiny Qwen2 from ``exgrpo_onebox.tiny``), the same prompts
(synthetic ``a+b`` questions through the same chat template), K completions per prompt, the same
number of prompts per step, exactly ``max_new_tokens`` tokens per completion (``min_new_tokens`` set
to the same value on both sides), the same deterministic parity reward, one optimizer step per
training step, AdamW with the same learning rate / betas / weight decay / clipping, an entropy bonus
of 0.001, no KL term and no reference model (TRL ``beta=0``), a constant-normaliser loss (TRL
``loss_type="dr_grpo"``, rewards not scaled by the group std), float32 on CPU (``bf16=False``), no
vLLM, no gradient checkpointing, no saving, no evaluation, no reporting.

The step time of each run is the median over the measured steps (after warm-up) of the time between
the ends of consecutive steps, in wall-clock seconds and in CPU seconds of the trainer process (the
machine is shared: CPU time is the steadier of the two). Every number in the report is the median
across the rounds, and each ratio ours/TRL is taken within a round (same conditions) before its
median is taken. The breakdown on the TRL side comes from wrappers installed from here around
``model.generate``, ``model.forward``, ``_generate_and_score_completions``, ``compute_loss``,
``_get_per_token_logps_and_entropies``, ``Tensor.backward``, gradient clipping and the optimizer.

    bash bench/setup_trl_env.sh                      # once
    .venv/bin/python bench/trl_compare.py            # 3 rounds
    .venv/bin/python bench/trl_compare.py --quick    # 1 round, 4 measured steps
    .venv/bin/python bench/trl_compare.py --extra 'grpo*=grpo+no-fsdp'
                                                     # + our trainer with candidate fixes each round

Results: a table on stdout and ``bench/out/trl_compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_bench as tb

ROOT = tb.ROOT
TRL_VENV = Path(os.environ.get("EXGRPO_TRL_VENV", ROOT / "bench" / ".venv-trl"))
SIDES = ("ours/grpo", "trl", "ours/exgrpo")
GOAL_RATIO = 1.0


# ------------------------------------------------------------------------------- TRL worker
def _parity_reward(completions: list[Any], **_: Any) -> list[float]:
    """The parity reward on the completion text (deterministic; about half the samples pass)."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else str(c)
        out.append(float(sum(map(ord, text)) % 2 == 0))
    return out


def run_trl(p: tb.Params, model_path: Path, prompts: list[Any], folder: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer for warm-up + measured steps, timed and split like our trainer."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    folder.mkdir(parents=True, exist_ok=True)
    tb.set_threads(p.threads)
    rss_start_kb = tb._rss_kb()
    probe = tb.Probe()
    rows = p.k * p.questions_per_step
    config = GRPOConfig(
        output_dir=str(folder / "trl-out"),
        per_device_train_batch_size=rows,  # one forward/backward over all rows, like ours
        gradient_accumulation_steps=1,
        num_generations=p.k,
        max_completion_length=p.max_new_tokens,
        generation_kwargs={"min_new_tokens": p.max_new_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dr_grpo",
        scale_rewards="none",
        entropy_coef=0.001,
        learning_rate=p.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        max_steps=p.warmup + p.steps,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        use_vllm=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=p.seed,
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_list([{"prompt": q["prompt"]} for q in prompts])
    reward = probe.wrap("grading", _parity_reward)
    reward.__name__ = "parity"

    steps: list[dict[str, Any]] = []
    state: dict[str, Any] = {}

    def split(delta: dict[tuple[str, str], float], step_total: float) -> dict[str, Any]:
        """Our step record layout: phases (generate, update, outside) and kinds of work."""
        kinds: dict[str, float] = {}
        for (_phase, kind), sec in delta.items():
            kinds[kind] = kinds.get(kind, 0.0) + sec
        get = kinds.get
        head_total = get("logprob_head", 0.0)  # _get_per_token_logps_and_entropies, forward included
        kinds["logprob_head"] = head_total - get("model_forward", 0.0)
        kinds["loss"] = get("compute_loss", 0.0) - head_total
        update_kinds = (
            "model_forward",
            "logprob_head",
            "loss",
            "backward",
            "grad_clip",
            "optimizer_step",
            "zero_grad",
        )
        update = {k: get(k, 0.0) for k in update_kinds}
        phases = {ph: 0.0 for ph in tb.PHASES}
        phases["generate"] = get("generate_and_score", 0.0)
        phases["update"] = sum(update.values())
        phases["outside"] = step_total - phases["generate"] - phases["update"]
        by_phase = {
            "generate": {"engine_generate": get("engine_generate", 0.0), "grading": get("grading", 0.0)},
            "update": update,
        }
        return {"phases": phases, "kinds": kinds, "by_phase": by_phase}

    class Timer(TrainerCallback):
        def on_train_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            m = kw["model"]
            m.generate = probe.wrap("engine_generate", m.generate)
            m.forward = probe.wrap("model_forward", m.forward, unless_in="engine_generate")
            opt = kw["optimizer"]
            opt.step = probe.wrap("optimizer_step", opt.step)
            opt.zero_grad = probe.wrap("zero_grad", opt.zero_grad)
            m.zero_grad = probe.wrap("zero_grad", m.zero_grad)
            torch.Tensor.backward = probe.wrap("backward", torch.Tensor.backward)
            torch.nn.utils.clip_grad_norm_ = probe.wrap("grad_clip", torch.nn.utils.clip_grad_norm_)
            trainer._generate_and_score_completions = probe.wrap(
                "generate_and_score", trainer._generate_and_score_completions
            )
            trainer.compute_loss = probe.wrap("compute_loss", trainer.compute_loss)
            trainer._get_per_token_logps_and_entropies = probe.wrap(
                "logprob_head", trainer._get_per_token_logps_and_entropies
            )
            state["last"], state["last_cpu"] = time.perf_counter(), time.process_time()
            state["snap"] = probe.snapshot()

        def on_step_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            wall = time.perf_counter() - state["last"]
            cpu = time.process_time() - state["last_cpu"]
            delta, delta_cpu = tb.Probe.delta(state["snap"], probe.snapshot())
            w, c = split(delta, wall), split(delta_cpu, cpu)
            steps.append(
                {
                    "step": st.global_step,
                    "warmup": len(steps) < p.warmup,
                    "traced": False,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "phases": w["phases"],
                    "phases_cpu": c["phases"],
                    "kinds": w["kinds"],
                    "kinds_cpu": c["kinds"],
                    "by_phase": w["by_phase"],
                    "by_phase_cpu": c["by_phase"],
                    "rss_kb": tb._rss_kb(),
                    "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                    "replayed_questions": 0.0,
                    "rows": float(rows),
                }
            )
            state["last"], state["last_cpu"] = time.perf_counter(), time.process_time()
            state["snap"] = probe.snapshot()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    return {
        "side": "trl",
        "trl_version": __import__("trl").__version__,
        "torch_threads": torch.get_num_threads(),
        "rss_start_kb": rss_start_kb,
        "steps": steps,
        "summary": tb.summarize(steps),
    }


# ----------------------------------------------------------------------------------- driver
def _step_s(run: dict[str, Any], view: str) -> float:
    return float(run["summary"][view]["step_s_median"])


def spawn_trl(p: tb.Params, model: Path, prompts_file: Path, folder: Path) -> dict[str, Any]:
    out = folder / "result.json"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(TRL_VENV / "bin" / "python"),
        str(Path(__file__).resolve()),
        "_trl",
        "--params",
        json.dumps(asdict(p)),
        "--model",
        str(model),
        "--prompts",
        str(prompts_file),
        "--folder",
        str(folder),
        "--json",
        str(out),
    ]
    env = {**tb.child_env(p), "HF_HUB_OFFLINE": "1"}
    with open(folder / "trl.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (folder / "trl.log").read_text()[-3000:]
        raise RuntimeError(f"the TRL run failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def report(
    runs: dict[str, list[dict[str, Any]]], ratios: dict[str, dict[str, list[float]]]
) -> tuple[str, Any]:
    """The comparison table (wall and CPU views) and its data."""
    med = statistics.median
    sides = [s for s in runs if runs[s]]
    combined = {side: tb.combine(runs[side]) for side in sides}
    lines: list[str] = []

    for view, title in (("wall", "wall seconds per step"), ("cpu", "CPU seconds per step")):
        v = {side: combined[side][view] for side in sides}
        col = max(13, *(len(s) + 2 for s in sides))
        head = f"{title:<40}" + "".join(f"{s:>{col}}" for s in sides)
        lines.extend(["", head, "-" * len(head)])

        def row(
            label: str, fn: Any, pct: bool = False, only_ours: bool = False, _v: Any = v, _c: int = col
        ) -> None:
            cells = []
            for side in sides:
                if only_ours and side == "trl":
                    cells.append(f"{'-':>{_c}}")
                elif pct:
                    cells.append(f"{fn(_v[side]):>{_c - 1}.2f}%")
                else:
                    cells.append(f"{fn(_v[side]):>{_c}.3f}")
            lines.append(f"{label:<40}" + "".join(cells))

        def upd(x: dict[str, Any], *keys: str) -> float:
            return sum(x["by_phase_mean"].get("update", {}).get(k, 0.0) for k in keys)

        row("  plan (HTTP)", lambda x: x["phases_mean"]["plan"], only_ours=True)
        row("  rescore (replay choice)", lambda x: x["phases_mean"]["rescore"], only_ours=True)
        row("  generate (+ reward, rows)", lambda x: x["phases_mean"]["generate"])
        row("    of which model.generate", lambda x: x["kinds_mean"]["engine_generate"])
        row("  old log-probs (no-grad forward)", lambda x: x["phases_mean"]["old_logprob"])
        row("  update", lambda x: x["phases_mean"]["update"])
        row("    forward + log-prob head", lambda x: upd(x, "model_forward", "logprob_head"))
        row("    backward", lambda x: upd(x, "backward"))
        row("    optimizer (clip, step, zero)", lambda x: upd(x, "grad_clip", "optimizer_step", "zero_grad"))
        row(
            "    rest (loss, batching, metrics)",
            lambda x: (
                x["phases_mean"]["update"]
                - upd(
                    x, "model_forward", "logprob_head", "backward", "grad_clip", "optimizer_step", "zero_grad"
                )
            ),
        )
        row("  commit (HTTP)", lambda x: x["phases_mean"]["commit"], only_ours=True)
        row("  publish", lambda x: x["phases_mean"]["publish"], only_ours=True)
        row("  rest of the step", lambda x: x["phases_mean"]["outside"])
        row("  (metrics HTTP on a background thread)", lambda x: x["background_s_mean"], only_ours=True)
        row("step (mean)", lambda x: x["step_s_mean"])
        row("step (median)", lambda x: x["step_s_median"])
        row("overhead beyond compute, % of step", lambda x: x["overhead_pct"], pct=True)
    lines.append("")
    lines.append(
        f"{'peak RSS, getrusage (MB)':<40}" + "".join(f"{combined[s]['maxrss_mb']:>13.1f}" for s in sides)
    )
    lines.append("")
    res: dict[str, Any] = {"sides": combined, "ratios": {}}
    for view in ("wall", "cpu"):
        for name, vals in ratios[view].items():
            if vals:
                res["ratios"].setdefault(view, {})[name] = {
                    "median": med(vals),
                    "rounds": [round(x, 3) for x in vals],
                }
                rounds = ", ".join(f"{x:.3f}" for x in vals)
                lines.append(f"{name + ' (' + view + ')':<40}{med(vals):>13.3f}   rounds: {rounds}")
    return "\n".join(lines), res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_trl":  # the TRL side, run by bench/.venv-trl/bin/python
        ap = argparse.ArgumentParser(prog="trl_compare.py _trl")
        ap.add_argument("--params", required=True)
        ap.add_argument("--model", required=True, type=Path)
        ap.add_argument("--prompts", required=True, type=Path)
        ap.add_argument("--folder", required=True, type=Path)
        ap.add_argument("--json", required=True, type=Path)
        a = ap.parse_args(argv[1:])
        prompts = json.loads(a.prompts.read_text())
        result = run_trl(tb.Params(**json.loads(a.params)), a.model, prompts, a.folder)
        a.json.write_text(json.dumps(result, indent=1))
        return 0

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tb.add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three runs")
    ap.add_argument(
        "--extra",
        default="",
        help="more runs of ours per round: comma-separated trainer_bench modes, each optionally "
        "labelled (e.g. grpo*=grpo+no-fsdp); a mode ending in @DIR imports the trainer "
        "from DIR first (e.g. before=grpo@/tmp/old-checkout-packages)",
    )
    ap.add_argument("--out", type=Path, default=tb.OUT / "trl_compare.json")
    args = ap.parse_args(argv)
    if not (TRL_VENV / "bin" / "python").is_file():
        print(f"no TRL environment at {TRL_VENV}: run `bash bench/setup_trl_env.sh` first", file=sys.stderr)
        return 2
    p = tb.params_from_args(args)
    p = tb.Params(**{**asdict(p), "trace_steps": 0})  # no tracemalloc steps here
    repeats = 1 if args.quick else args.repeats
    info = tb.machine()
    model = tb.ensure_model(p)
    modes = {"ours/grpo": "grpo", "ours/exgrpo": "exgrpo"}  # side label -> trainer_bench mode
    for item in (x.strip() for x in args.extra.split(",")):
        if item:
            label, _, mode = item.rpartition("=")
            tb.parse_mode(mode.partition("@")[0])  # fail early on a bad name
            modes[f"ours/{label or mode}"] = mode
    sides = [*SIDES, *(m for m in modes if m not in SIDES)]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    names = [f"{side} : trl" for side in sides if side != "trl"] + ["ours/exgrpo : ours/grpo"]
    ratios: dict[str, dict[str, list[float]]] = {view: {n: [] for n in names} for view in ("wall", "cpu")}
    tb.WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trl-compare-", dir=tb.WORK) as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(tb.questions(p.questions)))
        for r in range(repeats):
            shift = r % len(sides)
            got: dict[str, dict[str, Any]] = {}
            for side in sides[shift:] + sides[:shift]:
                print(f"[trl-compare] round {r + 1}/{repeats}: {side}", file=sys.stderr, flush=True)
                folder = Path(tmp) / f"{side.replace('/', '-').replace('+', '_')}-{r}"
                if side == "trl":
                    got[side] = spawn_trl(p, model, prompts_file, folder)
                else:
                    got[side] = tb.spawn_run(modes[side], p, model, folder)
                runs[side].append(got[side])
            for view in ("wall", "cpu"):
                trl = _step_s(got["trl"], view)
                for side in sides:
                    if side != "trl":
                        ratios[view][f"{side} : trl"].append(_step_s(got[side], view) / trl)
                on, off = _step_s(got["ours/exgrpo"], view), _step_s(got["ours/grpo"], view)
                ratios[view]["ours/exgrpo : ours/grpo"].append(on / off)
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    table, res = report(runs, ratios)
    print(
        f"\ntiny Qwen2 hidden={p.hidden} layers={p.layers}, K={p.k}, B={p.questions_per_step}, "
        f"{p.max_new_tokens} new tokens, {p.steps} measured steps after {p.warmup} warm-up, "
        f"{repeats} rounds, {p.threads} torch thread(s) per process; "
        f"load average {info['loadavg_start']} -> {info['loadavg_end']}"
    )
    print(table)
    for view in ("wall", "cpu"):
        ratio = res["ratios"].get(view, {}).get("ours/grpo : trl", {}).get("median")
        if ratio is not None:
            verdict = "met" if ratio <= GOAL_RATIO else "missed"
            print(f"ours (experience off) / TRL, {view}: {ratio:.3f} (goal <= {GOAL_RATIO}: {verdict})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = {"machine": info, "params": asdict(p), "modes": modes, **res, "runs": runs}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
