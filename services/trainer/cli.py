"""Command line of the trainer, `python -m exgrpo_trainer --config FILE [key=value ...]`: train in
one process or under torchrun (`exgrpo train` uses the same functions).

    python -m exgrpo_trainer --config exgrpo model.path=models/m run.pool=math
    torchrun --standalone --nproc_per_node=8 -m exgrpo_trainer --config run.yaml optim.lr=2e-6

`--config` takes a YAML file or the name of a shipped recipe (exgrpo, grpo). Rank 0 prints the
validated settings before training. A bad setting prints one line naming it and exits with status 1.
A run that another trainer owns (refused at start, or taken over while training) and a checkpoint
folder of another run print one line and exit with status 3; `--takeover` (run.takeover=true) takes
the run from a live trainer.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from pydantic import ValidationError

from exgrpo_client.logs import LOG_FORMAT_ENV, LOG_FORMATS, configure_logging, fields, resolve_format
from exgrpo_trainer.config import TrainConfig, format_config_error, load_config, recipes

log = logging.getLogger("exgrpo.trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m exgrpo_trainer",
        description="Train a policy with ExGRPO against an experience pool service.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"YAML settings, or a shipped recipe name ({', '.join(recipes())}).",
    )
    parser.add_argument(
        "--takeover",
        action="store_true",
        help="Take the run over from the trainer that owns it (run.takeover=true); that one stops.",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help=f"Log lines as JSON objects or plain text (default: ${LOG_FORMAT_ENV}, else plain).",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="Settings that replace the file's, e.g. optim.lr=2e-6 experience.enabled=false.",
    )
    return parser.parse_args(argv)


def read_config(config: str | None, overrides: list[str]) -> TrainConfig:
    """The validated settings; a readable one-line `SystemExit` for every expected mistake."""
    try:
        return load_config(config, overrides)
    except ValidationError as e:
        raise SystemExit(f"error: {format_config_error(e)}") from None
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None


def run(cfg: TrainConfig, log_format: str | None = None) -> None:
    """Log set-up (`log_format`, else $EXGRPO_LOG_FORMAT, else plain), the settings (rank 0: YAML on
    stdout, or one log record in json), training, and leaving the process group."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        fmt = resolve_format(log_format, "plain")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    configure_logging(
        fmt, logging.INFO if rank == 0 else logging.WARNING, static={"rank": rank} if ranks > 1 else None
    )
    if rank == 0 and fmt == "json":
        log.info("trainer settings", extra=fields(settings=cfg.public_dict()))
    elif rank == 0:
        sys.stdout.write("# exgrpo trainer settings\n" + cfg.to_yaml())
        sys.stdout.flush()

    from exgrpo_trainer import dist
    from exgrpo_trainer.checkpoint import CheckpointOwnerError
    from exgrpo_trainer.ownership import EXIT_STATUS, RunOwnershipError
    from exgrpo_trainer.trainer import run_training

    try:
        run_training(cfg)
    except (RunOwnershipError, CheckpointOwnerError) as e:
        if rank == 0 and fmt == "json":
            log.error(" ".join(str(e).split()))
        elif rank == 0:
            sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        raise SystemExit(EXIT_STATUS) from None
    finally:
        dist.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = read_config(args.config, [*args.overrides, *(["run.takeover=true"] if args.takeover else [])])
    run(cfg, args.log_format)
    return 0


def main_process(argv: list[str] | None = None) -> NoReturn:
    """`main` as the whole process (`python -m exgrpo_trainer`). A rank of a torchrun run that
    returns or exits (a setting refused, a run owned by another trainer) leaves without the
    interpreter's teardown, once its logs and output are flushed: after a finished two-rank run
    on CPU, a rank sometimes aborted in that teardown, past its last Python frame ("terminate
    called without an active exception", status -6, ~1 run in 13 under load), and torchrun then
    failed the whole run. Its training, checkpoint and process group are closed by then (`run`).
    An unexpected exception still goes through the interpreter, its traceback printed as usual."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(main(argv))
    try:
        code: object = main(argv)
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # SystemExit("message"): printed, status 1, as Python does
        sys.stderr.write(f"{code}\n")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
