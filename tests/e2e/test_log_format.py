"""One log format across the processes of the stack, checked on the real commands with their output
on pipes (not a terminal): `exgrpo serve` and `exgrpo rollout` write only JSON lines with
`--log-format json` and only `ts LEVEL logger: event key=value` lines with `--log-format plain`,
with no progress bar; `exgrpo run` draws no progress bar and wraps no line when its output is not a
terminal. (The trainer's own check is tests/distributed/test_trainer_logs.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from exgrpo_client import Client
from exgrpo_onebox.tiny import build_tiny_model

EXGRPO = Path(sys.executable).with_name("exgrpo")
FIELDS = ("ts", "level", "logger", "event")
PLAIN = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")
PROGRESS = ("\r", "it/s]", "█")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXGRPO_") and k != "COLUMNS"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line as a JSON object with the fixed fields; fails on the first one that is not."""
    assert not any(mark in text for mark in PROGRESS), "a progress bar in the log"
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(doc, dict) and all(k in doc for k in FIELDS), line
        out.append(doc)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(tmp_path: Path, fmt: str) -> tuple[str, str]:
    """Start `exgrpo serve`, ask it three things, stop it with Ctrl-C: its stdout and stderr."""
    port = _free_port()
    env = _env(
        EXGRPO_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}",
        EXGRPO_ALLOW_ANONYMOUS="true",
        EXGRPO_PORT=str(port),
        EXGRPO_LOG_LEVEL="INFO",
    )
    proc = subprocess.Popen(
        [str(EXGRPO), "serve", "--log-format", fmt],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "the service did not start"
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/pools/missing").status_code == 404
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return out, err


def test_service_json_log_has_one_object_per_line_uvicorn_and_access_log_included(tmp_path: Path) -> None:
    out, err = _serve(tmp_path, "json")
    records = _json_lines(out + err)
    loggers = {r["logger"] for r in records}
    assert "uvicorn.error" in loggers  # uvicorn's own lines take the same path
    access = [r for r in records if r["logger"] == "exgrpo.access"]
    assert {(r["path"], r["status"]) for r in access} >= {("/healthz", 200), ("/v1/pools/missing", 404)}
    assert all(r["event"] == "request" and r["request_id"] for r in access)
    settings = [r for r in records if r["event"] == "pool service settings"]
    assert len(settings) == 1 and settings[0]["port"] > 0  # the settings, as a record too


def test_service_plain_log_carries_the_same_fields(tmp_path: Path) -> None:
    _, err = _serve(tmp_path, "plain")
    lines = err.splitlines()
    assert lines and all(PLAIN.match(line) for line in lines), lines
    access = [line for line in lines if " exgrpo.access: request " in line]
    assert any("path=/v1/pools/missing" in line and "status=404" in line for line in access), access
    assert any(" uvicorn.error: " in line for line in lines)


# ------------------------------------------------------------------------------------ worker
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("logs") / "tiny")


def _worker(url: str, model: Path, pool: str, fmt: str) -> subprocess.CompletedProcess[str]:
    command = [
        str(EXGRPO), "--url", url, "rollout", "--log-format", fmt,
        "--pool", pool, "--run", "r1", "--model", str(model), "--grading-workers", "0",
        "--max-new-tokens", "8", "--max-prompt-len", "128", "--device", "cpu", "--torch-threads", "1",
        "--idle-exit", "1", "--backoff-max", "0.2",
    ]  # fmt: skip
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_worker_json_log_has_no_progress_bar(live_server: Any, tiny_model: Path, pool_name: str) -> None:
    with Client(live_server.url) as client:
        client.create_pool(pool_name, {"k": 2, "batch_size": 2})
        questions = [
            {"prompt": [{"role": "user", "content": f"{i}+{i}"}], "ground_truth": str(2 * i)}
            for i in range(3)
        ]
        client.import_questions(pool_name, questions)
        client.create_run(pool_name, "r1")
        client.plan_batch(pool_name, "r1", create_tasks=True)
    proc = _worker(live_server.url, tiny_model, pool_name, "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [r["event"] for r in _json_lines(proc.stdout + proc.stderr)]  # the model load included
    assert "worker_started" in events and events.count("task_completed") == 2 and "worker_stopped" in events


@pytest.mark.timeout(300)
def test_worker_plain_log(live_server: Any, tiny_model: Path, pool_name: str) -> None:
    with Client(live_server.url) as client:
        client.create_pool(pool_name, {"k": 2, "batch_size": 2})
        client.create_run(pool_name, "r1")
    proc = _worker(live_server.url, tiny_model, pool_name, "plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert not any(mark in proc.stderr for mark in PROGRESS)
    assert lines and all(PLAIN.match(line) for line in lines), lines
    assert any(": worker_started " in line and pool_name in line for line in lines), lines


def test_a_bad_log_format_is_one_line_and_status_1(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(EXGRPO), "serve", "--log-format", "xml"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "xml" in proc.stderr


# ---------------------------------------------------------------------------------- main job
@pytest.mark.timeout(900)
def test_main_job_off_a_terminal_draws_no_progress_and_wraps_no_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    # a deep run folder makes the lines that name it longer than 80 columns
    out = tmp_path / ("a-long-folder-name-" * 4) / "run"
    command = [
        str(EXGRPO), "run", "--quick", "--model", str(tiny_model), "--out", str(out), "--heldout", "4",
        "run.steps=2", "experience.batch_size=2", "pool.k=2", "job.train_questions=8",
        "rollout.max_new_tokens=8", "job.eval_max_new_tokens=8", "logging.progress=true",
    ]  # fmt: skip
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=850, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert not any(mark in text for mark in PROGRESS), text
    lines = text.splitlines()
    steps = [line for line in lines if " exgrpo.trainer: step step=" in line]  # plain log lines
    assert len(steps) == 2 and all(line.endswith(("phase=on_policy", "phase=mixed")) for line in steps), text
    assert any(line.startswith("outputs:") and line.endswith(str(out)) for line in lines), lines
    assert any(str(out / "metrics.jsonl") in line for line in lines)


@pytest.mark.slow  # a second main job (the plain one above runs by default): scripts/test.sh -m slow
@pytest.mark.timeout(900)
def test_main_job_json_log_lines(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "run"
    command = [
        str(EXGRPO), "run", "--log-format", "json", "--quick", "--model", str(tiny_model), "--out", str(out),
        "--heldout", "4", "run.steps=2", "experience.batch_size=2", "pool.k=2", "job.train_questions=8",
        "rollout.max_new_tokens=8", "job.eval_max_new_tokens=8",
    ]  # fmt: skip
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=850, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _json_lines(proc.stdout + proc.stderr)
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2] and all("batch/solved" in r for r in steps)
    assert any(r["event"].startswith("outputs:") and r["event"].endswith(str(out)) for r in records)
