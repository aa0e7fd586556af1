"""`exgrpo train` end to end against the real service: in process (one rank), and under torchrun
with two ranks of FSDP2 over gloo, from the shipped recipes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from exgrpo_cli.main import app
from exgrpo_client import Client

from ._helpers import child_env, make_pool, read_metrics, run_overrides

EXGRPO = Path(sys.executable).with_name("exgrpo")
BANNER = "# exgrpo trainer settings"


def _overrides(pool: str, model: Path, out: Path, steps: int) -> list[str]:
    return run_overrides(None, pool, model, out, f"run.steps={steps}")  # the URL comes from --url


def test_train_in_process_from_the_grpo_recipe(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXGRPO_URL", raising=False)
    monkeypatch.delenv("EXGRPO_TOKEN", raising=False)
    with Client(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.0)
    out = tmp_path / "run"
    args = ["--url", live_server.url, "train", "--config", "grpo", *_overrides(pool_name, tiny_model, out, 2)]
    result = CliRunner().invoke(app, [*args, "model.activation_checkpointing=false"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(BANNER)
    assert f"pool_url: {live_server.url}" in result.stdout and "enabled: false" in result.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2]
    with Client(live_server.url) as client:
        run = client.get_run(pool_name, "grpo-1")  # the recipe's run name
    assert run.step == 2 and run.phase == "on_policy"


@pytest.mark.timeout(300)
def test_train_two_ranks_under_torchrun(
    live_server: Any, pool_name: str, tiny_model: Path, tmp_path: Path
) -> None:
    with Client(live_server.url) as client:
        make_pool(client, pool_name, start_threshold=0.2)
    out = tmp_path / "run"
    env = child_env()  # the ranks import the test grader by its module name
    command = [str(EXGRPO), "--url", live_server.url, "train", "--config", "exgrpo", "--nproc", "2"]
    command += [*_overrides(pool_name, tiny_model, out, 3), "schedule.publish_every=2"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count(BANNER) == 1, "rank 0 prints the settings"

    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["batch/solved"] > 0.2
    assert metrics[2]["batch/replayed_questions"] > 0 and "is/w_mean" in metrics[2]
    with Client(live_server.url) as client:
        run = client.get_run(pool_name, "exgrpo-1")
        versions = client.list_policy_versions(pool_name, "exgrpo-1")
    assert run.step == 3 and run.phase == "mixed"
    assert [v.version for v in versions.data] == [2, 3]
    last = out / "checkpoints" / pool_name / "exgrpo-1" / "step-000003"
    assert (last / "extra-rank0.pt").is_file() and (last / "extra-rank1.pt").is_file()
