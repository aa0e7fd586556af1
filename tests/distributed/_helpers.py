"""Shared pieces of the trainer tests: a grader the random tiny model can pass, pools of synthetic
arithmetic questions, run settings, a client that records what the trainer sends, launching
processes that import this module, and comparing two runs step by step."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from exgrpo_client import Client
from exgrpo_client import schemas as s
from exgrpo_rollout.graders.base import Grade
from exgrpo_trainer.config import TrainConfig, load_config


def parity(response: str, ground_truth: str) -> Grade:
    """Reward 1 when the response's code points sum to an even number: about half of the random
    model's samples pass, deterministically in the text (a stored trajectory re-grades the same)."""
    del ground_truth
    return Grade(float(sum(map(ord, response)) % 2 == 0), "parity")


PARITY = f"{__name__}:parity"
"""The grader setting for `parity` (a dotted-path plug-in)."""

HOLD_ENV = "EXGRPO_TEST_HOLD"


def held_parity(response: str, ground_truth: str) -> Grade:
    """`parity`, held while the file named by $EXGRPO_TEST_HOLD exists (5 minutes at most), so a
    test can keep a trainer inside a step; the first call creates `<that file>.reached`."""
    hold = os.environ.get(HOLD_ENV)
    if hold:
        Path(f"{hold}.reached").touch()
        end = time.monotonic() + 300
        while Path(hold).exists() and time.monotonic() < end:
            time.sleep(0.05)
    return parity(response, ground_truth)


HELD_PARITY = f"{__name__}:held_parity"


def make_pool(
    client: Client, name: str, *, questions: int = 24, k: int = 4, batch_size: int = 4, **rules: Any
) -> None:
    """A pool of `a+b` questions with K rollouts per question and B questions per step."""
    client.create_pool(name, config={"k": k, "batch_size": batch_size, **rules})
    items = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "ground_truth": str(a + b)}
        for a in range(6)
        for b in range(questions // 6)
    ]
    client.import_questions(name, items[:questions])


def run_overrides(url: str | None, pool: str, model: Path, out: Path, *overrides: str) -> list[str]:
    """Small, fast settings as `key=value` items: short responses, in-process grading, no
    TensorBoard or progress bar. Without `url`, run.pool_url is left to the caller (e.g. `--url`)."""
    return [
        *([f"run.pool_url={url}"] if url is not None else []),
        f"run.pool={pool}",
        f"run.output_dir={out}",
        f"model.path={model}",
        "rollout.max_new_tokens=12",
        "rollout.min_new_tokens=4",
        f"rollout.grader={PARITY}",
        "rollout.grading_workers=0",
        "optim.lr=1e-3",
        "logging.tensorboard=false",
        "logging.progress=false",
        *overrides,
    ]


def run_config(url: str, pool: str, model: Path, out: Path, *overrides: str) -> TrainConfig:
    """`run_overrides` as a validated config, for training in this process."""
    return load_config(None, run_overrides(url, pool, model, out, *overrides))


def read_metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class RecordingClient(Client):
    """A real client that keeps every plan it received, every commit it sent with its answer, and
    every run-metrics post (step, the thread it came from, metrics) and run-stats request."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.plans: list[s.BatchPlan] = []
        self.commits: list[list[s.GroupResult]] = []
        self.commit_results: list[s.CommitResult] = []
        self.metric_posts: list[tuple[int, str, dict[str, float]]] = []
        self.stats_requests = 0

    def plan_batch(self, pool: str, run: str, **fields: Any) -> s.BatchPlan:
        plan = super().plan_batch(pool, run, **fields)
        self.plans.append(plan)
        return plan

    def commit_batch(self, pool: str, batch_id: str, groups: Any, *args: Any, **kw: Any) -> s.CommitResult:
        self.commits.append(list(groups))
        result = super().commit_batch(pool, batch_id, groups, *args, **kw)
        self.commit_results.append(result)
        return result

    def post_run_metrics(self, pool: str, run: str, step: int, metrics: Any) -> s.RunMetricsStep:
        answer = super().post_run_metrics(pool, run, step, metrics)
        self.metric_posts.append((step, threading.current_thread().name, dict(metrics)))
        return answer

    def run_stats(self, pool: str, run: str) -> s.RunStats:
        self.stats_requests += 1
        return super().run_stats(pool, run)


# ------------------------------------------------------------------------------- processes
def torchrun(nproc: int, *args: str) -> list[str]:
    """A command line running `args` (a script or `-m module`, then its arguments) on `nproc`
    ranks; one rank runs it without a launcher."""
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def child_env() -> dict[str, str]:
    """The environment of a trainer or worker process started by a test: one torch thread, no
    service address from the caller's shell, and the tests folder importable (the `PARITY` grader
    is loaded by its module name)."""
    tests_root = Path(__file__).parents[__name__.count(".")]
    env = {k: v for k, v in os.environ.items() if k not in ("EXGRPO_URL", "EXGRPO_TOKEN")}
    env.update(
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONPATH=os.pathsep.join([str(tests_root), env.get("PYTHONPATH", "")]),
    )
    return env


# ------------------------------------------------------------------------------ comparison
def assert_same_metrics(a: list[dict[str, float]], b: list[dict[str, float]], keys: tuple[str, ...]) -> None:
    """The same steps, and at each step the same value of every key (relative tolerance 1e-6)."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for ma, mb in zip(a, b, strict=True):
        for key in keys:
            close = abs(ma[key] - mb[key]) <= 1e-6 * max(1.0, abs(ma[key]))
            assert close, (ma["step"], key, ma[key], mb[key])


def assert_same_weights(a: Path, b: Path) -> dict[str, torch.Tensor]:
    """Two published folders hold exactly the same weights; returns `a`'s."""
    wa, wb = (load_file(str(folder / "model.safetensors")) for folder in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    return wa
