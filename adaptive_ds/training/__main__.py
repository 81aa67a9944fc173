"""`python -m adaptive_ds.training --ds_config F ...`: one training run; bad input exits with one line.

A run that loses one of its processes also ends with one line (never a hang): a peer that died fails the next
collective (gloo: its closed connection), a hung one the collective timeout (`collective_timeout_s`), and
torchrun's agent stops the survivors with SIGTERM. The same command then resumes from the last complete checkpoint.
A rendezvous port that another run holds ends it with one line too, naming the launcher's option for another port.
SIGTERM or SIGINT during training saves the run at the next step boundary first (`stop.py`); it exits with 128 + the
signal's number and a line that says the same command resumes it.

The command line and the ds_config are checked before torch and DeepSpeed are imported (`arguments.preflight`), so
that a misspelt flag or arch, or a missing or broken ds_config, answers in a second, not after ten of imports: this
module imports the modules that import them (the loop, `distributed`, the checkpoints) in the functions that use
them, which run once the arguments have passed.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import signal
import sys
import time
from typing import NoReturn

import psutil

from .arguments import ConfigError, preflight
from .controller import TrainingStopped
from .launcher_watch import LauncherWatch


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no library's `except Exception` eats it."""


def _on_sigterm(progress, signum, frame) -> None:
    # kept: a handler that runs inside a __del__ or a weakref callback raises in vain
    progress.signalled, progress.signalled_at = signum, time.monotonic()
    _stop_signals()  # one line, even when the launcher sends it again or a loader worker dies with us
    raise Terminated


def _ignore(signum, frame) -> None:
    """SIGTERM's and SIGCHLD's handler once the run is stopping."""


def _stop_signals() -> None:
    """From here on no signal can replace the run's one line with a traceback, or cut it short.

    A launcher stops a failed run by signalling every process, loader workers included, so SIGTERM and a worker's
    SIGCHLD arrive together, and Python runs their handlers one after the other: torch's SIGCHLD handler (it raises
    "DataLoader worker ... is killed by signal") would fire inside our stop path for SIGTERM, or our SIGTERM handler
    inside the stop path for a dead worker. A Python no-op replaces both rather than SIG_IGN: a signal that arrived
    before the change still calls the handler set now, and finding SIG_IGN, Python prints "Signal N ignored due to
    race condition". (Blocking them with pthread_sigmask would not do: it holds them off this thread only, and
    torch's and gloo's threads would take them.)
    """
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, _ignore)


def _stopped(what: str, progress) -> str:
    """The one line: what stopped the run, where (`progress`: stop.Progress, which the run kept up to date), and how
    to continue."""
    where = f"at step {progress.step}" if progress.step is not None else "before training began"
    to = (f"resume from checkpoint {progress.checkpoint}" if progress.checkpoint
          else "start again (no checkpoint was saved yet)")
    return f"error: {what} {where}; {progress.rerun} to {to}"


def main(argv: list[str] | None = None, hooks=None) -> None:
    """`hooks`: test-only fault injection (tests/helpers/train_with_faults.py); None in every real run."""
    argv = sys.argv[1:] if argv is None else argv
    # the launcher gone: stop as on SIGTERM (save, then exit), never train on alone; watched from before the imports
    watch = LauncherWatch().start()
    try:
        preflight(argv, int(os.environ.get("WORLD_SIZE", "1")))  # nothing has imported torch yet
    except ConfigError as error:
        _end(f"error: {error}", 1)
    gc.disable()  # until the libraries have loaded (_libraries_loaded)
    from .. import distributed
    from .stop import Progress, StopRequested

    progress = Progress()  # the run keeps it up to date, for the one line if a process is lost
    # torchrun's agent sends it to the survivors when a worker dies
    signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, progress))
    try:
        # interpreter start-up and imports are part of the run's setup time
        train(argv, process_started=psutil.Process().create_time(), hooks=hooks, progress=progress)
        distributed.close()
        return
    except BaseException as error:
        stop = error
    finally:
        watch.stop()
    # Stopping. A signal already on its way can still raise once while the handlers change (Python runs a pending
    # handler as a function starts, and in signal.signal): it tells nothing new, so the change is just retried.
    while True:
        try:
            _stop_signals()
            break
        except (Terminated, RuntimeError):
            continue
    if isinstance(stop, StopRequested):  # stopped as asked, and saved: the exit status a signal gives
        _end(stop.line, 128 + stop.signum)
    line = _one_line(stop, progress)
    if line is None:
        raise stop
    _end(line, 1)


