"""The ExGRPO algorithm core of the trainer: advantages, loss, trajectory selection, training rows.

Pure computation: imports only the standard library, numpy and torch, and performs no I/O.
"""

from .advantages import batch_advantages, group_advantages
from .loss import ExGRPOLoss, LossConfig, token_entropy, token_logprobs
from .metrics import importance_weight_stats, masked_mean, masked_summary
from .rollout_rows import (
    PlannedQuestion,
    Response,
    Row,
    build_rows,
    group_rewards,
    num_generations,
    row_advantages,
)
from .selection import (
    METRICS,
    MODES,
    Metric,
    Mode,
    choose_trajectories,
    choose_trajectory,
    masked_row_mean,
    mean_token_entropy,
    official_compat_score,
    perplexity,
    score_candidates,
)

__all__ = [
    "METRICS",
    "MODES",
    "ExGRPOLoss",
    "LossConfig",
    "Metric",
    "Mode",
    "PlannedQuestion",
    "Response",
    "Row",
    "batch_advantages",
    "build_rows",
    "choose_trajectories",
    "choose_trajectory",
    "group_advantages",
    "group_rewards",
    "importance_weight_stats",
    "masked_mean",
    "masked_row_mean",
    "masked_summary",
    "mean_token_entropy",
    "num_generations",
    "official_compat_score",
    "perplexity",
    "row_advantages",
    "score_candidates",
    "token_entropy",
    "token_logprobs",
]
