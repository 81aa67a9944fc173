"""`python -m adaptive_ds.training --ds_config F ...`: one training run; bad input exits with one line.

A run that loses one of its processes also ends with one line (never a hang): a peer that died fails the next
collective (gloo: its closed connection), a hung one the collective timeout (`collective_timeout_s`), and
torchrun's agent stops the survivors with SIGTERM. The same command then resumes from the last complete checkpoint.
"""

from __future__ import annotations

import re
import signal
import sys

import psutil

from .. import distributed
from .arguments import ConfigError
from .checkpoint import CheckpointError
from .controller import TrainingStopped
from .loop import train


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no library's `except Exception` eats it."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one line, even when the launcher sends it again
    raise Terminated


def _stopped(what: str) -> str:
    """The one line: what stopped the run, where, and how to continue."""
    progress = distributed.progress
    where = f"at step {progress.step}" if progress.step is not None else "before training began"
    to = (f"resume from checkpoint {progress.checkpoint}" if progress.checkpoint
          else "start again (no checkpoint was saved yet)")
    return f"error: {what} {where}; rerun the same command to {to}"


def main(argv: list[str] | None = None, hooks=None) -> None:
    """`hooks`: test-only fault injection (tests/helpers/train_with_faults.py); None in every real run."""
    signal.signal(signal.SIGTERM, _on_sigterm)  # torchrun's agent sends it to the survivors when a worker dies
    try:
        # interpreter start-up and imports are part of the run's setup time
        train(sys.argv[1:] if argv is None else argv, process_started=psutil.Process().create_time(), hooks=hooks)
        distributed.close()
    except (ConfigError, CheckpointError, TrainingStopped) as error:
        sys.exit(f"error: {error}")
    except Terminated:
        sys.exit(_stopped("stopped by SIGTERM (a launcher stops every process when one fails)"))
    except RuntimeError as error:
        what = _lost_a_process(error)
        if what is None:
            raise
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's SIGTERM would cut this line short
        sys.exit(_stopped(what))


# torch's words for a loader worker that died (torch/utils/data: by a signal, or noticed by the main process)
_DATA_WORKER_LOST = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? [^)]*\) (?:is killed by signal: (?P<signal>[^.]+)|exited unexpectedly)")


def _lost_a_process(error: RuntimeError) -> str | None:
    """What the one line says for an error that means a process of the run is gone; None for any other error.

    A data loader worker can be the first to go: torchrun stops a failed run by signalling whole process groups,
    so a survivor's loader worker may receive SIGTERM before the survivor does, and torch then raises
    "DataLoader worker (pid N) is killed by signal: Terminated" wherever the main process is.
    """
    if distributed.lost_contact(error):
        return f"lost contact with another process ({distributed.describe_lost_contact(error)})"
    worker = _DATA_WORKER_LOST.search(str(error))
    if worker is None:
        return None
    if worker.group("signal") == "Terminated":
        return "stopped by SIGTERM (a launcher stops every process when one fails; a data loader worker got it first)"
    # torch's own words, whole: for a bus error they say the workers may be out of shared memory (/dev/shm)
    return f"a data loader worker died ({' '.join(str(error).split())[:300]})"


if __name__ == "__main__":
    main()
