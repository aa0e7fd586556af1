"""Shared pieces of the trainer tests: a grader the random tiny model can pass, pools of synthetic
arithmetic questions, run settings, and a client that records what the trainer sends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def run_config(url: str, pool: str, model: Path, out: Path, *overrides: str) -> TrainConfig:
    """Small, fast settings: short responses, in-process grading, no TensorBoard or progress bar."""
    return load_config(
        None,
        [
            f"run.pool_url={url}",
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
        ],
    )


def read_metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class RecordingClient(Client):
    """A real client that keeps every plan it received and every commit it sent."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.plans: list[s.BatchPlan] = []
        self.commits: list[list[s.GroupResult]] = []

    def plan_batch(self, pool: str, run: str, **fields: Any) -> s.BatchPlan:
        plan = super().plan_batch(pool, run, **fields)
        self.plans.append(plan)
        return plan

    def commit_batch(self, pool: str, batch_id: str, groups: Any, *args: Any, **kw: Any) -> s.CommitResult:
        self.commits.append(list(groups))
        return super().commit_batch(pool, batch_id, groups, *args, **kw)