def train(argv: list[str], process_started: float, hooks=None, progress=None) -> None:
    """The run (training/loop.py), imported once `main` has checked its arguments."""
    from .loop import train as run

    _libraries_loaded()
    if progress is not None and progress.signalled is not None:
        raise Terminated  # it arrived during the imports, and the exception it raised was lost (_on_sigterm)
    run(argv, process_started=process_started, hooks=hooks, progress=progress)


def _libraries_loaded() -> None:
    """The garbage collector back on, with what the imports made left out of its work for good.

    torch, transformers and DeepSpeed leave about 400,000 long-lived objects. Collecting while they load, CPython
    ran a full collection each time the old generation grew by a quarter, about a second of CPU in every process of
    every run (7 of them); afterwards each full collection, CPython's own and DeepSpeed's explicit gc.collect() (its
    optimizers' set-up, its checkpoints), would scan them all again, about 0.3 s each. The modules live as long as
    the process, so freezing them (gc.freeze: the permanent generation) loses nothing; the few hundred cycles the
    imports leave behind are kept with them."""
    gc.freeze()
    gc.enable()


def _end(line: str, status: int) -> NoReturn:
    """Exit with `status` after writing `line` in one write: every rank ends with its line on the launcher's shared
    stderr, and print() or sys.exit(line) write the text and its newline apart, so two ranks' lines could run
    together ("...step 4error: ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    raise SystemExit(status)


def _one_line(error: BaseException, progress) -> str | None:
    """The line a run that stopped with `error` ends with (`progress`: where it was); None for an error that is a
    defect (its traceback)."""
    from .. import distributed  # imported before SIGTERM's handler was set: whole

    if isinstance(error, Terminated):
        return _stopped("stopped by SIGTERM (a launcher stops every process when one fails)", progress)
    # Only a class already loaded: a stop can interrupt an import (SIGTERM while the loop's libraries load), and
    # importing more now would meet the half-initialised module and raise in place of the line. An error of a class
    # whose module never loaded cannot have been raised.
    checkpoint = sys.modules.get("adaptive_ds.ds_checkpoint")
    known = (ConfigError, TrainingStopped, distributed.PortInUse, distributed.UnreachableAddress,
             *([checkpoint.CheckpointError] if hasattr(checkpoint, "CheckpointError") else []))
    if isinstance(error, known):
        return f"error: {error}"
    what = _lost_a_process(error) if isinstance(error, RuntimeError) else None
    return None if what is None else _stopped(what, progress)


# torch's words for a loader worker that died (torch/utils/data: by a signal, or noticed by the main process)
_DATA_WORKER_LOST = re.compile(
    r"DataLoader worker \(pid(?:\(s\))? [^)]*\) (?:is killed by signal: (?P<signal>[^.]+)|exited unexpectedly)")


def _lost_a_process(error: RuntimeError) -> str | None:
    """What the one line says for an error that means a process of the run is gone; None for any other error.

    A data loader worker can be the first to go: torchrun stops a failed run by signalling whole process groups,
    so a survivor's loader worker may receive SIGTERM before the survivor does, and torch then raises
    "DataLoader worker (pid N) is killed by signal: Terminated" wherever the main process is.
    """
    from .. import distributed

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
