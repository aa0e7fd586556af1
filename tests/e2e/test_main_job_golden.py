"""The quick main job with a fixed seed writes the same per-step metrics as the golden file.

`data/quick_main_job_metrics.jsonl` was written by `exgrpo run --quick --out DIR
experience.start_threshold=0.02` (one torch thread) with the `time` and `timing/*` keys dropped.
Refactors of the trainer or the one-box job must not change a number: every key of every line is
compared within a relative tolerance of 1e-4, and the set of keys must be the same. The tolerance is
the CPU's, not the code's: the same commit gives values that differ by up to 6e-6 relative on an
AVX2 machine and on the one that wrote the file (torch's float32 kernels sum in another order);
every sample, reward and selection is still the same, and a change of behaviour moves numbers by
far more.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "data" / "quick_main_job_metrics.jsonl"
REL_TOL = 1e-4


def _lines(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k != "time" and not k.startswith("timing/")} for row in rows]


def test_quick_main_job_metrics_match_the_golden_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "exgrpo_cli.main", "run", "--quick", "--out", str(out)]
    command.append("experience.start_threshold=0.02")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    got, want = _lines(out / "metrics.jsonl"), _lines(GOLDEN)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert set(g) == set(w), f"line {step}: keys differ: {sorted(set(g) ^ set(w))}"
        for key, expected in w.items():
            value = g[key]
            assert math.isclose(value, expected, rel_tol=REL_TOL, abs_tol=0.0) or value == expected, (
                f"line {step}, {key}: {value} != golden {expected}"
            )
