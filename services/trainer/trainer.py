"""The ExGRPO trainer, assembled from components with narrow interfaces:

    PoolSession     attach / plan / commit / publish on the pool service       (pool_session.py)
    RolloutSource   the step's samples: colocated engine or remote workers      (rollouts.py)
    Grader          rewards of responses                                        (rollouts.py)
    Learner         model, optimizer, loss: scoring and the update              (learner.py)
    MetricsLogger   JSONL / TensorBoard / W&B / Prometheus / progress           (telemetry.py)

One step = plan -> rescore replay candidates -> generate -> grade -> update -> commit -> publish ->
checkpoint. Rank 0 talks to the pool service; every rank computes. Each component is built from its
own config section.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from exgrpo_client import Client
from exgrpo_client import schemas as s
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.prompts import render_prompt
from exgrpo_trainer import dist
from exgrpo_trainer.batch import choose_replays, commit_groups, graded_rows, grading_items, prepare_batch
from exgrpo_trainer.checkpoint import Checkpointer, RunIdentity
from exgrpo_trainer.config import TrainConfig
from exgrpo_trainer.learner import Learner, derived_seed
from exgrpo_trainer.model import load_tokenizer, unsharded
from exgrpo_trainer.pool_session import PoolSession
from exgrpo_trainer.publisher import WeightPublisher, make_publisher
from exgrpo_trainer.rollouts import ColocatedRollouts, Grader, RemoteRollouts, RolloutSource
from exgrpo_trainer.step_metrics import StepTimer, batch_metrics
from exgrpo_trainer.telemetry import MetricsLogger

log = logging.getLogger("exgrpo.trainer")
StepHook = Callable[["Trainer", dict[str, float]], bool | None]


class Trainer:
    def __init__(self, cfg: TrainConfig, *, client: Client | None = None) -> None:
        """Builds every component; `client` (rank 0) is used for the pool and stays open for its
        owner."""
        self.cfg = cfg
        self.device = dist.init()
        self.out = cfg.run.output_dir
        if dist.is_main():
            self.out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        torch.manual_seed(derived_seed(cfg.run.seed, "init"))
        self.timer = StepTimer()
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.learner = Learner(
            cfg.model,
            cfg.optim,
            cfg.loss,
            device=self.device,
            pad_id=int(self.tokenizer.pad_token_id),
            seed=cfg.run.seed,
            timer=self.timer,
        )
        rules = s.RunOverrides(**cfg.run_overrides())
        self.session = PoolSession(cfg.run, rules, client=client, send_metrics=cfg.logging.send_to_service)
        self.rollouts: RolloutSource = (
            RemoteRollouts(self.session, self.tokenizer, cfg.rollout)
            if cfg.rollout.engine == "remote"
            else ColocatedRollouts(self.learner.model, self.tokenizer, cfg.rollout, cfg.run.seed)
        )
        self.grader = Grader(cfg.rollout)
        self.run_key = Path(cfg.run.pool, cfg.run.name)
        """Checkpoints and published weights are kept per pool and run under the output folder,
        which several runs may share (compose and k8s fix it at /data/run)."""
        self.checkpointer = Checkpointer(
            self.out / "checkpoints" / self.run_key, cfg.schedule.keep_checkpoints
        )
        r = cfg.rollout
        self.publisher: WeightPublisher = make_publisher(
            r.publish, self.out / "published", addr=r.publish_addr, port=r.publish_port
        )
        self.step = 0
        self.policy_version = 0
        self.logger: MetricsLogger | None = None

    # ------------------------------------------------------------------------------- the loop
    def train(self, on_step: StepHook | None = None) -> None:
        """Run until `run.steps`. `on_step(trainer, metrics)` runs on every rank after each step
        (before the checkpoint), e.g. for a held-out evaluation; when it returns True on rank 0,
        that step is the last (e.g. a rollout budget is spent)."""
        self.attach()
        if dist.is_main():
            (self.out / "config.yaml").write_text(self.cfg.to_yaml())
            self.logger = MetricsLogger(
                self.out, self.cfg.logging, self.cfg.run.steps, self.cfg.public_dict()
            )
            self.logger.advance_to(self.step)
        try:
            last = self.step >= self.cfg.run.steps
            while not last:
                metrics = self.train_step()
                if self.logger is not None:
                    self.logger.log(self.step, metrics)
                stop = bool(on_step(self, metrics)) if on_step is not None else False
                last = bool(dist.broadcast(stop)) or self.step >= self.cfg.run.steps
                if last and self.cfg.schedule.publish_every and self.policy_version != self.step:
                    self.publish()  # the final weights, when the last step was not a publishing one
                if self._due(self.cfg.schedule.checkpoint_every) or last:
                    self.save_checkpoint()
        finally:
            self.session.flush()
            if self.logger is not None:
                self.logger.close()

    def attach(self) -> None:
        """Attach to the run on the pool (created if missing) and resume from the latest checkpoint."""
        state = self.session.attach()
        self.step, self.policy_version = state.step, state.policy_version
        run = self.cfg.run
        self.checkpointer.claim(RunIdentity(run.pool, run.name, state.created_at.isoformat()))
        self._resume()

    def train_step(self) -> dict[str, float]:
        """One training step on every rank; returns its metrics (rank 0's include the pool's)."""
        self.timer.reset()
        start = time.perf_counter()
        with self.timer.part("plan"):
            plan = self.session.plan(create_tasks=self.rollouts.remote)
        prompts = {q.question_id: self.prompt_ids(q.prompt) for q in [*plan.fresh, *plan.replay]}
        with self.timer.part("rescore"):
            seed = derived_seed(self.cfg.run.seed, plan.step, "choice")
            chosen = choose_replays(plan, prompts, self.learner.score, self.cfg.experience, seed)
        batch = prepare_batch(plan, prompts, chosen)
        with self.timer.part("generate"):
            samples = self.rollouts.generate(batch)
            rewards = self.grader.grade(grading_items(batch, samples, self._decode))
            rows, finish = graded_rows(batch, samples, rewards, self.cfg.max_response_len)
        learned = self.learner.learn(rows, mixed=batch.mixed, step=self.step + 1)
        metrics = batch_metrics(rows, finish, batch.replayed_slots, learned.old_entropy, batch.mixed)
        metrics.update(learned.metrics)
        groups = commit_groups(batch, rows, finish, learned.old_logprobs, learned.old_entropy, self._decode)
        with self.timer.part("commit"):
            result = self.session.commit(plan, groups, self.policy_version, metrics)
        self.step = result.step
        with self.timer.part("publish"):
            if self._due(self.cfg.schedule.publish_every):
                self.publish()
        with self.timer.part("stats"):
            pool_stats = self.session.experience_metrics(plan, result)
        metrics.update(self.timer.metrics())
        metrics["timing/step"] = time.perf_counter() - start
        metrics["phase/switched"] = float(result.switched)
        metrics.update(pool_stats)
        late = {k: v for k, v in metrics.items() if k.startswith(("timing/", "phase/"))}
        self.session.hold_late_metrics(self.step, {**pool_stats, **late})
        return metrics

    def close(self) -> None:
        self.session.close()
        self.publisher.close()
        self.grader.close()

    # ------------------------------------------------------------------------------ helpers
    def prompt_ids(self, messages: list[s.ChatMessage]) -> list[int]:
        """The same rendering as the rollout workers and evaluation."""
        m = self.cfg.model
        return render_prompt(
            self.tokenizer, messages, drop_system=m.drop_system_prompt, max_len=m.max_prompt_len
        )

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _due(self, every: int) -> bool:
        return bool(every) and self.step % every == 0

    @contextmanager
    def generation_engine(self) -> Iterator[TransformersEngine]:
        """A rollout engine over the full current weights (gathered for the block); every rank
        enters it together. Used by step hooks, e.g. for held-out evaluation."""
        engine = (
            self.rollouts.engine
            if isinstance(self.rollouts, ColocatedRollouts)
            else ColocatedRollouts(
                self.learner.model, self.tokenizer, self.cfg.rollout, self.cfg.run.seed
            ).engine
        )
        with unsharded(self.learner.model):
            yield engine

    # ------------------------------------------------------------------- publish / checkpoint
    def publish(self) -> str:
        """Publish the current weights (`rollout.publish`: folder, http or shared memory) and register
        the policy version; its uri (rank 0)."""
        version = self.step
        run = self.cfg.run
        uri = self.publisher.publish(self.learner.model, self.tokenizer, run.pool, run.name, version)
        self.session.publish(version, uri, self.step)
        self.policy_version = version
        return uri

    def save_checkpoint(self) -> Path:
        extra = {"policy_version": self.policy_version}
        return self.checkpointer.save(self.learner.model, self.learner.optimizer, self.step, extra)

    def _resume(self) -> None:
        path = self.checkpointer.latest()
        if path is None:
            if self.step > 0 and dist.is_main():
                flat = self.out / "checkpoints" / "latest"
                log.warning(
                    "run %s is at step %d on the service but there is no checkpoint in %s: "
                    "continuing from the initial weights%s",
                    self.cfg.run.name,
                    self.step,
                    self.checkpointer.root,
                    f" (checkpoints in the older layout, {flat.parent}/step-*, are not resumed: "
                    "move them into that folder if they are this run's)"
                    if flat.exists()
                    else "",
                )
            return
        extra = self.checkpointer.load(self.learner.model, self.learner.optimizer, path)
        ckpt_step = int(extra["step"])
        self.policy_version = int(extra.get("policy_version", 0))
        if ckpt_step != self.step and dist.is_main():
            log.warning(
                "checkpoint %s is at step %d but the service run is at step %d: the pool keeps its "
                "state, training continues from step %d with the checkpoint's weights",
                path.name,
                ckpt_step,
                self.step,
                self.step,
            )
        log.info("resumed from %s (step %d)", path, ckpt_step)


def run_training(
    cfg: TrainConfig, *, client: Client | None = None, on_step: StepHook | None = None
) -> Trainer:
    """Build a trainer, train until `run.steps` (or until `on_step` ends the run), close it."""
    trainer = Trainer(cfg, client=client)
    try:
        trainer.train(on_step)
    finally:
        trainer.close()
    return trainer
