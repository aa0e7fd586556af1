"""Choosing the stored trajectory replayed for a sampled question (spec 4.2).

For every stored trajectory of a replayed question the current policy scores the trajectory
(prompt + trajectory + EOS, temperature 1) and one trajectory is picked:

* ``ent``: mean token entropy over the trajectory's tokens, EOS included (official default);
* ``ppl``: perplexity ``exp(-mean token log-prob)``;
* ``random``: a uniform pick, no forward pass needed;

with ``argmin`` (official default; ties go to the first candidate in insertion order) or ``argmax``.
This module implements the *intended* rule. `official_compat_score` reproduces the effective score of
the reference code, which differs (quirk Q1); it exists for ablations only.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Literal, get_args

import numpy as np
import torch

Metric = Literal["ent", "ppl", "random"]
"""Trajectory score: mean token entropy, perplexity, or a random score."""

Mode = Literal["argmin", "argmax"]
"""Whether the lowest or the highest score is replayed."""

METRICS: tuple[str, ...] = get_args(Metric)
MODES: tuple[str, ...] = get_args(Mode)


def choose_trajectory(scores: Sequence[float] | np.ndarray, mode: Mode = "argmin") -> int:
    """Index of the selected candidate; ties go to the first one."""
    values = np.asarray(scores, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"scores must be a non-empty 1-D sequence, got shape {values.shape}")
    if np.isnan(values).any():
        raise ValueError("scores must not contain NaN")
    if mode == "argmin":
        return int(np.argmin(values))
    if mode == "argmax":
        return int(np.argmax(values))
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def choose_trajectories(
    scores: Sequence[float] | np.ndarray, counts: Sequence[int], mode: Mode = "argmin"
) -> list[int]:
    """Per-question choice when the candidates of several questions were scored in one batch.

    Args:
        scores: ``[N]`` scores, the candidates of question 0 first, then those of question 1, ...
        counts: number of candidates of each question (each >= 1, summing to ``N``).
        mode: ``argmin`` or ``argmax``.

    Returns:
        For each question, the index of its chosen candidate *within that question*.
    """
    values = np.asarray(scores, dtype=np.float64)
    if any(c < 1 for c in counts) or sum(counts) != values.size:
        raise ValueError(f"counts must be >= 1 and sum to the number of scores ({values.size}), got {counts}")
    bounds = np.cumsum([0, *counts])
    return [choose_trajectory(values[lo:hi], mode) for lo, hi in pairwise(bounds)]


def _check_rows(values: torch.Tensor, mask: torch.Tensor, name: str) -> torch.Tensor:
    if values.dim() != 2 or mask.shape != values.shape:
        raise ValueError(
            f"{name} and mask must both be [N, T], got {tuple(values.shape)} and {tuple(mask.shape)}"
        )
    mask = mask.bool()
    if not bool(mask.any(dim=-1).all()):
        raise ValueError("every candidate needs at least one token in mask")
    return mask


@torch.no_grad()
def masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` mean of ``values [N, T]`` over the true entries of ``mask [N, T]`` of each row."""
    mask = _check_rows(values, mask, "values")
    summed = torch.where(mask, values.double(), 0.0).sum(-1)
    return summed / mask.sum(-1)


def mean_token_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` mean token entropy of each candidate (``entropy``, ``mask``: ``[N, T]``); metric ``ent``."""
    return masked_row_mean(entropy, mask)


def perplexity(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` perplexity ``exp(-mean log-prob)`` of each candidate; metric ``ppl``."""
    return torch.exp(-masked_row_mean(logprobs, mask))


def score_candidates(
    metric: Metric,
    *,
    num_candidates: int,
    entropy: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """``[N]`` float64 scores of ``num_candidates`` candidates under ``metric``.

    ``ent`` needs ``entropy`` and ``mask``, ``ppl`` needs ``logprobs`` and ``mask`` (all ``[N, T]``,
    from the current policy); ``random`` needs a seeded ``rng`` and draws i.i.d. uniform scores, so
    either mode picks a uniformly random candidate.
    """
    if metric == "ent":
        if entropy is None or mask is None:
            raise ValueError("metric 'ent' needs entropy and mask")
        scores = mean_token_entropy(entropy, mask).cpu().numpy()
    elif metric == "ppl":
        if logprobs is None or mask is None:
            raise ValueError("metric 'ppl' needs logprobs and mask")
        scores = perplexity(logprobs, mask).cpu().numpy()
    elif metric == "random":
        if rng is None:
            raise ValueError("metric 'random' needs a seeded numpy Generator (rng)")
        scores = rng.random(num_candidates)
    else:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if scores.shape != (num_candidates,):
        raise ValueError(f"expected {num_candidates} candidates, the inputs hold {scores.shape[0]}")
    return scores


def official_compat_score(
    prompt_entropy: Sequence[float] | np.ndarray,
    trajectory_entropy: Sequence[float] | np.ndarray,
    *,
    max_prompt_len: int = 1024,
    max_response_len: int = 8192,
    mask_len: int | None = None,
) -> float:
    """Effective ``ent`` score of the reference implementation, for ablations only (quirk Q1).

    Do not use this to select trajectories in a normal run; it reproduces a bug. The reference scores
    the sequence *left*-padded to ``max_prompt_len + max_response_len`` (pads have entropy 0), takes the
    window of the last ``max_response_len`` prediction positions, and averages the positions where the
    *right*-padded trajectory holds padding, i.e. the last ``max_response_len - mask_len`` positions.
    Hence ``(sum H + sum prompt H) / (L_max - L)`` for ``L <= L_max / 2``, and the mean entropy of the
    last ``L_max - L`` trajectory tokens beyond that. The reference also takes the mask of row ``i``
    from row ``i mod 8`` of the last chunk of 8 rows; pass that row's length as ``mask_len`` to mimic
    it (default: the trajectory's own length).

    Args:
        prompt_entropy: ``[P - 1]`` entropies of the positions predicting prompt tokens 2..P.
        trajectory_entropy: ``[L]`` entropies of the distributions that produced the trajectory
            tokens (EOS included).
        max_prompt_len: prompt padding length of the reference (``P <= max_prompt_len``).
        max_response_len: ``L_max`` (``L <= L_max``).
        mask_len: length of the trajectory whose padding mask is used.

    Returns:
        The score; NaN when no position is selected (``mask_len == max_response_len``), as in the
        reference.
    """
    prompt = np.asarray(prompt_entropy, dtype=np.float64)
    trajectory = np.asarray(trajectory_entropy, dtype=np.float64)
    if prompt.size + 1 > max_prompt_len or trajectory.size > max_response_len:
        raise ValueError(
            f"prompt ({prompt.size + 1}) or trajectory ({trajectory.size}) longer than "
            f"max_prompt_len={max_prompt_len} / max_response_len={max_response_len}"
        )
    used = trajectory.size if mask_len is None else mask_len
    if not 0 <= used <= max_response_len:
        raise ValueError(f"mask_len must lie in [0, {max_response_len}], got {mask_len}")
    # Entropies of the unpadded prediction positions; the left padding contributes zeros, so the
    # selected window is the last `num_selected` of them (fewer when the sequence is shorter).
    positions = np.concatenate([prompt, trajectory])
    num_selected = max_response_len - used
    if num_selected == 0:
        return float("nan")
    return float(positions[-num_selected:].sum() / num_selected)
