"""The ExGRPO policy loss (spec section 6) and the per-token quantities it consumes.

One call handles one micro-batch of ``B`` sequences padded to ``T`` response tokens. Every response
token is either *fresh* (generated this step) or *replayed* (part of a stored trajectory chosen from
the experience pool):

* fresh token, ``r = exp(lp - lp_old)``: the PPO clipped surrogate ``max(-A r, -A clip(r))`` while
  clipping is on for the current phase (on before the delayed start, off after it: quirk Q6),
  otherwise the plain ``-A r``;
* replayed token, ``w = exp(lp - lp_past)`` with the stored behaviour log-probs (``exp_is_correct``;
  the recomputed ``lp_old`` otherwise): ``-A f(w)`` with the policy shaping ``f(w) = w / (w + beta)``,
  no clipping and no cap. Its gradient with respect to ``lp`` is ``-A beta w / (w + beta)^2``.

Asynchronous generation (the sampler runs a policy up to a few versions older than the trainer's)
uses the *decoupled* objective for fresh tokens when ``behaviour_logprobs`` (the sampler's
log-probs) are given: ``lp_old`` then plays the proximal policy pi_prox, the ratio and its clip stay
``r = pi_theta / pi_prox``, and each token loss is multiplied by the detached behaviour weight
``b = pi_prox / pi_behav``: ``b max(-A r, -A clip(r))`` before the switch, ``-A b r`` after it.
With ``behaviour_weight_cap`` set, tokens whose ``b`` exceeds the cap are left out of the loss
(masked, as AReaL does), not truncated to the cap: see `LossConfig.behaviour_weight_cap`.
Replayed tokens are unchanged.

The policy-gradient term is the plain *sum* of token losses divided by a constant normaliser
(``L_max * 8`` by default, spec 6.3), so the caller can sum micro-batch gradients and obtain exactly
the gradient of the whole mini-batch. The entropy bonus (and the optional KL penalty) are token means;
pass ``num_loss_tokens`` (masked tokens of the whole mini-batch) to make those sum exactly as well,
instead of the reference behaviour where the bonus is weighted by the number of micro-batches (Q7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .metrics import importance_weight_stats, masked_mean

_OFFICIAL_WORLD_SIZE = 8
"""Data-parallel ranks of the official run: its gradients are averaged over 8 ranks, each of which
divides its token sum by ``L_max``, hence the default normaliser ``L_max * 8``."""

_MAX_LOG_RATIO = 20.0
"""Bound on ``lp - lp_old`` for fresh tokens (and on ``ref - lp`` for the KL estimator). A single
optimizer step never moves a token's log-prob by 20 nats in practice; the bound only keeps ``exp`` finite
in float32 for corrupted inputs. Replayed tokens need no bound: ``f(w)`` is evaluated as a sigmoid."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LossConfig:
    """Settings of `ExGRPOLoss`; the defaults reproduce the official run. The trainer's config embeds
    this class as its `loss:` section (validated there; unknown keys are refused)."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}
    """Read by pydantic when the class is a field of a model (no import of pydantic here)."""

    clip_eps: float = 0.2
    """PPO clip range for fresh tokens: the ratio is clipped to ``[1 - clip_eps, upper]``."""

    clip_upper_bound: float = 1.0
    """Floor of the upper clip bound: ``upper = max(clip_upper_bound, 1 + clip_eps)``."""

    clip_before_switch: bool = True
    """Clip fresh-token ratios in the on-policy phase (before the delayed start)."""

    clip_after_switch: bool = False
    """Clip fresh-token ratios in the mixed phase; off in the official code (quirk Q6)."""

    beta: float = 0.1
    """Policy-shaping constant of replayed tokens: ``f(w) = w / (w + beta)``."""

    max_response_len: int = 8192
    """``L_max``, the response-length dimension; sets the default normaliser."""

    normalizer: float | None = None
    """Constant divisor of the policy-gradient token sum; ``None`` means ``max_response_len * 8``."""

    entropy_coeff: float = 0.001
    """Weight of the entropy bonus (subtracted from the loss)."""

    kl_coeff: float = 0.0
    """Weight of the k3 KL estimate to a reference policy; 0 disables it (official run)."""

    exp_is_correct: bool = True
    """Replayed tokens divide by the stored behaviour log-probs (True) or by the recomputed old ones."""

    advantage_std: bool = False
    """Divide advantages by the group's standard deviation (off in ExGRPO; read by the advantage
    computation that feeds this loss)."""

    behaviour_weight_cap: float | None = None
    """Decoupled objective only (``behaviour_logprobs`` given): fresh tokens whose behaviour weight
    ``b = pi_prox / pi_behav`` is above this cap are masked out of the policy-gradient sum (weight 0),
    as AReaL does, rather than truncated to the cap. A token far above the cap was drawn where the
    sampler gave it much less probability than the proximal policy does (a very stale sampler, or a
    sampler whose numerics disagree with the trainer's); truncation would keep exactly those tokens
    at the largest weight of the batch, masking drops them and leaves every other token's weight
    exact. The share of masked tokens is reported (``actor/behav_capped_frac``). ``None`` (default):
    no cap. Must be >= 1, so that tokens the sampler and the proximal policy agree on are kept."""

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError(f"clip_eps must lie in (0, 1), got {self.clip_eps!r}")
        if not self.clip_upper_bound > 0.0:
            raise ValueError(f"clip_upper_bound must be positive, got {self.clip_upper_bound!r}")
        if not (self.beta > 0.0 and math.isfinite(self.beta)):
            raise ValueError(f"beta must be a positive finite number, got {self.beta!r}")
        if isinstance(self.max_response_len, bool) or not isinstance(self.max_response_len, int):
            raise ValueError(f"max_response_len must be an integer, got {self.max_response_len!r}")
        if self.max_response_len < 1:
            raise ValueError(f"max_response_len must be >= 1, got {self.max_response_len!r}")
        if self.normalizer is not None and not (self.normalizer > 0.0 and math.isfinite(self.normalizer)):
            raise ValueError(f"normalizer must be a positive finite number or None, got {self.normalizer!r}")
        if not self.entropy_coeff >= 0.0:
            raise ValueError(f"entropy_coeff must be >= 0, got {self.entropy_coeff!r}")
        if not self.kl_coeff >= 0.0:
            raise ValueError(f"kl_coeff must be >= 0, got {self.kl_coeff!r}")
        cap = self.behaviour_weight_cap
        if cap is not None and not (cap >= 1.0 and math.isfinite(cap)):
            raise ValueError(f"behaviour_weight_cap must be a finite number >= 1 or None, got {cap!r}")

    @property
    def effective_normalizer(self) -> float:
        """The divisor actually applied to the policy-gradient token sum."""
        if self.normalizer is not None:
            return float(self.normalizer)
        return float(self.max_response_len * _OFFICIAL_WORLD_SIZE)

    @property
    def clip_low(self) -> float:
        return 1.0 - self.clip_eps

    @property
    def clip_high(self) -> float:
        return max(self.clip_upper_bound, 1.0 + self.clip_eps)

    def clip_enabled(self, mixed_phase: bool) -> bool:
        """Whether fresh-token ratios are clipped in the given phase."""
        return self.clip_after_switch if mixed_phase else self.clip_before_switch

    def build(self) -> ExGRPOLoss:
        return ExGRPOLoss(self)


class ExGRPOLoss:
    """Mixed on-policy / replay policy loss of one micro-batch (spec 6).

    Call with tensors of shape ``[B, T]`` (``B`` sequences, ``T`` padded response positions)::

        logprobs        [B, T]  log pi_theta(token), with grad (current forward pass)
        old_logprobs    [B, T]  log pi_old(token) recomputed before the update (no grad); the
                                proximal policy pi_prox when behaviour_logprobs are given
        past_logprobs   [B, T]  stored behaviour log-probs of replayed tokens, or None if none
        behaviour_logprobs [B, T]  the sampler's log-probs of fresh tokens (asynchronous mode): fresh
                                token losses get the detached weight b = pi_prox / pi_behav; None
                                (default): no weight, exactly the synchronous loss
        advantages      [B] or [B, T]  group-relative advantage, broadcast over tokens when [B]
        loss_mask       [B, T]  response tokens that count (up to and including EOS)
        replay_mask     [B, T]  bool, tokens of a replayed trajectory (None: all fresh)
        entropy         [B, T]  token entropy of pi_theta, with grad; required if entropy_coeff > 0
        ref_logprobs    [B, T]  reference-policy log-probs; required if kl_coeff > 0
        mixed_phase     bool    phase of the step (selects the fresh-token clipping)
        num_loss_tokens         masked tokens of the whole mini-batch, for the token means

    Returns ``(loss, metrics)``: the scalar loss ``pg - entropy_coeff * H_mean + kl_coeff * KL_mean``
    with ``pg = sum(token losses) / normalizer``, and float metrics computed without grad.
    Subclasses change one token rule by overriding `fresh_token_loss`, `behaviour_capped` or `shape`.
    """

    def __init__(self, config: LossConfig | None = None) -> None:
        self.config = config if config is not None else LossConfig()

    def fresh_token_loss(self, ratio: torch.Tensor, advantages: torch.Tensor, *, clip: bool) -> torch.Tensor:
        """``[B, T]`` loss of fresh tokens from their ratio ``r = pi_theta / pi_old``."""
        unclipped = -advantages * ratio
        if not clip:
            return unclipped
        clipped = -advantages * ratio.clamp(self.config.clip_low, self.config.clip_high)
        return torch.maximum(unclipped, clipped)

    def behaviour_capped(self, log_weight: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool mask of the fresh tokens whose behaviour weight ``b = exp(log_weight)``
        is above ``behaviour_weight_cap`` (none without a cap); those are masked out of the loss."""
        cap = self.config.behaviour_weight_cap
        if cap is None:
            return torch.zeros_like(fresh)
        return fresh & (log_weight.exp() > cap)

    def shape(self, log_weight: torch.Tensor) -> torch.Tensor:
        """``f(w) = w / (w + beta)`` from ``log w``, evaluated as ``sigmoid(log w - log beta)``."""
        return torch.sigmoid(log_weight - math.log(self.config.beta))

    def replay_token_loss(self, log_weight: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` loss of replayed tokens from ``log w = log pi_theta - log pi_past``."""
        return -advantages * self.shape(log_weight)

    def __call__(
        self,
        logprobs: torch.Tensor,
        *,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        mixed_phase: bool,
        replay_mask: torch.Tensor | None = None,
        past_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        num_loss_tokens: float | None = None,
        behaviour_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        shape = logprobs.shape
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
        named = {
            "old_logprobs": old_logprobs,
            "loss_mask": loss_mask,
            "replay_mask": replay_mask,
            "past_logprobs": past_logprobs,
            "entropy": entropy,
            "ref_logprobs": ref_logprobs,
            "behaviour_logprobs": behaviour_logprobs,
        }
        for name, tensor in named.items():
            if tensor is not None and tensor.shape != shape:
                raise ValueError(
                    f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(tensor.shape)}"
                )
        if advantages.shape not in (shape, shape[:1]):
            raise ValueError(
                f"advantages must be [B] or [B, T] with B, T = {tuple(shape)}, got {tuple(advantages.shape)}"
            )
        if cfg.entropy_coeff > 0.0 and entropy is None:
            raise ValueError("entropy is required when entropy_coeff > 0 (or set entropy_coeff=0)")
        if cfg.kl_coeff > 0.0 and ref_logprobs is None:
            raise ValueError("ref_logprobs is required when kl_coeff > 0 (or set kl_coeff=0)")
        if num_loss_tokens is not None and not num_loss_tokens > 0:
            raise ValueError(f"num_loss_tokens must be positive, got {num_loss_tokens!r}")

        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        lp = logprobs.to(dtype)
        mask = loss_mask.bool()
        replay = (mask & replay_mask.bool()) if replay_mask is not None else torch.zeros_like(mask)
        fresh = mask & ~replay
        num_replay = int(replay.sum())
        if cfg.exp_is_correct and past_logprobs is None and num_replay > 0:
            raise ValueError("past_logprobs is required for replayed tokens when exp_is_correct is set")
        adv = advantages.to(dtype)
        adv = adv[:, None].expand(shape) if adv.dim() == 1 else adv
        # Masked positions may hold anything (padding, NaN): select before any arithmetic so that
        # neither the loss nor its gradient can see them.
        adv = torch.where(mask, adv, 0.0)
        zero = lp.new_zeros(())

        log_ratio = torch.where(fresh, lp - old_logprobs.to(dtype), zero).clamp(
            -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )
        ratio = log_ratio.exp()
        clip = cfg.clip_enabled(mixed_phase)
        fresh_token_losses = self.fresh_token_loss(ratio, adv, clip=clip)
        behaviour_log_weight: torch.Tensor | None = None
        capped = torch.zeros_like(fresh)
        if behaviour_logprobs is not None:
            # Decoupled objective: lp_old is the proximal policy, the sampler's lp the behaviour one.
            # b = pi_prox / pi_behav is a constant of the step (no gradient), b = 1 exactly when the
            # two agree, so the product below then equals the synchronous token loss bit for bit.
            behaviour_log_weight = (
                torch.where(fresh, old_logprobs.to(dtype) - behaviour_logprobs.to(dtype), zero)
                .clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
                .detach()
            )
            capped = self.behaviour_capped(behaviour_log_weight, fresh)
            fresh_token_losses = behaviour_log_weight.exp() * fresh_token_losses
        fresh_losses = torch.where(fresh & ~capped, fresh_token_losses, zero)
        pg_fresh = fresh_losses.sum() / cfg.effective_normalizer

        if num_replay > 0:
            behaviour = past_logprobs if cfg.exp_is_correct else old_logprobs
            assert behaviour is not None
            log_weight = torch.where(replay, lp - behaviour.to(dtype), zero)
            replay_losses = torch.where(replay, self.replay_token_loss(log_weight, adv), zero)
            pg_replay = replay_losses.sum() / cfg.effective_normalizer
        else:
            log_weight = torch.zeros_like(lp)
            pg_replay = zero
        pg = pg_fresh + pg_replay

        denominator = float(num_loss_tokens) if num_loss_tokens is not None else max(int(mask.sum()), 1)
        loss = pg
        entropy_mean = zero
        if entropy is not None:
            entropy_mean = torch.where(mask, entropy.to(dtype), zero).sum() / denominator
            if cfg.entropy_coeff > 0.0:
                loss = loss - cfg.entropy_coeff * entropy_mean
        kl_mean = zero
        if ref_logprobs is not None:
            delta = torch.where(mask, ref_logprobs.to(dtype) - lp, zero).clamp(
                -_MAX_LOG_RATIO, _MAX_LOG_RATIO
            )
            kl_tokens = torch.where(mask, delta.exp() - delta - 1.0, zero)  # k3 estimator, >= 0
            kl_mean = kl_tokens.sum() / denominator
            if cfg.kl_coeff > 0.0:
                loss = loss + cfg.kl_coeff * kl_mean

        metrics = self._metrics(
            loss=loss,
            pg=pg,
            pg_fresh=pg_fresh,
            pg_replay=pg_replay,
            entropy_mean=entropy_mean,
            kl_mean=kl_mean,
            ratio=ratio,
            adv=adv,
            fresh=fresh,
            log_weight=log_weight,
            replay=replay,
            behaviour_log_weight=behaviour_log_weight,
            capped=capped,
        )
        return loss, metrics

    @torch.no_grad()
    def _metrics(
        self,
        *,
        loss: torch.Tensor,
        pg: torch.Tensor,
        pg_fresh: torch.Tensor,
        pg_replay: torch.Tensor,
        entropy_mean: torch.Tensor,
        kl_mean: torch.Tensor,
        ratio: torch.Tensor,
        adv: torch.Tensor,
        fresh: torch.Tensor,
        log_weight: torch.Tensor,
        replay: torch.Tensor,
        behaviour_log_weight: torch.Tensor | None,
        capped: torch.Tensor,
    ) -> dict[str, float]:
        cfg = self.config
        # Tokens where the clipped branch is strictly the larger one: its gradient is zero when
        # clipping is on; with clipping off this is where it *would* bind (a staleness signal).
        binding = (-adv * ratio.clamp(cfg.clip_low, cfg.clip_high)) > (-adv * ratio)
        metrics = {
            "loss/total": loss.item(),
            "loss/pg": pg.item(),
            "loss/pg_fresh": pg_fresh.item(),
            "loss/pg_replay": pg_replay.item(),
            "loss/entropy": -cfg.entropy_coeff * entropy_mean.item(),
            "loss/kl": cfg.kl_coeff * kl_mean.item(),
            "actor/entropy": entropy_mean.item(),
            "actor/kl": kl_mean.item(),
            "actor/ratio_clipped_frac": masked_mean(binding.to(ratio.dtype), fresh),
            "actor/ratio_mean": masked_mean(ratio, fresh),
            "tokens/fresh": float(fresh.sum().item()),
            "tokens/replay": float(replay.sum().item()),
        }
        metrics.update(importance_weight_stats(log_weight, replay, prefix="is/w"))
        metrics["is/fw_mean"] = masked_mean(self.shape(log_weight), replay)
        if behaviour_log_weight is not None:
            # the weight b = pi_prox / pi_behav before the cap, over fresh tokens: a staleness signal
            metrics.update(importance_weight_stats(behaviour_log_weight, fresh, prefix="actor/behav_weight"))
            metrics["actor/behav_capped_frac"] = masked_mean(capped.to(ratio.dtype), fresh)
        return metrics


def _row_chunks(num_rows: int, chunk_size: int) -> list[slice]:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [slice(start, min(start + chunk_size, num_rows)) for start in range(0, num_rows, chunk_size)]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """``[B, T]`` log-prob of ``token_ids`` under ``logits [B, T, V]`` (temperature 1).

    Computed as the gathered logit minus ``logsumexp`` over the vocabulary, ``chunk_size`` positions at
    a time in at least float32, so no full ``[B, T, V]`` log-softmax (or float32 copy) is materialised.
    """
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(
            "expected logits [B, T, V] and token_ids [B, T], "
            f"got {tuple(logits.shape)} and {tuple(token_ids.shape)}"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_ids = token_ids.reshape(-1, 1).long()
    parts = []
    for rows in _row_chunks(flat_logits.shape[0], chunk_size):
        chunk = flat_logits[rows].to(dtype)
        picked = chunk.gather(-1, flat_ids[rows]).squeeze(-1)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    if not parts:
        return logits.new_zeros(token_ids.shape, dtype=dtype)
    return torch.cat(parts).reshape(token_ids.shape)


def token_entropy(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """``[B, T]`` entropy ``-sum_v p log p`` of the distributions given by ``logits [B, T, V]``.

    Uses ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, which stays finite for very peaked or
    ``-inf``-masked logits, ``chunk_size`` positions at a time in at least float32.
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [B, T, V], got {tuple(logits.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    parts = []
    for rows in _row_chunks(flat_logits.shape[0], chunk_size):
        chunk = flat_logits[rows].to(dtype)
        probs = torch.softmax(chunk, dim=-1)
        # Entries without probability mass (e.g. -inf masked logits) would turn p * z into 0 * -inf;
        # replacing their logit by 0 first keeps both the value and its gradient finite.
        finite_logits = torch.where(probs > 0, chunk, torch.zeros_like(chunk))
        parts.append(torch.logsumexp(chunk, dim=-1) - (probs * finite_logits).sum(-1))
    if not parts:
        return logits.new_zeros(logits.shape[:2], dtype=dtype)
    return torch.cat(parts).reshape(logits.shape[:2])
