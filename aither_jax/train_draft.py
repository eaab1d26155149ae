"""`python -m aither_jax.train_draft`: trains a DFlash draft for a target model (the trainer lives
in aither_jax/speculative/train/)."""

import sys

from aither_jax.cli_output import run_command
from aither_jax.speculative.train.run import main

if __name__ == "__main__":
    sys.exit(run_command(main))
