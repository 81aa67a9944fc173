"""`python -m adaptive_ds.training --ds_config F ...`: one training run; bad input exits with one line."""

from __future__ import annotations

import sys

import psutil

from .. import distributed
from .arguments import ConfigError
from .checkpoint import CheckpointError
from .controller import TrainingStopped
from .loop import train


def main(argv: list[str] | None = None, hooks=None) -> None:
    """`hooks`: test-only fault injection (tests/helpers/train_with_faults.py); None in every real run."""
    try:
        # interpreter start-up and imports are part of the run's setup time
        train(sys.argv[1:] if argv is None else argv, process_started=psutil.Process().create_time(), hooks=hooks)
        distributed.close()
    except (ConfigError, CheckpointError, TrainingStopped) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
