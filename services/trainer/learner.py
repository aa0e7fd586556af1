"""The learner: the policy model, its optimizer and the ExGRPO loss; scores rows and updates.

Distributed rules: every forward of the FSDP2 model is a collective, so each rank runs the same
number of forwards (work is split into equal chunks, padded with throw-away rows), and losses are
multiplied by the world size so FSDP's gradient average becomes the sum the constant-normaliser
objective asks for. One process is a group of one and runs the same code. Every method is called
on every rank with the same arguments.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from exgrpo_trainer import dist
from exgrpo_trainer.algo import ExGRPOLoss, LossConfig, Row, row_advantages
from exgrpo_trainer.config import ModelSection, OptimSection
from exgrpo_trainer.model import load_model, pad_rows, response_forward
from exgrpo_trainer.step_metrics import StepTimer, merge_update_metrics

log = logging.getLogger("exgrpo.trainer")
T = TypeVar("T")
FirstPass = dict[int, tuple[list[float], list[float]]]
"""Row index -> (log-probs, entropies) recorded by the first mini-batch's update forward."""


def derived_seed(*keys: object) -> int:
    """A 32-bit seed from any keys (run seed, step, purpose): the same keys give the same seed."""
    return int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:4], "little")


def split_even(items: Sequence[T], parts: int, index: int) -> tuple[list[T], int]:
    """Contiguous chunk `index` of `parts` equal chunks (the last ones padded by the caller)."""
    per = math.ceil(len(items) / parts) if items else 0
    return list(items[index * per : (index + 1) * per]), per


@dataclass
class LearnResult:
    old_logprobs: list[list[float]]
    """pi_old of every row's response tokens (the weights before this step's first update)."""
    old_entropy: list[list[float]]
    metrics: dict[str, float]
    first_minibatch: list[int]
    """Row indices of the step's first mini-batch (its pi_old came from its own update forward)."""


