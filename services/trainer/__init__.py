"""The ExGRPO learner on PyTorch FSDP2.

Public API (what the one-box job, the CLI and other callers use; everything else is internal):

    from exgrpo_trainer import TrainConfig, load_config, run_training

    cfg = load_config("exgrpo", ["model.path=models/m", "run.pool=math"])   # or TrainConfig(...)
    data = apply_overrides({}, ["optim.lr=1e-6"])   # {"optim": {"lr": 1e-06}}: key=value as data
    trainer = run_training(cfg, on_step=hook)   # hook(trainer, metrics) -> True ends the run

A step hook sees the `Trainer`: `trainer.step`, `trainer.cfg`, `trainer.tokenizer`, and
`with trainer.generation_engine() as engine:` (a rollout engine over the full current weights,
entered on every rank together).

The trainer's modules (transformers, the SDK, the rollout engines) are imported on first use of
`Trainer`, `run_training` or `StepHook`; the config alone needs torch only through the loss's
settings class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exgrpo_trainer.config import TrainConfig, apply_overrides, format_config_error, load_config, recipes

if TYPE_CHECKING:
    from exgrpo_trainer.trainer import StepHook, Trainer, run_training

__all__ = [
    "StepHook",
    "TrainConfig",
    "Trainer",
    "apply_overrides",
    "format_config_error",
    "load_config",
    "recipes",
    "run_training",
]

_LAZY = {"StepHook", "Trainer", "run_training"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from exgrpo_trainer import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'exgrpo_trainer' has no attribute {name!r}")
