"""Prepare a running pool service for the one-box recipe (`exgrpo prepare`): what the compose `cpu`
profile's init job does before the trainer and the rollout workers start.

    exgrpo --url http://pool:8700 --token ADMIN prepare --model-out /models/arith-warm

It builds the warm-started tiny model (`exgrpo_onebox.warmstart`, skipped when the folder already
holds it), creates the pool with the recipe's rules and its synthetic training questions, and the
run with the recipe's batch rules (experience.ratio, start_threshold, batch_size). Both are left as
they are when they exist already, so the job can run on every `docker compose up`. A pool of that
name that holds other questions (`exgrpo serve --demo` makes one) is refused rather than trained
on with the wrong grader. It needs the train and rollout extras, not the server extra (the trainer
image has no pool service in it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from exgrpo_client import Client
from exgrpo_client.io import question_from_row
from exgrpo_onebox.config import MainJobOptions, OneBoxConfig, resolve
from exgrpo_onebox.synthetic import make_problems

if TYPE_CHECKING:
    from exgrpo_client import QuestionCreate

__all__ = ["PREPARED_BY", "Prepared", "prepare_pool", "prepare_service"]

SOURCE = "synthetic arithmetic"
PREPARED_BY = f"one-box run on {SOURCE}"
"""The description `prepare_pool` gives the pools it creates from the synthetic questions."""


def prepare_pool(client: Client, cfg: OneBoxConfig, questions: list[QuestionCreate], source: str) -> None:
    """The run's pool (rules `cfg.pool`, the questions) and the run (seed and rules from the trainer
    config), unless they are there already."""
    if not any(p.name == cfg.run.pool for p in client.list_pools().data):
        client.create_pool(cfg.run.pool, config=cfg.pool, description=f"one-box run on {source}")
        client.import_questions(cfg.run.pool, questions)
    if not any(r.name == cfg.run.name for r in client.list_runs(cfg.run.pool).data):
        client.create_run(cfg.run.pool, cfg.run.name, seed=cfg.run.seed, overrides=cfg.run_overrides())


@dataclass(frozen=True)
class Prepared:
    model: Path
    pool: str
    run: str
    questions: int
    """Questions in the pool."""
    created: bool
    """The pool was created now (False: it was there already)."""


def prepare_service(client: Client, opts: MainJobOptions, model_out: Path) -> Prepared:
    """The warm-started model in `model_out`, and the pool and run of `opts` (a one-box recipe
    with its overrides: run.pool, run.name, experience.*, pool.*, job.train_questions) on the
    service behind `client`. ValueError when a pool of that name holds other questions."""
    cfg = resolve(opts).config
    existing = {p.name: p for p in client.list_pools().data}.get(cfg.run.pool)
    if existing is not None and existing.description != PREPARED_BY:
        raise ValueError(
            f"pool {cfg.run.pool!r} exists with other questions ({existing.description!r}): "
            "give another pool name, or delete that pool (is `exgrpo serve --demo` on?)"
        )
    from exgrpo_onebox.warmstart import prepare_model  # torch and transformers: only when run

    model = prepare_model(model_out, seed=0, quick=opts.quick)
    problems = make_problems(cfg.job.train_questions, cfg.run.seed, split="train", family=cfg.job.family)
    questions = [question_from_row(p.to_row(i, "train")) for i, p in enumerate(problems)]
    prepare_pool(client, cfg, questions, SOURCE)
    pool = client.get_pool(cfg.run.pool)
    return Prepared(model, cfg.run.pool, cfg.run.name, pool.num_questions, existing is None)