class Learner:
    def __init__(
        self,
        model_cfg: ModelSection,
        optim: OptimSection,
        loss: LossConfig,
        *,
        device: torch.device,
        pad_id: int,
        seed: int,
        timer: StepTimer | None = None,
    ) -> None:
        self.optim_cfg = optim
        self.loss_cfg = loss
        self.device = device
        self.pad_id = pad_id
        self.seed = seed
        self.timer = timer if timer is not None else StepTimer()
        self.model = load_model(
            model_cfg.path,
            device,
            dtype=model_cfg.dtype,
            activation_checkpointing=model_cfg.activation_checkpointing,
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            fused=True,  # one kernel per step instead of a loop over tensors (5x faster on CPU too)
        )
        self.loss = ExGRPOLoss(loss)
        self.ref_model: torch.nn.Module | None = None
        if loss.kl_coeff > 0:
            # frozen, sharded like the policy; not checkpointed (it is reloaded from its folder)
            self.ref_model = load_model(
                model_cfg.reference_path or model_cfg.path,
                device,
                dtype=model_cfg.dtype,
                activation_checkpointing=False,
            ).requires_grad_(False)

    # ------------------------------------------------------------------------------ scoring
    def micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices grouped so that rows x padded length stays under the token budget."""
        budget = self.optim_cfg.micro_batch_tokens
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            width = max([lengths[j] for j in cur] + [lengths[i]])
            if cur and width * (len(cur) + 1) > budget:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches

    def score(
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
        mine, per = split_even(idx, dist.world(), dist.rank())
        if per == 0:
            return [], []
        mine += [idx[0]] * (per - len(mine))
        mbs = self.micro_batches([len(prompts[i]) + len(responses[i]) for i in mine])
        mbs += [[0]] * (dist.all_max(len(mbs)) - len(mbs))
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
        all_lp: dict[int, list[float]] = {}
        all_ent: dict[int, list[float]] = {}
        for a, b in dist.gather((lp_out, ent_out)):
            all_lp.update(a)
            all_ent.update(b)
        return [all_lp[i] for i in idx], [all_ent[i] for i in idx]

    # ------------------------------------------------------------------------------- update
    def learn(self, rows: list[Row], *, mixed: bool, step: int, decoupled: bool = False) -> LearnResult:
        """Old log-probs (pi_old) and entropies of `rows`, advantages, and the policy update of
        training step `step` (its mini-batch shuffle is seeded by it).

        pi_old is the policy before the step's first optimizer step, so the first mini-batch takes
        it from its own update forward, detached (the same weights give the same numbers, without a
        second forward pass); only the rows of later mini-batches are scored beforehand.

        `decoupled` (asynchronous generation): pi_old is the proximal policy and the fresh rows'
        sampler log-probs (`Row.behaviour_logprobs`) the behaviour policy of the decoupled loss;
        every fresh row must carry them."""
        if decoupled:
            missing = [
                i
                for i, r in enumerate(rows)
                if not r.replayed and r.response_ids and r.behaviour_logprobs is None
            ]
            if missing:
                raise ValueError(
                    f"{len(missing)} generated rows have no sampler log-probs: asynchronous generation "
                    "(rollout.max_policy_lag > 0) needs workers that report them"
                )
        parts = self.mini_batches(len(rows), step)
        old_lp: list[list[float]] = [[] for _ in rows]
        old_ent: list[list[float]] = [[] for _ in rows]
        with self.timer.part("old_logprob"):
            later = sorted(i for part in parts[1:] for i in part)
            if later:
                lp, ent = self.score(
                    [rows[i].prompt_ids for i in later],
                    [rows[i].response_ids for i in later],
                    with_entropy=True,
                )
                for i, row_lp, row_ent in zip(later, lp, ent, strict=True):
                    old_lp[i], old_ent[i] = row_lp, row_ent
        ref_lp: list[list[float]] | None = None
        if self.ref_model is not None:
            with self.timer.part("ref_logprob"):
                ref_lp, _ = self.score(
                    [r.prompt_ids for r in rows],
                    [r.response_ids for r in rows],
                    with_entropy=False,
                    model=self.ref_model,
                )
        adv = row_advantages(rows, use_std=self.loss_cfg.advantage_std)
        with self.timer.part("update"):
            metrics, first = self._update(rows, parts, old_lp, adv, mixed, ref_lp, decoupled)
        for i, (row_lp, row_ent) in first.items():
            old_lp[i], old_ent[i] = row_lp, row_ent
        return LearnResult(old_lp, old_ent, metrics, sorted(parts[0]) if parts else [])

    def mini_batches(self, num_rows: int, step: int) -> list[list[int]]:
        """Row indices of a step's mini-batches: a seeded shuffle, dealt round-robin."""
        m = self.optim_cfg.mini_batches
        rng = np.random.default_rng(derived_seed(self.seed, step, "minibatch"))
        order = rng.permutation(num_rows).tolist()
        return [order[i::m] for i in range(m)]

    def _update(
        self,
        rows: list[Row],
        parts: list[list[int]],
        old_lp: list[list[float]],
        adv: list[float],
        mixed: bool,
        ref_lp: list[list[float]] | None,
        decoupled: bool,
    ) -> tuple[dict[str, float], FirstPass]:
        """The optimizer steps, one per mini-batch. Returns the update metrics, and the log-probs and
        entropies of the first mini-batch's rows (its pi_old, from its update forward)."""
        collected: list[dict[str, float]] = []
        first: FirstPass = {}
        stats: dict[str, float] = {"optim/skipped": 0.0, "optim/grad_norm": 0.0}
        for index, part in enumerate(parts):
            if not part:
                continue
            n_tokens = max(float(sum(len(rows[i].response_ids) for i in part)), 1.0)
            mine, _ = split_even(part, dist.world(), dist.rank())
            mbs = self.micro_batches([len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in mine])
            mbs += [[]] * (dist.all_max(len(mbs)) - len(mbs))
            for mb in mbs:
                record = first if index == 0 else None
                m = self._micro_step(
                    rows, old_lp, adv, [mine[j] for j in mb], mixed, n_tokens, record, ref_lp, decoupled
                )
                if m:
                    collected.append({**m, "_minibatch": float(index)})
            self._optimizer_step(stats)
        gathered = dist.gather((collected, first))
        merged = merge_update_metrics([metrics for metrics, _ in gathered])
        merged.update(stats)
        return merged, {i: v for _, part in gathered for i, v in part.items()}

    def _optimizer_step(self, stats: dict[str, float]) -> None:
        """Clip, then step unless the pre-clip norm is non-finite or too large; clear gradients."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
        norm_f = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stats["optim/grad_norm"] = max(stats["optim/grad_norm"], norm_f)
        if not math.isfinite(norm_f) or norm_f > self.optim_cfg.skip_grad_above:
            stats["optim/skipped"] += 1.0
            log.warning("skipping the optimizer step: gradient norm %s", norm_f)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _micro_step(
        self,
        rows: list[Row],
        old_lp: list[list[float]],
        adv: list[float],
        chosen: list[int],
        mixed: bool,
        n_tokens: float,
        record: FirstPass | None,
        ref_lp: list[list[float]] | None,
        decoupled: bool,
    ) -> dict[str, float]:
        """Forward, loss and backward of one micro-batch. With `record` (the first mini-batch, before
        any optimizer step of this step), pi_old is this forward's own log-probs, detached, and the
        rows' log-probs and entropies are stored in `record`; otherwise pi_old is `old_lp`. With
        `decoupled`, the fresh rows' sampler log-probs go to the loss as the behaviour policy."""
        dummy = not chosen
        if dummy:  # keep the collectives in step with the other ranks; contributes no gradient
            chosen = [0]
        sel = [rows[i] for i in chosen]
        ids, att, rids, rmask, pos = pad_rows(
            [r.prompt_ids for r in sel], [r.response_ids for r in sel], self.pad_id, self.device
        )
        lp, ent = response_forward(self.model, ids, att, rids, pos, with_entropy=True)
        assert ent is not None
        width = rids.shape[1]

        def padded(values: Sequence[list[float] | None]) -> torch.Tensor:
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
                lp_rows, ent_rows = lp.detach().float().cpu(), ent.detach().float().cpu()
                for j, i in enumerate(chosen):
                    n = len(rows[i].response_ids)
                    record[i] = (lp_rows[j, :n].tolist(), ent_rows[j, :n].tolist())
        replay_mask = torch.tensor([[r.replayed] for r in sel], device=self.device).expand_as(rmask) & rmask
        decoupled_args: dict[str, Any] = (
            {"behaviour_logprobs": padded([None if r.replayed else r.behaviour_logprobs for r in sel])}
            if decoupled
            else {}
        )  # the synchronous call stays exactly the loss without a behaviour policy
        loss, metrics = self.loss(
            lp.float(),
            old_logprobs=old,
            advantages=torch.tensor([adv[i] for i in chosen], dtype=torch.float32, device=self.device),
            loss_mask=rmask,
            mixed_phase=mixed,
            replay_mask=replay_mask,
            past_logprobs=padded([r.behaviour_logprobs if r.replayed else None for r in sel]),
            entropy=ent,
            num_loss_tokens=n_tokens,
            ref_logprobs=None if ref_lp is None else padded([ref_lp[i] for i in chosen]),
            **decoupled_args,
        )
        (loss * (0.0 if dummy else float(dist.world()))).backward()
        if dummy:
            return {}
        metrics["_tokens"] = float(rmask.sum().item())
        return metrics
