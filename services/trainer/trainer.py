"""The ExGRPO trainer, assembled from components with narrow interfaces:

    PoolSession     attach / plan / commit / publish on the pool service       (pool_session.py)
    RolloutSource   the step's samples: colocated engine or remote workers      (rollouts.py)
    Grader          rewards of responses                                        (rollouts.py)
    Learner         model, optimizer, loss: scoring and the update              (learner.py)
    MetricsLogger   JSONL / TensorBoard / W&B / Prometheus / progress           (telemetry.py)

One step = plan -> rescore replay candidates -> generate -> grade -> update -> commit -> publish ->
checkpoint. Rank 0 talks to the pool service; every rank computes. Each component is built from its
own config section.

With remote workers (`rollout.engine=remote`) every plan names the policy version and the sampling
settings its tasks are generated with, and the trainer publishes every step. Synchronous mode
(`rollout.max_policy_lag=0`, the default) plans each batch with exactly the trainer's current
version. Asynchronous mode (`rollout.max_policy_lag=N`) commits a step before its update and plans
the next batch right away, so the workers generate it while the trainer updates:

    results(t) -> rescore -> grade -> commit(t) -> plan(t+1) -> update(t) -> publish(t) -> ...

and the update corrects for the sampler's policy (at most N versions older) with its log-probs.
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
from exgrpo_trainer.algo import Row
from exgrpo_trainer.batch import (
    Finish,
    StepBatch,
    choose_replays,
    commit_groups,
    graded_rows,
    grading_items,
    mean_entropies,
    prepare_batch,
)
from exgrpo_trainer.checkpoint import Checkpointer, RunIdentity
from exgrpo_trainer.config import TrainConfig
from exgrpo_trainer.learner import Learner, LearnResult, derived_seed
from exgrpo_trainer.model import load_tokenizer, unsharded
from exgrpo_trainer.pool_session import PoolSession
from exgrpo_trainer.publisher import WeightPublisher, make_publisher
from exgrpo_trainer.rollouts import (
    ColocatedRollouts,
    Generated,
    Grader,
    RemoteRollouts,
    RolloutSource,
    sampling_params,
)
from exgrpo_trainer.step_metrics import StepTimer, batch_metrics, logprob_gap, policy_lag
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
        self.lost_updates: int | None = None
        """Set by `attach` when the run had committed steps: how many of their updates the
        checkpoint resumed from does not hold (recorded once, as `run/lost_updates`)."""
        self._next_plan: s.BatchPlan | None = None
        """Asynchronous mode: the next step's batch, planned before this step's update."""

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
                if last and self._publishes and self.policy_version != self.step:
                    self.publish()  # the final weights, when the last step was not a publishing one
                if self._due(self.cfg.schedule.checkpoint_every) or last:
                    self.save_checkpoint()
        finally:
            self.session.flush()
            if self.logger is not None:
                self.logger.close()

    def attach(self) -> None:
        """Attach to the run on the pool (created if missing) and resume from the latest checkpoint;
        the pool's step and policy version win over the checkpoint's. With remote workers, the
        current weights are published as version `step` (v0: the initial weights), so every plan
        names a published version that holds the trainer's weights."""
        state = self.session.attach()
        self.step, self.policy_version = state.step, state.policy_version
        run = self.cfg.run
        self.checkpointer.claim(RunIdentity(run.pool, run.name, state.created_at.isoformat()))
        self._resume()
        self._next_plan = None
        if self.rollouts.remote:
            # published again when it was already (a restart): its uri may be served by this process
            # only, and after lost updates the weights of that version are this trainer's
            self.publish()

    def train_step(self) -> dict[str, float]:
        """One training step on every rank; returns its metrics (rank 0's include the pool's)."""
        if self.cfg.asynchronous:
            return self._asynchronous_step()
        self.timer.reset()
        start = time.perf_counter()
        held = self.step  # the version of the weights this step updates
        with self.timer.part("plan"):
            plan = self._plan()
        batch = self._prepare(plan)
        with self.timer.part("generate"):
            generated, rows, finish = self._generate(batch)
        learned = self.learner.learn(rows, mixed=batch.mixed, step=plan.step)
        metrics = batch_metrics(rows, finish, batch.replayed_slots, learned.old_entropy, batch.mixed)
        metrics.update(learned.metrics)
        metrics.update(self._rollout_metrics(held, generated, rows, learned))
        groups = commit_groups(
            batch, rows, finish, learned.old_logprobs, mean_entropies(learned.old_entropy), self._decode
        )
        with self.timer.part("commit"):
            version = min(generated.versions) if generated.versions else self.policy_version
            result = self.session.commit(plan, groups, version, metrics)
        self.step = result.step
        return self._finish_step(plan, result, metrics, start, sent=set(metrics))

    def _asynchronous_step(self) -> dict[str, float]:
        """One step with generation overlapping the update: the batch (planned during the last
        step) is committed before the update, with the sampler's log-probs stored as pi_past and
        its entropies; then the next batch is planned, so the workers generate it while this one
        trains with the decoupled loss (pi_prox = the weights before the update, the sampler's
        log-probs the behaviour policy)."""
        self.timer.reset()
        start = time.perf_counter()
        held = self.step
        with self.timer.part("plan"):
            plan = self._next_plan if self._next_plan is not None else self._plan()
            self._next_plan = None
        batch = self._prepare(plan)
        with self.timer.part("generate"):
            generated, rows, finish = self._generate(batch)
        metrics = batch_metrics(rows, finish, batch.replayed_slots, None, batch.mixed)
        metrics["rollout/policy_lag_max"] = policy_lag(held, generated.versions or [held])
        sampler_lps = [r.behaviour_logprobs or [] for r in rows]
        groups = commit_groups(batch, rows, finish, sampler_lps, self._sampler_entropies(batch, generated))
        with self.timer.part("commit"):
            version = min(generated.versions) if generated.versions else self.policy_version
            result = self.session.commit(plan, groups, version, metrics)
        sent = set(metrics)
        self.step = result.step
        if self.step < self.cfg.run.steps:
            with self.timer.part("plan"):
                self._next_plan = self._plan()
        learned = self.learner.learn(rows, mixed=batch.mixed, step=plan.step, decoupled=True)
        metrics.update(batch_metrics(rows, finish, batch.replayed_slots, learned.old_entropy, batch.mixed))
        metrics.update(learned.metrics)
        metrics.update(self._rollout_metrics(held, generated, rows, learned))
        return self._finish_step(plan, result, metrics, start, sent)

    def _plan(self) -> s.BatchPlan:
        """The next batch; with remote workers, its tasks name the version to generate with (this
        trainer's; asynchronous: any published one from `max_policy_lag` versions before the weights
        that will learn from them) and the trainer's sampling settings."""
        if not self.rollouts.remote:
            return self.session.plan(create_tasks=False)
        lag = self.cfg.rollout.max_policy_lag
        return self.session.plan(
            create_tasks=True,
            policy_version=self.policy_version,
            min_policy_version=max(0, self.step - lag) if lag else None,
            sampling=sampling_params(self.cfg.rollout),
        )

    def _prepare(self, plan: s.BatchPlan) -> StepBatch:
        """The plan's slots, each replayed question with its trajectory chosen under the current
        weights."""
        prompts = {q.question_id: self.prompt_ids(q.prompt) for q in [*plan.fresh, *plan.replay]}
        with self.timer.part("rescore"):
            seed = derived_seed(self.cfg.run.seed, plan.step, "choice")
            chosen = choose_replays(plan, prompts, self.learner.score, self.cfg.experience, seed)
        return prepare_batch(plan, prompts, chosen)

    def _generate(self, batch: StepBatch) -> tuple[Generated, list[Row], list[Finish | None]]:
        generated = self.rollouts.generate(batch)
        rewards = self.grader.grade(grading_items(batch, generated.samples, self._decode))
        rows, finish = graded_rows(batch, generated.samples, rewards, self.cfg.max_response_len)
        return generated, rows, finish

    def _rollout_metrics(
        self, held: int, generated: Generated, rows: list[Row], learned: LearnResult
    ) -> dict[str, float]:
        """Remote workers: `rollout/policy_lag_max` and, with the sampler's log-probs,
        `rollout/logprob_gap` on the first mini-batch (neither for the colocated engine: it samples
        with the weights it updates, lag 0 by construction, and records no log-probs); once after a
        resume, `run/lost_updates`."""
        out: dict[str, float] = {}
        if generated.versions is not None:
            out["rollout/policy_lag_max"] = policy_lag(held, generated.versions)
            gap = logprob_gap(rows, learned.old_logprobs, learned.first_minibatch)
            if gap is not None:
                out["rollout/logprob_gap"] = gap
        if self.lost_updates is not None:
            out["run/lost_updates"] = float(self.lost_updates)
            self.lost_updates = None
        return out

    @staticmethod
    def _sampler_entropies(batch: StepBatch, generated: Generated) -> list[float | None]:
        """The sampler's mean entropy of every row, in row order (None for a replayed row)."""
        per_slot = generated.entropies or [[None] * len(cs) for cs in generated.samples]
        return [
            e
            for q, ents in zip(batch.questions, per_slot, strict=True)
            for e in ([None] if q.replayed else []) + list(ents)
        ]

    def _finish_step(
        self,
        plan: s.BatchPlan,
        result: s.CommitResult,
        metrics: dict[str, float],
        start: float,
        sent: set[str],
    ) -> dict[str, float]:
        """Publish, the pool's stats, timings; the metrics the commit did not carry are posted to the
        run after the next plan."""
        with self.timer.part("publish"):
            if self.rollouts.remote or self._due(self.cfg.schedule.publish_every):
                self.publish()
        with self.timer.part("stats"):
            pool_stats = self.session.experience_metrics(plan, result)
        metrics.update(self.timer.metrics())
        metrics["timing/step"] = time.perf_counter() - start
        metrics["phase/switched"] = float(result.switched)
        metrics.update(pool_stats)
        late = {k: v for k, v in metrics.items() if k not in sent or k.startswith(("timing/", "phase/"))}
        self.session.hold_late_metrics(self.step, late)
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

    @property
    def _publishes(self) -> bool:
        """Whether weights are published (every step with remote workers)."""
        return self.rollouts.remote or bool(self.cfg.schedule.publish_every)

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
        registered = self.session.publish(version, uri, self.step)
        if registered != uri and dist.is_main():
            log.warning(
                "policy version %d of run %s was published before at %s (by an earlier trainer of "
                "the run); workers load it from there, not from %s%s",
                version,
                run.name,
                registered,
                uri,
                " (fix rollout.publish_port so that a restarted trainer serves the same uris)"
                if self.cfg.rollout.publish == "http"
                else "",
            )
        self.policy_version = version
        return uri

    def save_checkpoint(self) -> Path:
        extra = {"policy_version": self.policy_version}
        return self.checkpointer.save(self.learner.model, self.learner.optimizer, self.step, extra)

    def _resume(self) -> None:
        """Load the newest checkpoint of the run. The pool's step and policy version win: the updates
        of steps the pool committed after the checkpoint are lost, which one log line names (and
        `run/lost_updates` records on the next step)."""
        path = self.checkpointer.latest()
        ckpt_step = 0
        if path is not None:
            extra = self.checkpointer.load(self.learner.model, self.learner.optimizer, path)
            ckpt_step = int(extra["step"])
            log.info("resumed from %s (step %d)", path, ckpt_step)
        if self.step == 0 and ckpt_step == 0:
            return  # a new run
        self.lost_updates = max(0, self.step - ckpt_step)
        if not dist.is_main():
            return
        run = self.cfg.run.name
        if self.lost_updates:
            lost = str(self.step) if self.lost_updates == 1 else f"{ckpt_step + 1}-{self.step}"
            flat = self.out / "checkpoints" / "latest"
            log.warning(
                "run %s: the pool has committed step %d but %s; the updates of step%s %s are lost. "
                "The pool's step and policy version win: training continues from step %d with %s%s",
                run,
                self.step,
                f"the checkpoint {path} holds the weights after step {ckpt_step}"
                if path is not None
                else f"there is no checkpoint in {self.checkpointer.root}",
                "" if self.lost_updates == 1 else "s",
                lost,
                self.step,
                "the checkpoint's weights" if path is not None else "the initial weights",
                f" (checkpoints in the older layout, {flat.parent}/step-*, are not resumed: move them "
                "into that folder if they are this run's)"
                if path is None and flat.exists()
                else "",
            )
        elif ckpt_step > self.step:
            log.warning(
                "run %s: the checkpoint %s is at step %d but the pool has committed only %d steps: the "
                "pool's step wins, training continues from step %d with the checkpoint's weights",
                run,
                path,
                ckpt_step,
                self.step,
                self.step,
            )


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
