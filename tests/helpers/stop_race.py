"""`python tests/helpers/stop_race.py ORDER`: the training command's stop path under a real teardown race.

Training is replaced by a data loader with one worker (so torch's SIGCHLD handler is installed); the worker is
stopped by SIGTERM and this process gets SIGTERM too, as when a launcher stops a failed run. Both signals are held
back (blocked in every thread) until their handlers are meant to run, so the order is the same on every run:

- `sigterm_first`: both are released at once; Python runs the SIGTERM handler first (the lower number), then
  torch's SIGCHLD handler, which reports the dead worker;
- `worker_first`: torch's handler reports the dead worker first; SIGTERM is released while the run decides what
  its line says.
"""

import signal
import sys

# Before any thread exists, so that every thread inherits the mask and neither signal is handled before its time.
HELD = {signal.SIGTERM, signal.SIGCHLD}
signal.pthread_sigmask(signal.SIG_BLOCK, HELD)

import os  # noqa: E402
import subprocess  # noqa: E402

import torch  # noqa: E402

from adaptive_ds import distributed  # noqa: E402
from adaptive_ds.training import __main__ as entry  # noqa: E402


def _release_in_worker(worker_id: int) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)  # the worker must die of the SIGTERM it is sent


def _stop_a_worker() -> None:
    """Start a loader worker, SIGTERM it and wait until it is dead (not reaped: torch's handler looks for it)."""
    batches = iter(torch.utils.data.DataLoader(range(8), num_workers=1, worker_init_fn=_release_in_worker))
    next(batches)
    worker = batches._workers[0].pid
    # from another process, as a launcher does: a worker that gets SIGTERM from its parent exits quietly
    subprocess.run([sys.executable, "-c", f"import os; os.kill({worker}, {signal.SIGTERM.value})"], check=True)
    os.waitid(os.P_PID, worker, os.WEXITED | os.WNOWAIT)
    _stop_a_worker.batches = batches  # alive until the process ends, as the run's loader would be
    os.kill(os.getpid(), signal.SIGTERM)  # pending: blocked in every thread


def _sigterm_first(argv, process_started, hooks, progress) -> None:
    _stop_a_worker()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
    raise AssertionError("the signals did not stop the run")


def _worker_first(argv, process_started, hooks, progress) -> None:
    _stop_a_worker()
    lost_contact = distributed.lost_contact

    def sigterm_arrives(error):  # the stop path asks what the error means: SIGTERM arrives now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        return lost_contact(error)

    distributed.lost_contact = sigterm_arrives
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    raise AssertionError("the dead worker was not reported")


if __name__ == "__main__":
    entry.train = {"sigterm_first": _sigterm_first, "worker_first": _worker_first}[sys.argv[1]]
    entry.main(["--ds_config", "debug_cpu.json"])  # arguments that pass main's checks; `train` is replaced
