"""Where a step's rollouts come from, and how they are graded.

A rollout source turns a `StepBatch` into, per question slot, `q.num_generations(K)` samples (K for
a fresh question, K-1 for a replayed one): `ColocatedRollouts` generates with the trainer's own
weights, `RemoteRollouts` waits for the rollout workers to complete the batch's generation tasks
(and keeps what they report: the sampler's log-probs and mean entropies, and the policy version
each group was generated with). `Grader` rewards responses on rank 0. Every method is called on
every rank and returns the same value on all of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from exgrpo_client import schemas as s
from exgrpo_rollout.engines.base import Completion, SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.graders.pool import GradingPool, grade_items
from exgrpo_trainer import dist
from exgrpo_trainer.batch import StepBatch
from exgrpo_trainer.config import RolloutSection
from exgrpo_trainer.learner import derived_seed, split_even
from exgrpo_trainer.model import generation_view, unsharded
from exgrpo_trainer.pool_session import PoolSession


@dataclass
class Generated:
    """A step's generated samples, slot by slot, with what the sampler reported about them."""

    samples: list[list[Completion]]
    """Per question slot, its `q.num_generations(K)` samples."""
    versions: list[int] | None = None
    """Per slot, the policy version its samples were generated with (remote workers; a group whose
    worker did not say counts as the batch's planned version). None: the trainer's own weights."""
    entropies: list[list[float | None]] | None = None
    """Per slot and sample, the sampler's mean token entropy (remote workers), if reported."""


class RolloutSource(Protocol):
    remote: bool
    """Whether the batch's generation is done by rollout workers (the plan must create tasks)."""

    def generate(self, batch: StepBatch) -> Generated: ...


def sampling_params(cfg: RolloutSection) -> s.SamplingParams:
    """The trainer's sampling settings as a plan sends them with its generation tasks."""
    return s.SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_new_tokens,
        min_tokens=min(cfg.min_new_tokens, cfg.max_new_tokens),
    )


class ColocatedRollouts:
    """All samples of the step in one `generate` call of the trainer's own model: each prompt
    repeated once per sample it needs, one sample per row, so the decode loop runs once per step
    whatever the mix. The rows are split evenly over the ranks."""

    remote = False

    def __init__(
        self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: RolloutSection, seed: int
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.seed = seed
        self.engine = TransformersEngine(
            cast(PreTrainedModel, generation_view(model)),  # computes with the weights `unsharded` gathers
            tokenizer,
            max_batch_rows=cfg.max_batch_rows,
            synced_gpus=dist.world() > 1,
            record=False,  # the update recomputes log-probs and entropies of every generated row
        )

    def generate(self, batch: StepBatch) -> Generated:
        slots = [i for i, q in enumerate(batch.questions) for _ in range(q.num_generations(batch.k))]
        out: list[list[Completion]] = [[] for _ in batch.questions]
        mine, per = split_even(slots, dist.world(), dist.rank())
        if per == 0:
            return Generated(out)
        mine += [slots[0]] * (per - len(mine))  # equal work on every rank (throw-away pads)
        sampling = SamplingConfig(
            n=1,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            max_new_tokens=self.cfg.max_new_tokens,
            min_new_tokens=self.cfg.min_new_tokens,
            seed=derived_seed(self.seed, batch.step, "generate", dist.rank()),
        )
        with unsharded(self.model), torch.no_grad():
            res = self.engine.generate([batch.questions[i].prompt_ids for i in mine], sampling)
        gathered = dist.gather([cs[0] for cs in res])
        flat = [c for part in gathered for c in part][: len(slots)]
        for i, c in zip(slots, flat, strict=True):
            out[i].append(c)
        return Generated(out)


class RemoteRollouts:
    """The batch's generation tasks, completed by rollout workers (`exgrpo rollout`); rank 0 waits
    for them on the pool and shares the samples."""

    remote = True

    def __init__(self, session: PoolSession, tokenizer: PreTrainedTokenizerBase, cfg: RolloutSection) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.cfg = cfg

    def generate(self, batch: StepBatch) -> Generated:
        out = self._collect(batch) if dist.is_main() else None
        generated: Generated = dist.broadcast(out)
        return generated

    def _collect(self, batch: StepBatch) -> Generated:
        plan_id = batch.plan.id
        deadline = time.monotonic() + self.cfg.results_timeout_s
        while True:
            res = self.session.batch_results(plan_id, wait=30.0)
            if res.complete:
                break
            # a task failed for good (attempts used up, or the batch was re-planned) never completes
            failed = self.session.failed_tasks(plan_id)
            if failed:
                raise RuntimeError(
                    f"batch {plan_id}: {failed} generation tasks failed for good; the rollout "
                    "workers' logs name the errors"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"batch {plan_id}: workers did not finish within rollout.results_timeout_s"
                )
        by_slot = {(g.question_id, g.replayed): g for g in res.groups}
        groups = [by_slot[(q.question_id, q.replayed)] for q in batch.questions]
        planned = batch.plan.policy_version
        return Generated(
            samples=[[self._completion(r) for r in g.rollouts] for g in groups],
            versions=[planned if g.policy_version is None else g.policy_version for g in groups],
            entropies=[[r.entropy for r in g.rollouts] for g in groups],
        )

    def _completion(self, r: s.RolloutResult) -> Completion:
        ids = list(r.token_ids if r.token_ids is not None else s.unpack_ids(r.token_ids_b64 or ""))
        lps = list(r.logprobs if r.logprobs is not None else s.unpack_logprobs(r.logprobs_b64 or ""))
        return Completion(
            token_ids=ids,
            logprobs=lps,
            finish_reason="length" if r.finish_reason == "length" else "stop",
            text=str(self.tokenizer.decode(ids, skip_special_tokens=False)),
        )


class Grader:
    """Rewards of (response, gold) items with the configured grader, on rank 0 (in a process pool
    with hard per-item timeouts when `rollout.grading_workers` > 0), shared with every rank."""

    def __init__(self, cfg: RolloutSection) -> None:
        self.cfg = cfg
        self.pool = GradingPool(cfg.grading_workers) if dist.is_main() and cfg.grading_workers > 0 else None

    def grade(self, items: list[tuple[str, str]]) -> list[float]:
        rewards: list[float] = dist.broadcast(self._grade(items) if dist.is_main() else None)
        return rewards

    def _grade(self, items: list[tuple[str, str]]) -> list[float]:
        grades = grade_items(self.cfg.grader, items, self.cfg.grading_timeout_s, self.pool)
        return [float(g.reward) for g in grades]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
