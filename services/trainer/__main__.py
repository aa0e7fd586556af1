"""`python -m exgrpo_trainer --config FILE [key=value ...]` (also under `torchrun -m exgrpo_trainer`)."""

from exgrpo_trainer.cli import main_process

if __name__ == "__main__":
    main_process()
