"""`python -m exgrpo_trainer --config FILE [key=value ...]` (also under `torchrun -m exgrpo_trainer`)."""

import sys

from exgrpo_trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
