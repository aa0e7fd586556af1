"""Masked reductions used for the loss metrics (importance weights, ratios, entropies).

All helpers run under ``torch.no_grad()`` and return plain Python floats; an empty mask gives 0.0 so
that logged series stay finite on micro-batches without, say, replayed tokens.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` where ``mask`` is true (0.0 if none)."""
    count = int(mask.sum())
    if count == 0:
        return 0.0
    return (values.masked_select(mask).double().sum() / count).item()


@torch.no_grad()
def masked_summary(values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``{"mean", "max", "min"}`` of ``values`` where ``mask`` is true (all 0.0 if none)."""
    selected = values.masked_select(mask).double()
    if selected.numel() == 0:
        return {"mean": 0.0, "max": 0.0, "min": 0.0}
    return {
        "mean": selected.mean().item(),
        "max": selected.max().item(),
        "min": selected.min().item(),
    }


@torch.no_grad()
def importance_weight_stats(
    log_weights: torch.Tensor, mask: torch.Tensor, *, prefix: str = "is/w"
) -> dict[str, float]:
    """Mean, max and min of ``exp(log_weights)`` over ``mask``, keyed ``{prefix}_mean`` etc."""
    stats = masked_summary(log_weights.double().exp(), mask)
    return {f"{prefix}_{name}": value for name, value in stats.items()}
