"""`python -m adaptive_ds.training --ds_config F ...`: one training run; bad input exits with one line."""

from __future__ import annotations

import sys

from .. import distributed
from .arguments import ConfigError
from .checkpoint import CheckpointError
from .controller import TrainingStopped
from .loop import train


def main(argv: list[str] | None = None) -> None:
    try:
        train(sys.argv[1:] if argv is None else argv)
        distributed.close()
    except (ConfigError, CheckpointError, TrainingStopped) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
