"""One or two optimizer steps of the trainer on fixed rows, without a service or generation.

    python _equivalence_worker.py MODEL_DIR OUT_FILE                     # one process
    torchrun --standalone --nproc_per_node=2 _equivalence_worker.py MODEL_DIR OUT_FILE

Rank 0 saves the update metrics, the old log-probs and the full (unsharded) weights after each step
to OUT_FILE. The same rows on any number of ranks must give the same numbers.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from exgrpo_trainer import dist
from exgrpo_trainer.algo import Row
from exgrpo_trainer.config import TrainConfig, load_config
from exgrpo_trainer.model import full_state_dict
from exgrpo_trainer.trainer import Trainer


def row_config(model_dir: Path, out_dir: Path, *extra: str) -> TrainConfig:
    """Settings for updates on given rows: several mini- and micro-batches, a large learning rate."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            f"run.output_dir={out_dir}",
            "rollout.grading_workers=0",
            "rollout.max_new_tokens=16",
            "optim.lr=1e-3",
            "optim.mini_batches=3",
            "optim.micro_batch_tokens=64",
            "loss.normalizer=16",
            "loss.entropy_coeff=0.01",
            *extra,
        ],
    )


def fixed_rows(
    tokenizer: PreTrainedTokenizerBase, *, groups: int = 5, k: int = 4, replay: bool, seed: int = 0
) -> list[Row]:
    """`groups` groups of `k` rows with varied lengths and mixed rewards; with `replay`, row 0 of
    every other group is a replayed trajectory with made-up behaviour log-probs."""
    rng = random.Random(seed)
    eos = int(tokenizer.eos_token_id)
    chars = tokenizer.convert_tokens_to_ids(list("0123456789+-=() abcxyz\n"))
    rows: list[Row] = []
    for g in range(groups):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{g + 3}+{2 * g}"}], add_generation_prompt=True, tokenize=False
        )
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        for i in range(k):
            n = rng.randint(2, 11)
            response = [rng.choice(chars) for _ in range(n)]
            if rng.random() < 0.7:
                response.append(eos)
            replayed = replay and i == 0 and g % 2 == 0
            rows.append(
                Row(
                    group=g,
                    question_id=100 + g,
                    prompt_ids=prompt,
                    response_ids=response,
                    reward=1.0 if replayed else float((g + i) % 3 == 0),
                    behaviour_logprobs=[-rng.uniform(0.5, 6.0) for _ in response] if replayed else None,
                    replayed=replayed,
                )
            )
    return rows


def learn_rows(
    trainer: Trainer, rows: list[Row], *, mixed: bool
) -> tuple[list[list[float]], list[list[float]], dict[str, float]]:
    """The learner's update on `rows` as the trainer's next step: (pi_old log-probs, entropies,
    metrics)."""
    learned = trainer.learner.learn(rows, mixed=mixed, step=trainer.step + 1)
    return learned.old_logprobs, learned.old_entropy, learned.metrics


def main(model_dir: Path, out_file: Path) -> None:
    # with the KL term (reference = the starting weights) and activation checkpointing, both sharded
    cfg = row_config(
        model_dir,
        out_file.parent / f"trainer-{out_file.stem}",
        "loss.kl_coeff=0.1",
        "model.activation_checkpointing=true",
    )
    trainer = Trainer(cfg)
    results: list[dict[str, Any]] = []
    try:
        for step, mixed in enumerate((False, True)):
            trainer.step = step
            rows = fixed_rows(trainer.tokenizer, replay=mixed, seed=step)
            old_lp, _old_ent, metrics = learn_rows(trainer, rows, mixed=mixed)
            state = {k: v.detach().clone() for k, v in full_state_dict(trainer.learner.model).items()}
            results.append({"metrics": metrics, "old_lp": old_lp, "state": state})
        if dist.is_main():
            torch.save({"world": dist.world(), "steps": results}, out_file)
        dist.barrier()  # every rank is done with the collectives before any tears its group down
    finally:
        trainer.close()
        dist.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # Leave without the interpreter's teardown: under load, gloo's threads were seen aborting a
    # process while it was torn down (SIGABRT after the results were written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
