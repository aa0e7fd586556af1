"""Pure domain rules of the ExGRPO experience pool (no I/O; stdlib and numpy only)."""

from .buckets import bucket_probs, bucket_weight, check_weights
from .collection import GroupAction, GroupDecision, decide_group, dedup, is_correct, trajectory_key
from .composition import (
    Composition,
    compose_batch,
    next_phase,
    replay_target,
    solved_fraction,
    solved_fraction_of,
)
from .epoch import epoch_order, refresh_active, take_fresh
from .rules import ExperienceRules, Phase, Unit, Weighting
from .sampler import Draw, allocate_counts, draw_indices, make_rng, sample_bucket_counts, sample_replay

__all__ = [
    "Composition",
    "Draw",
    "ExperienceRules",
    "GroupAction",
    "GroupDecision",
    "Phase",
    "Unit",
    "Weighting",
    "allocate_counts",
    "bucket_probs",
    "bucket_weight",
    "check_weights",
    "compose_batch",
    "decide_group",
    "dedup",
    "draw_indices",
    "epoch_order",
    "is_correct",
    "make_rng",
    "next_phase",
    "refresh_active",
    "replay_target",
    "sample_bucket_counts",
    "sample_replay",
    "solved_fraction",
    "solved_fraction_of",
    "take_fresh",
    "trajectory_key",
]
