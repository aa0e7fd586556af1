"""The trainer in the stack's one log format (exgrpo_client.logs), its output on pipes: with
`--log-format json` every line it writes, on stdout and stderr, is a JSON object with the fixed
fields (its settings and its step lines included) and no progress bar is drawn although
`logging.progress` asks for one; with `--log-format plain` its step lines are plain log lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from exgrpo_client import Client

from ._helpers import child_env, make_pool, run_overrides

EXGRPO = Path(sys.executable).with_name("exgrpo")


def _train(url: str, pool: str, model: Path, out: Path, fmt: str) -> subprocess.CompletedProcess[str]:
    """`exgrpo train` of two steps on a fresh pool, stdout and stderr on pipes."""
    with Client(url) as client:
        make_pool(client, pool, start_threshold=0.0)
    settings = run_overrides(None, pool, model, out, "run.steps=2", "logging.progress=true")
    command = [str(EXGRPO), "--url", url, "train", "--log-format", fmt, "--config", "grpo", *settings]
    env = {k: v for k, v in child_env().items() if k != "EXGRPO_LOG_FORMAT"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_trainer_json_log_lines(live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path) -> None:
    proc = _train(live_server.url, pool_name, tiny_model, tmp_path / "run", "json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "\r" not in text and "━" not in text, "a progress bar in the log"
    records: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    assert all({"ts", "level", "logger", "event"} <= set(r) for r in records)
    settings = [r for r in records if r["event"] == "trainer settings"]
    assert len(settings) == 1 and settings[0]["settings"]["run"]["steps"] == 2
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["logger"] == "exgrpo.trainer" and "batch/solved" in r and r["phase"] for r in steps)


@pytest.mark.timeout(300)
def test_trainer_plain_step_lines(live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path) -> None:
    proc = _train(live_server.url, pool_name, tiny_model, tmp_path / "run", "plain")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("# exgrpo trainer settings")  # the settings stay readable
    assert "\r" not in proc.stderr and "━" not in proc.stderr
    steps = [line for line in proc.stderr.splitlines() if " exgrpo.trainer: step " in line]
    assert [line.split(" step step=")[1].split()[0] for line in steps] == ["1", "2"], proc.stderr
    assert all(" batch/solved=" in line and " phase=" in line for line in steps)
