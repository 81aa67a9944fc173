"""`python tests/helpers/train_with_restart_faults.py FAULT STEP RANK --ds_config ...`: the training command with one
real fault in torchrun's first round only (TORCHELASTIC_RESTART_COUNT 0), so that the round the agent restarts
trains on undisturbed: before step STEP, the process of rank RANK

- `kill`: is killed with SIGKILL;
- `raise`: raises an error that is a defect (its traceback, exit status 1);
- `data_worker`: kills its DataLoader worker with SIGKILL (torch then raises in the training process).
"""

import os
import signal
import sys

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, as under pytest

from adaptive_ds import distributed  # noqa: E402
from adaptive_ds.training.__main__ import main  # noqa: E402
from adaptive_ds.training.loop import TrainerHooks  # noqa: E402

FAULTS = ("kill", "raise", "data_worker")


class InjectedDefect(RuntimeError):
    """An error no handler knows: the run ends with its traceback, as a bug would end it."""


class FirstRoundFault(TrainerHooks):
    def __init__(self, fault: str, step: int, rank: int):
        assert fault in FAULTS, fault
        self.fault, self.step, self.rank = fault, step, rank

    def before_step(self, trainer, step: int) -> None:
        if step != self.step or distributed.rank() != self.rank:
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "raise":
            raise InjectedDefect(f"injected before step {step}")
        workers = psutil.Process().children()  # the DataLoader's worker processes (data_workers >= 1)
        assert workers, "the run has no DataLoader worker to kill"
        os.kill(workers[0].pid, signal.SIGKILL)


if __name__ == "__main__":
    fault, step, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    main(sys.argv[4:], hooks=FirstRoundFault(fault, step, rank))
