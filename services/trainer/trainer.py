"""The ExGRPO learner: one step = plan -> rescore -> generate -> grade -> old log-probs -> update ->
commit -> publish -> checkpoint. Rank 0 talks to the pool service; every rank computes.

Distributed rules: every forward of the FSDP2 model is a collective, so each rank runs the same
number of forwards (work is split into equal chunks, padded with throw-away rows), and losses are
multiplied by the world size so FSDP's gradient average becomes the sum the constant-normaliser
objective asks for. One process is a group of one and runs the same code.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from exgrpo_client import Client, rollout
from exgrpo_client import schemas as s
from exgrpo_client.errors import NotFound
from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.prompts import render_prompt
from exgrpo_trainer import dist
from exgrpo_trainer.algo import (
    Completion,
    ExGRPOLoss,
    PlannedQuestion,
    Row,
    build_rows,
    choose_trajectory,
    row_advantages,
)
from exgrpo_trainer.checkpoint import Checkpointer
from exgrpo_trainer.config import TrainConfig
from exgrpo_trainer.model import (
    generation_view,
    load_model,
    load_tokenizer,
    pad_rows,
    response_forward,
    save_hf,
    unsharded,
)
from exgrpo_trainer.telemetry import MetricsLogger, RunMetricsSender

log = logging.getLogger("exgrpo.trainer")
StepHook = Callable[["Trainer", dict[str, float]], bool | None]
T = TypeVar("T")


def _seed(*keys: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:4], "little")


def _split(items: Sequence[T], parts: int, index: int) -> tuple[list[T], int]:
    """Contiguous chunk `index` of `parts` equal chunks (the last ones padded by the caller)."""
    per = math.ceil(len(items) / parts) if items else 0
    return list(items[index * per : (index + 1) * per]), per


@dataclass
class StepData:
    plan: s.BatchPlan
    questions: list[PlannedQuestion]
    slots: list[tuple[int, bool]]  # (question id, replayed) per slot
    rows: list[Row]
    finish: list[str | None]


class Trainer:
    _sender: RunMetricsSender | None = None
    """Rank 0's background poster of each step's late run metrics; started by the first step."""
    _held: tuple[int, dict[str, float]] | None = None
    """The last step's late metrics, handed to the sender once the next plan is in: posted at the
    end of their step, they would queue at the service ahead of that plan."""

    def __init__(self, cfg: TrainConfig, *, client: Client | None = None) -> None:
        self.cfg = cfg
        self.device = dist.init()
        self.out = cfg.run.output_dir
        if dist.is_main():
            self.out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        torch.manual_seed(_seed(cfg.run.seed, "init"))
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.model = load_model(
            cfg.model.path,
            self.device,
            dtype=cfg.model.dtype,
            activation_checkpointing=cfg.model.activation_checkpointing,
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
            fused=True,  # one kernel per step instead of a loop over tensors (5x faster on CPU too)
        )
        self.loss = ExGRPOLoss(cfg.loss)
        self.ref_model: torch.nn.Module | None = None
        if cfg.loss.kl_coeff > 0:
            # frozen, sharded like the policy; not checkpointed (it is reloaded from its folder)
            self.ref_model = load_model(
                cfg.model.reference_path or cfg.model.path,
                self.device,
                dtype=cfg.model.dtype,
                activation_checkpointing=False,
            ).requires_grad_(False)
        self.engine = TransformersEngine(
            generation_view(self.model),  # computes with the weights that `unsharded` gathers
            self.tokenizer,
            max_batch_rows=cfg.rollout.max_batch_rows,
            synced_gpus=dist.world() > 1,
            record=False,  # the update recomputes log-probs and entropies of every generated row
        )
        self.pad_id = int(self.tokenizer.pad_token_id)
        self._owns_client = client is None  # a client passed in stays open for its owner
        self.client = (
            client
            if client is not None
            else (Client(cfg.run.pool_url, token=cfg.run.token) if dist.is_main() else None)
        )
        self.grading: Any = None
        if dist.is_main() and cfg.rollout.grading_workers > 0:
            from exgrpo_rollout.graders.pool import GradingPool

            self.grading = GradingPool(cfg.rollout.grading_workers)
        self.checkpointer = Checkpointer(self.out / "checkpoints", cfg.schedule.keep_checkpoints)
        self.step = 0
        self.k = 0
        self.policy_version = 0
        self.logger: MetricsLogger | None = None
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------------------- the loop
    def train(self, on_step: StepHook | None = None) -> None:
        """Run until `run.steps`. `on_step(trainer, metrics)` runs on every rank after each step
        (before the checkpoint), e.g. for a held-out evaluation; when it returns True on rank 0,
        that step is the last (e.g. a rollout budget is spent)."""
        self._attach_run()
        self._resume()
        if dist.is_main():
            (self.out / "config.yaml").write_text(self.cfg.to_yaml())
            self.logger = MetricsLogger(
                self.out, self.cfg.logging, self.cfg.run.steps, self.cfg.public_dict()
            )
            self.logger.advance_to(self.step)
        try:
            last = False
            while not last and self.step < self.cfg.run.steps:
                metrics = self.train_step()
                if self.logger is not None:
                    self.logger.log(self.step, metrics)
                stop = False
                if on_step is not None:
                    stop = bool(on_step(self, metrics))
                    stop = bool(dist.broadcast(stop if dist.is_main() else None))
                last = stop or self.step >= self.cfg.run.steps
                if last and self.cfg.schedule.publish_every and self.policy_version != self.step:
                    self.publish()  # the final weights, when the last step was not a publishing one
                every = self.cfg.schedule.checkpoint_every
                if (every and self.step % every == 0) or last:
                    self.save_checkpoint()
        finally:
            self._close_sender()
            if self.logger is not None:
                self.logger.close()

    @contextmanager
    def generation_engine(self) -> Iterator[TransformersEngine]:
        """The rollout engine over the full current weights (gathered for the block); every rank
        enters it together."""
        with unsharded(self.model):
            yield self.engine

    def close(self) -> None:
        self._close_sender()  # before the client it posts with
        if self.grading is not None:
            self.grading.close()
        if self.client is not None and self._owns_client:
            self.client.close()

    def train_step(self) -> dict[str, float]:
        self.timings = {}
        start = time.perf_counter()
        with self._timed("plan"):
            plan = dist.broadcast(self._plan() if dist.is_main() else None)
        self._release_late_metrics()  # the previous step's, posted while this one computes
        mixed = plan.phase == "mixed"
        prompts = {item.question_id: self._prompt_ids(item.prompt) for item in [*plan.fresh, *plan.replay]}
        with self._timed("rescore"):
            chosen = self._choose_replays(plan, prompts)
        with self._timed("generate"):
            data = self._rollouts(plan, prompts, chosen)
        old_lp, old_ent, update_metrics = self.learn(data.rows, mixed)
        metrics = self._step_metrics(data, old_ent, update_metrics, mixed)
        with self._timed("commit"):
            result = dist.broadcast(self._commit(data, old_lp, old_ent, metrics) if dist.is_main() else None)
        self.step = result.step
        with self._timed("publish"):
            every = self.cfg.schedule.publish_every
            if every and self.step % every == 0:
                self.publish()
        pool_stats: dict[str, float] = {}
        if dist.is_main():
            with self._timed("stats"):
                pool_stats = self._experience_stats(plan, result.stats)
        metrics.update({f"timing/{k}": v for k, v in self.timings.items()})
        metrics["timing/step"] = time.perf_counter() - start
        metrics["phase/switched"] = float(result.switched)
        if dist.is_main():
            metrics.update(pool_stats)
            if self.cfg.logging.send_to_service:
                assert self.client is not None
                timing = {k: v for k, v in metrics.items() if k.startswith(("timing/", "phase/"))}
                self._held = (self.step, {**pool_stats, **timing})
        return metrics

    # ------------------------------------------------------------------------------ service
    def _attach_run(self) -> None:
        info = None
        if dist.is_main():
            assert self.client is not None
            cfg = self.cfg
            overrides = s.RunOverrides(**cfg.run_overrides())
            try:
                run = self.client.get_run(cfg.run.pool, cfg.run.name)
            except NotFound:
                run = self.client.create_run(
                    cfg.run.pool, cfg.run.name, seed=cfg.run.seed, overrides=overrides
                )
                log.info("created run %s in pool %s", cfg.run.name, cfg.run.pool)
            else:
                if run.overrides != overrides or run.seed != cfg.run.seed:
                    log.warning(
                        "run %s already exists with seed %d and %s; the service keeps those, "
                        "not this config's run.seed / experience settings (%s)",
                        cfg.run.name,
                        run.seed,
                        run.overrides,
                        overrides,
                    )
            pool = self.client.get_pool(cfg.run.pool)
            info = (run.step, run.policy_version, pool.config.k)
        self.step, self.policy_version, self.k = dist.broadcast(info)

    def _plan(self) -> s.BatchPlan:
        assert self.client is not None
        return self.client.plan_batch(
            self.cfg.run.pool,
            self.cfg.run.name,
            candidates="all",
            create_tasks=self.cfg.rollout.engine == "remote",
        )

    def _commit(
        self, data: StepData, old_lp: list[list[float]], old_ent: list[list[float]], metrics: dict[str, float]
    ) -> s.CommitResult:
        assert self.client is not None
        groups: list[s.GroupResult] = []
        by_group: dict[int, list[int]] = defaultdict(list)
        for i, row in enumerate(data.rows):
            by_group[row.group].append(i)
        for g, (qid, _replayed) in enumerate(data.slots):
            rollouts = []
            for i in by_group[g]:
                row = data.rows[i]
                mean_ent = float(np.mean(old_ent[i])) if old_ent[i] else None
                if row.replayed:
                    rollouts.append(rollout(row.reward, None, None, entropy=mean_ent, replayed=True))
                elif row.reward == 1.0 and row.response_ids:
                    rollouts.append(
                        rollout(
                            row.reward,
                            row.response_ids,
                            np.minimum(old_lp[i], 0.0),
                            entropy=mean_ent,
                            finish_reason=data.finish[i],
                        )
                    )
                else:
                    rollouts.append(
                        rollout(row.reward, None, None, entropy=mean_ent, finish_reason=data.finish[i])
                    )
            groups.append(s.GroupResult(question_id=qid, rollouts=rollouts))
        sent = metrics if self.cfg.logging.send_to_service else {}
        return self.client.commit_batch(
            self.cfg.run.pool,
            data.plan.id,
            groups,
            policy_version=self.policy_version,
            metrics={k: v for k, v in sent.items() if math.isfinite(v)},
            with_stats=True,  # the run's stats after the commit ride on its answer
        )

    def _experience_stats(self, plan: s.BatchPlan, st: s.RunStats | None) -> dict[str, float]:
        """The step's `experience/*` metrics from the run's stats after its commit (`st`, from the
        commit's answer; asked for separately if that answer has none)."""
        if st is None:
            assert self.client is not None
            st = self.client.run_stats(self.cfg.run.pool, self.cfg.run.name)
        out = {
            "experience/eligible": float(st.eligible),
            "experience/retired": float(st.retired),
            "experience/seen": float(st.seen),
            "experience/trajectories": float(st.trajectories),
            "experience/replay_share": len(plan.replay) / max(1, len(plan.replay) + len(plan.fresh)),
        }
        for b in st.buckets:
            out[f"experience/bucket_{b.bucket}"] = float(b.questions)
        return out

    def _release_late_metrics(self) -> None:
        if self._held is not None:
            if self._sender is None:
                assert self.client is not None
                self._sender = RunMetricsSender(self.client, self.cfg.run.pool, self.cfg.run.name)
            self._sender.send(*self._held)  # posted in the background, in step order
            self._held = None

    def _close_sender(self) -> None:
        """Post what is held and queued, and stop the thread (a later step starts a new one)."""
        self._release_late_metrics()
        if self._sender is not None:
            sender, self._sender = self._sender, None
            sender.close()

    # ------------------------------------------------------------------------------ prompts
    def _prompt_ids(self, messages: list[s.ChatMessage]) -> list[int]:
        """The same rendering as the rollout workers and evaluation."""
        model = self.cfg.model
        return render_prompt(
            self.tokenizer, messages, drop_system=model.drop_system_prompt, max_len=model.max_prompt_len
        )

    # ---------------------------------------------------------------------- replay choice
    def _choose_replays(
        self, plan: s.BatchPlan, prompts: dict[int, list[int]]
    ) -> dict[int, s.TrajectoryPublic]:
        """Lowest mean token entropy under the current policy (spec 4.2), per replayed question."""
        from exgrpo_client import decode_trajectory

        pairs: list[tuple[int, s.TrajectoryPublic]] = [
            (item.question_id, c) for item in plan.replay for c in item.candidates
        ]
        if not pairs:
            return {}
        metric = self.cfg.experience.metric
        scores: list[float]
        if metric == "random":
            rng = np.random.default_rng(_seed(self.cfg.run.seed, plan.step, "choice"))
            scores = rng.random(len(pairs)).tolist()
        else:
            ids = [decode_trajectory(c)[0].tolist() for _, c in pairs]
            lp, ent = self._score([prompts[q] for q, _ in pairs], ids, with_entropy=metric == "ent")
            scores = (
                [float(np.mean(e)) for e in ent]
                if metric == "ent"
                else [float(math.exp(-np.mean(x))) for x in lp]
            )
        chosen: dict[int, s.TrajectoryPublic] = {}
        start = 0
        for item in plan.replay:
            n = len(item.candidates)
            if n:
                best = choose_trajectory(scores[start : start + n], mode=self.cfg.experience.select_mode)
                chosen[item.question_id] = item.candidates[best]
            start += n
        return chosen

    # ----------------------------------------------------------------------------- rollouts
    def _rollouts(
        self, plan: s.BatchPlan, prompts: dict[int, list[int]], chosen: dict[int, s.TrajectoryPublic]
    ) -> StepData:
        from exgrpo_client import decode_trajectory

        k = plan.k
        replay_items = [r for r in plan.replay if r.question_id in chosen]
        questions: list[PlannedQuestion] = []
        slots: list[tuple[int, bool]] = []
        replay_texts: list[tuple[str, str]] = []
        for item in replay_items:
            ids, lps = decode_trajectory(chosen[item.question_id])
            questions.append(
                PlannedQuestion(
                    question_id=item.question_id,
                    prompt_ids=prompts[item.question_id],
                    replay=Completion(response_ids=ids.tolist(), reward=1.0, logprobs=lps.tolist()),
                )
            )
            slots.append((item.question_id, True))
            replay_texts.append(
                (self.tokenizer.decode(ids.tolist(), skip_special_tokens=False), item.ground_truth)
            )
        for item in plan.fresh:
            questions.append(
                PlannedQuestion(question_id=item.question_id, prompt_ids=prompts[item.question_id])
            )
            slots.append((item.question_id, False))
        gts = {i.question_id: i.ground_truth for i in [*plan.fresh, *plan.replay]}
        if self.cfg.rollout.engine == "remote":
            completions = self._remote_completions(plan, questions) if dist.is_main() else None
            gen = dist.broadcast(completions)
        else:
            gen = self._generate_colocated(plan, questions, k)
        # grade on rank 0 (process pool with hard timeouts), share the rewards
        rewards: list[list[float]] | None = None
        replay_rewards: list[float] | None = None
        if dist.is_main():
            items = [(c.text, gts[q.question_id]) for q, cs in zip(questions, gen, strict=True) for c in cs]
            flat = self._grade(items + replay_texts)
            rr = iter(flat[: len(items)])
            rewards = [[next(rr) for _ in cs] for cs in gen]
            replay_rewards = flat[len(items) :]
        rewards, replay_rewards = dist.broadcast((rewards, replay_rewards))
        assert rewards is not None and replay_rewards is not None
        # the colocated engine records no sampler log-probs (None then); no loss term reads them for
        # generated rows, which are scored against pi_old
        generated = [
            [
                Completion(response_ids=c.token_ids, reward=r, logprobs=c.logprobs or None)
                for c, r in zip(cs, rs, strict=True)
            ]
            for cs, rs in zip(gen, rewards, strict=True)
        ]
        for i, q in enumerate(questions[: len(replay_items)]):
            assert q.replay is not None
            questions[i] = PlannedQuestion(
                question_id=q.question_id,
                prompt_ids=q.prompt_ids,
                replay=Completion(
                    response_ids=q.replay.response_ids, reward=replay_rewards[i], logprobs=q.replay.logprobs
                ),
            )
        rows = build_rows(questions, generated, k=k, max_response_len=self.cfg.max_response_len)
        finish: list[str | None] = []
        for q, cs in zip(questions, gen, strict=True):
            finish.extend(([None] if q.replayed else []) + [c.finish_reason for c in cs])
        return StepData(plan=plan, questions=questions, slots=slots, rows=rows, finish=finish)

    def _grade(self, items: list[tuple[str, str]]) -> list[float]:
        name = self.cfg.rollout.grader
        if not items:
            return []
        if self.grading is not None:
            grades = self.grading.grade_many(name, items, timeout_s=self.cfg.rollout.grading_timeout_s)
        else:
            from exgrpo_rollout.graders.pool import grade_one

            grades = [grade_one(name, r, g, timeout_s=self.cfg.rollout.grading_timeout_s) for r, g in items]
        return [float(g.reward) for g in grades]

    def _generate_colocated(
        self, plan: s.BatchPlan, questions: list[PlannedQuestion], k: int
    ) -> list[list[Any]]:
        """All samples of the step in one `generate` call: each prompt repeated once per sample it
        needs (K for a fresh question, K-1 for a replayed one), one sample per row, so the decode
        loop runs once per step whatever the mix. The rows are split evenly over the ranks."""
        slots = [i for i, q in enumerate(questions) for _ in range(q.num_generations(k))]
        out: list[list[Any]] = [[] for _ in questions]
        mine, per = _split(slots, dist.world(), dist.rank())
        if per == 0:
            return out
        mine += [slots[0]] * (per - len(mine))  # equal work on every rank (throw-away pads)
        sampling = SamplingConfig(
            n=1,
            temperature=self.cfg.rollout.temperature,
            top_p=self.cfg.rollout.top_p,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            min_new_tokens=self.cfg.rollout.min_new_tokens,
            seed=_seed(self.cfg.run.seed, plan.step, "generate", dist.rank()),
        )
        with unsharded(self.model), torch.no_grad():
            res = self.engine.generate([questions[i].prompt_ids for i in mine], sampling)
        gathered = dist.gather([cs[0] for cs in res])
        flat = [c for part in gathered for c in part][: len(slots)]
        for i, c in zip(slots, flat, strict=True):
            out[i].append(c)
        return out

    def _remote_completions(self, plan: s.BatchPlan, questions: list[PlannedQuestion]) -> list[list[Any]]:
        from exgrpo_rollout.engines.base import Completion as EngineCompletion

        assert self.client is not None
        deadline = time.monotonic() + self.cfg.rollout.results_timeout_s
        while True:
            res = self.client.batch_results(self.cfg.run.pool, plan.id, wait=30.0)
            if res.complete:
                break
            # a task failed for good (attempts used up, or the batch was re-planned) never completes
            failed = self.client.batch_status(self.cfg.run.pool, plan.id).tasks_failed
            if failed:
                raise RuntimeError(
                    f"batch {plan.id}: {failed} generation tasks failed for good; the rollout "
                    "workers' logs name the errors"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"batch {plan.id}: workers did not finish within rollout.results_timeout_s"
                )
        # a replayed question's task asks for K-1 samples, a fresh one's for K (one question can be both)
        by_q = {(g.question_id, len(g.rollouts) == plan.k - 1): g for g in res.groups}
        out = []
        for q in questions:
            g = by_q[(q.question_id, q.replayed)]
            comps = []
            for r in g.rollouts:
                # workers complete tasks with packed arrays; lists are accepted too
                ids = r.token_ids if r.token_ids is not None else s.unpack_ids(r.token_ids_b64 or "")
                lps = r.logprobs if r.logprobs is not None else s.unpack_logprobs(r.logprobs_b64 or "")
                comps.append(
                    EngineCompletion(
                        token_ids=list(ids),
                        logprobs=list(lps),
                        finish_reason=r.finish_reason or "stop",
                        text=self.tokenizer.decode(list(ids), skip_special_tokens=False),
                    )
                )
            out.append(comps)
        return out

    # ------------------------------------------------------------------------------ scoring
    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices grouped so that rows x padded length stays under the token budget."""
        budget = self.cfg.optim.micro_batch_tokens
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            width = max([lengths[j] for j in cur] + [lengths[i]])
            if cur and width * (len(cur) + 1) > budget:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches

    def _score(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        *,
        with_entropy: bool,
        model: torch.nn.Module | None = None,
    ) -> tuple[list[list[float]], list[list[float]]]:
        """Response log-probs (and entropies) of every row under the current weights (or `model`'s),
        no grad."""
        model = self.model if model is None else model
        idx = list(range(len(prompts)))
        mine, per = _split(idx, dist.world(), dist.rank())
        if per == 0:
            return [], []
        mine += [idx[0]] * (per - len(mine))
        mbs = self._micro_batches([len(prompts[i]) + len(responses[i]) for i in mine])
        count = dist.all_max(len(mbs))
        mbs += [[0]] * (count - len(mbs))
        lp_out: dict[int, list[float]] = {}
        ent_out: dict[int, list[float]] = {}
        with torch.no_grad():
            for mb in mbs:
                rows = [mine[j] for j in mb]
                ids, att, rids, _rmask, pos = pad_rows(
                    [prompts[i] for i in rows], [responses[i] for i in rows], self.pad_id, self.device
                )
                lp, ent = response_forward(model, ids, att, rids, pos, with_entropy=with_entropy)
                for j, i in enumerate(rows):
                    n = len(responses[i])
                    lp_out[i] = lp[j, :n].float().cpu().tolist()
                    ent_out[i] = ent[j, :n].float().cpu().tolist() if ent is not None else []
        gathered = dist.gather((lp_out, ent_out))
        all_lp: dict[int, list[float]] = {}
        all_ent: dict[int, list[float]] = {}
        for a, b in gathered:
            all_lp.update(a)
            all_ent.update(b)
        return [all_lp[i] for i in idx], [all_ent[i] for i in idx]

    # ------------------------------------------------------------------------------- update
    def learn(
        self, rows: list[Row], mixed: bool
    ) -> tuple[list[list[float]], list[list[float]], dict[str, float]]:
        """Old log-probs (pi_old) and entropies of `rows`, advantages, and the policy update of
        this step. Every rank calls it with the same rows. Returns (old log-probs, old entropies,
        update metrics).

        pi_old is the policy before the step's first optimizer step, so the first mini-batch takes
        it from its own update forward, detached (the same weights give the same numbers, without a
        second forward pass); only the rows of later mini-batches are scored beforehand."""
        parts = self._mini_batches(len(rows))
        old_lp: list[list[float]] = [[] for _ in rows]
        old_ent: list[list[float]] = [[] for _ in rows]
        with self._timed("old_logprob"):
            later = sorted(i for part in parts[1:] for i in part)
            if later:
                lp, ent = self._score(
                    [rows[i].prompt_ids for i in later],
                    [rows[i].response_ids for i in later],
                    with_entropy=True,
                )
                for i, row_lp, row_ent in zip(later, lp, ent, strict=True):
                    old_lp[i], old_ent[i] = row_lp, row_ent
        ref_lp: list[list[float]] | None = None
        if self.ref_model is not None:
            with self._timed("ref_logprob"):
                ref_lp, _ = self._score(
                    [r.prompt_ids for r in rows],
                    [r.response_ids for r in rows],
                    with_entropy=False,
                    model=self.ref_model,
                )
        adv = row_advantages(rows, use_std=self.cfg.loss.advantage_std)
        with self._timed("update"):
            update_metrics, first = self._update(rows, parts, old_lp, adv, mixed, ref_lp)
        for i, (row_lp, row_ent) in first.items():
            old_lp[i], old_ent[i] = row_lp, row_ent
        return old_lp, old_ent, update_metrics

    def _mini_batches(self, num_rows: int) -> list[list[int]]:
        """Row indices of the step's mini-batches: a seeded shuffle, dealt round-robin."""
        m = self.cfg.optim.mini_batches
        rng = np.random.default_rng(_seed(self.cfg.run.seed, self.step + 1, "minibatch"))
        order = rng.permutation(num_rows).tolist()
        return [order[i::m] for i in range(m)]

    def _update(
        self,
        rows: list[Row],
        parts: list[list[int]],
        old_lp: list[list[float]],
        adv: list[float],
        mixed: bool,
        ref_lp: list[list[float]] | None = None,
    ) -> tuple[dict[str, float], dict[int, tuple[list[float], list[float]]]]:
        """The optimizer steps, one per mini-batch. Returns the update metrics, and the log-probs and
        entropies of the first mini-batch's rows (its pi_old, from its update forward)."""
        cfg = self.cfg
        collected: list[dict[str, float]] = []
        first: dict[int, tuple[list[float], list[float]]] = {}
        stats: dict[str, float] = {"optim/skipped": 0.0, "optim/grad_norm": 0.0}
        for index, part in enumerate(parts):
            if not part:
                continue
            n_tokens = float(sum(len(rows[i].response_ids) for i in part))
            mine, _ = _split(part, dist.world(), dist.rank())
            mbs = self._micro_batches([len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in mine])
            count = dist.all_max(len(mbs))
            mbs += [[]] * (count - len(mbs))
            for mb in mbs:
                chosen = [mine[j] for j in mb]
                record = first if index == 0 else None
                m = self._micro_step(rows, old_lp, adv, chosen, mixed, max(n_tokens, 1.0), record, ref_lp)
                if m:
                    m["_minibatch"] = float(index)
                    collected.append(m)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            norm_f = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            stats["optim/grad_norm"] = max(stats["optim/grad_norm"], norm_f)
            if not math.isfinite(norm_f) or norm_f > cfg.optim.skip_grad_above:
                stats["optim/skipped"] += 1.0
                log.warning("skipping the optimizer step: gradient norm %s", norm_f)
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        gathered = dist.gather((collected, first))
        merged = self._merge_metrics([metrics for metrics, _ in gathered])
        merged.update(stats)
        return merged, {i: v for _, part in gathered for i, v in part.items()}

    def _micro_step(
        self,
        rows: list[Row],
        old_lp: list[list[float]],
        adv: list[float],
        chosen: list[int],
        mixed: bool,
        n_tokens: float,
        record: dict[int, tuple[list[float], list[float]]] | None = None,
        ref_lp: list[list[float]] | None = None,
    ) -> dict[str, float]:
        """Forward, loss and backward of one micro-batch. With `record` (the first mini-batch, before
        any optimizer step of this step), pi_old is this forward's own log-probs, detached, and the
        rows' log-probs and entropies are stored in `record`; otherwise pi_old is `old_lp`."""
        dummy = not chosen
        if dummy:  # keep the collectives in step with the other ranks; contributes no gradient
            chosen = [0]
        sel = [rows[i] for i in chosen]
        ids, att, rids, rmask, pos = pad_rows(
            [r.prompt_ids for r in sel], [r.response_ids for r in sel], self.pad_id, self.device
        )
        lp, ent = response_forward(self.model, ids, att, rids, pos, with_entropy=True)
        width = rids.shape[1]

        def padded(values: list[list[float]] | list[list[float] | None]) -> torch.Tensor:
            t = torch.zeros((len(sel), width), dtype=torch.float32)
            for j, v in enumerate(values):
                if v:
                    t[j, : len(v)] = torch.tensor(v[:width], dtype=torch.float32)
            return t.to(self.device)

        if record is None:
            old = padded([old_lp[i] for i in chosen])
        else:
            old = torch.where(rmask, lp.detach(), 0.0)
            if not dummy:
                assert ent is not None
                lp_rows, ent_rows = lp.detach().float().cpu(), ent.detach().float().cpu()
                for j, i in enumerate(chosen):
                    n = len(rows[i].response_ids)
                    record[i] = (lp_rows[j, :n].tolist(), ent_rows[j, :n].tolist())
        past = padded([r.behaviour_logprobs if r.replayed else None for r in sel])
        replay_mask = torch.tensor([[r.replayed] for r in sel], device=self.device).expand_as(rmask) & rmask
        advantages = torch.tensor([adv[i] for i in chosen], dtype=torch.float32, device=self.device)
        loss, metrics = self.loss(
            lp.float(),
            old_logprobs=old,
            advantages=advantages,
            loss_mask=rmask,
            mixed_phase=mixed,
            replay_mask=replay_mask,
            past_logprobs=past,
            entropy=ent,
            num_loss_tokens=n_tokens,
            ref_logprobs=None if ref_lp is None else padded([ref_lp[i] for i in chosen]),
        )
        scale = 0.0 if dummy else float(dist.world())
        (loss * scale).backward()
        if dummy:
            return {}
        metrics["_tokens"] = float(rmask.sum().item())
        return metrics

    @staticmethod
    def _merge_metrics(per_rank: list[list[dict[str, float]]]) -> dict[str, float]:
        """One value per key from the metrics of every micro-batch of every rank.

        The loss terms and the entropy / KL token means of a micro-batch are its share of the
        mini-batch's value (token sums over the mini-batch's token count), so they add up within a
        mini-batch; the step reports their mean over mini-batches. Ratio statistics are weighted by
        fresh tokens, importance-weight statistics by replayed tokens (and left out when nothing
        was replayed), token counts are summed."""
        parts = [m for rank in per_rank for m in rank if m]
        if not parts:
            return {}
        out: dict[str, float] = {}
        keys = {k for m in parts for k in m if not k.startswith("_")}
        minibatches = sorted({m.get("_minibatch", 0.0) for m in parts})
        fresh = [m.get("tokens/fresh", 0.0) for m in parts]
        replay = [m.get("tokens/replay", 0.0) for m in parts]
        has_replay = sum(replay) > 0

        def weighted(key: str, weights: list[float]) -> float:
            total = sum(w for m, w in zip(parts, weights, strict=True) if key in m)
            num = sum(m[key] * w for m, w in zip(parts, weights, strict=True) if key in m)
            return num / total if total > 0 else 0.0

        for k in keys:
            if k.startswith("tokens/"):
                out[k] = float(sum(m.get(k, 0.0) for m in parts))
            elif k.startswith("loss/") or k in ("actor/entropy", "actor/kl"):
                per_mb = [
                    sum(m.get(k, 0.0) for m in parts if m.get("_minibatch", 0.0) == i) for i in minibatches
                ]
                out[k] = float(sum(per_mb) / len(per_mb))
            elif k.startswith("is/"):
                if not has_replay:
                    continue
                vals = [m[k] for m, n in zip(parts, replay, strict=True) if n > 0 and k in m]
                if k.endswith("_max"):
                    out[k] = float(max(vals))
                elif k.endswith("_min"):
                    out[k] = float(min(vals))
                else:
                    out[k] = float(weighted(k, replay))
            elif k.startswith("actor/ratio"):
                out[k] = float(weighted(k, fresh))
            elif k.endswith("_max"):
                out[k] = float(max(m[k] for m in parts if k in m))
            elif k.endswith("_min"):
                out[k] = float(min(m[k] for m in parts if k in m))
            else:
                out[k] = float(weighted(k, [m.get("_tokens", 0.0) for m in parts]))
        return out

    # ------------------------------------------------------------------------------ metrics
    def _step_metrics(
        self, data: StepData, old_ent: list[list[float]], update: dict[str, float], mixed: bool
    ) -> dict[str, float]:
        rewards = [r.reward for r in data.rows]
        generated = [r for r in data.rows if not r.replayed]
        lengths = [len(r.response_ids) for r in generated]
        truncated = sum(1 for f in data.finish if f == "length")
        m = {
            "batch/solved": float(np.mean([x == 1.0 for x in rewards])) if rewards else 0.0,
            "batch/reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "batch/questions": float(len(data.slots)),
            "batch/replayed_questions": float(sum(1 for _, rep in data.slots if rep)),
            "batch/rows": float(len(data.rows)),
            "batch/generated": float(len(generated)),
            "response/length_mean": float(np.mean(lengths)) if lengths else 0.0,
            "response/length_max": float(max(lengths)) if lengths else 0.0,
            "response/truncated_frac": truncated / max(1, len(generated)),
            "actor/old_entropy": float(np.mean([np.mean(e) for e in old_ent if e])) if old_ent else 0.0,
            "phase/mixed": float(mixed),
            **update,
        }
        return m

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t

    # ------------------------------------------------------------------- publish / checkpoint
    def publish(self) -> Path:
        """Write the current weights as a Hugging Face folder and register the policy version."""
        version = self.step
        path = self.out / "published" / f"v{version:06d}"
        save_hf(self.model, self.tokenizer, path)
        if dist.is_main():
            assert self.client is not None
            self.client.add_policy_version(
                self.cfg.run.pool,
                self.cfg.run.name,
                version=version,
                uri=path.resolve().as_uri(),
                step=self.step,
            )
        self.policy_version = version
        return path

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(
            self.model, self.optimizer, self.step, {"policy_version": self.policy_version}
        )

    def _resume(self) -> None:
        path = self.checkpointer.latest()
        if path is None:
            if self.step > 0:
                log.warning(
                    "run %s is at step %d on the service but there is no checkpoint in %s: "
                    "continuing from the initial weights",
                    self.cfg.run.name,
                    self.step,
                    self.out,
                )
            return
        extra = self.checkpointer.load(self.model, self.optimizer, path)
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
    trainer = Trainer(cfg, client=client)
    try:
        trainer.train(on_step)
    finally:
        trainer.close()
    return trainer
