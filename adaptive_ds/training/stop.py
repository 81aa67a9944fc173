"""A stop request during training: SIGTERM (a preemptible machine's notice, a scheduler's) or SIGINT (Ctrl-C) saves
the run instead of losing it, as Megatron's exit-signal handler and Lightning's SLURM requeue do.

While the training loop runs, the signal only marks the request. At each step boundary every rank offers its mark
to the others through a non-blocking all-reduce (started at one boundary, read at the next: no rank waits on it,
and no host synchronisation of the device), so the ranks agree to stop at the same boundary, at most two steps
after the signal reached any of them (a signal during the last step: once more after it, `settle`). The run then
saves a checkpoint there, if the grace period since the signal has not passed and the weights are healthy, and ends
with a line that says the same command resumes it.

Within the grace period a further signal only marks again: one request often arrives twice (Ctrl-C reaches the
workers from the terminal, and deepspeed's launcher then sends them SIGTERM too; a preemption notice may be repeated).
Once the grace period has passed, a further signal stops at once, as before the loop: the handler that was there
before takes it.

When a peer is gone (a launcher tearing a failed run down), the all-reduce fails like any collective, and the run
ends with its lost-contact line without waiting.

When the launcher is gone (launcher_watch.py), each process sends itself SIGTERM, which this request takes like any.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import distributed

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Progress:
    """Where this process is, for the one line it prints when it has to stop (a lost peer, SIGTERM). Whoever starts
    the run holds it (`__main__`) and hands it to the run: the loop sets the step, the checkpointer the checkpoint
    and how the line says to continue."""

    step: int | None = None  # the step being trained
    checkpoint: str | None = None  # the newest complete checkpoint this process saved or resumes from
    # how the line says to continue: the same command, or, where the run chose its own time-stamped output
    # directory, the same command naming that directory (a plain rerun would start another run)
    rerun: str = "rerun the same command"
    # the signal the command's handler took before the loop's (`__main__`): Python runs a handler wherever the
    # process is, and where that is a __del__ or a weakref callback, the exception the handler raises is printed
    # ("Exception ignored") and lost; the loop's StopRequest takes the signal up from here
    signalled: int | None = None
    signalled_at: float | None = None  # when (monotonic seconds): the grace period counts from there


class StopRequested(Exception):
    """The run stopped on a signal, as asked: `line` says where and how it resumes; exit with 128 + `signum`."""

    def __init__(self, line: str, signum: int):
        super().__init__(line)
        self.line, self.signum = line, signum


class StopRequest:
    """Installs the marking handlers for SIGTERM and SIGINT while the training loop runs (`with StopRequest(...)`),
    and answers, at each step boundary, whether every rank has agreed to stop (`agreed`)."""

    def __init__(self, grace_s: float, timeout_s: float | None = None, signalled: int | None = None,
                 signalled_at: float | None = None):
        """`timeout_s`: the run's collective timeout (`collective_timeout_s`), which bounds the agreement too.
        `signalled`, `signalled_at`: a signal that arrived before the loop began and was not acted on, and when
        (Progress): the run stops at a step boundary (the first, on one process; the ranks agree one boundary
        later), its grace period counted from the signal's arrival."""
        self.grace_s = grace_s
        self.signum: int | None = signalled  # the first signal this process received
        self.received: float | None = signalled_at  # when (monotonic seconds)
        self._previous: dict[int, object] = {}
        self._group = None
        self._offered: torch.Tensor | None = None
        self._work = None
        if distributed.world_size() > 1:
            # a CPU (gloo) group, so that the agreement never waits on the device's stream
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)  # else gloo's default
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)

    def __enter__(self) -> StopRequest:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._mark)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _mark(self, signum: int, frame) -> None:
        # (a rank stopping for a peer's signal has no clock of its own: it is stopping already, so it only marks)
        if self.signum is not None and (self.received is None or time.monotonic() - self.received < self.grace_s):
            logger.info("%s: already stopping at the next step boundary", signal.Signals(signum).name)
            return
        if self.signum is not None:  # past the grace period: stop at once, as the handler before the loop does
            self.__exit__()
            previous = self._previous[signum]
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        self.signum, self.received = signum, time.monotonic()
        logger.warning("%s: the run saves a checkpoint at the next step boundary and stops (a signal after %s s "
                       "stops it at once)", signal.Signals(signum).name, f"{self.grace_s:g}")

    def agreed(self) -> bool:
        """Whether the ranks agree to stop at this boundary: every rank answers the same."""
        if self._group is None and distributed.world_size() == 1:
            return self.signum is not None
        stop = False
        if self._work is not None:
            self._work.wait()  # started a step ago: long done
            stop = bool(self._offered[0] > 0)
        if not stop:
            self._offered = torch.tensor([0 if self.signum is None else self.signum])
            self._work = dist.all_reduce(self._offered, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        elif self.signum is None:  # another rank's signal: this one stops for it
            self.signum = int(self._offered[0])
        return stop

    def settle(self) -> bool:
        """After the last step (collective, once per run): whether any rank was signalled since the last agreement
        was offered. A signal during the last step would otherwise go unheard on two or more ranks, whose agreement
        is read one boundary after it is offered, and there is no next boundary."""
        if self._group is None and distributed.world_size() == 1:
            return self.signum is not None
        if self._work is not None:
            self._work.wait()
            self._work = None
        offered = torch.tensor([max(0 if self.signum is None else self.signum,
                                    0 if self._offered is None else int(self._offered[0]))])
        dist.all_reduce(offered, op=dist.ReduceOp.MAX, group=self._group)
        if offered[0] > 0 and self.signum is None:  # another rank's signal: this one stops for it
            self.signum = int(offered[0])
        return bool(offered[0] > 0)

    def within_grace(self) -> bool:
        """Whether the grace period since the first signal any rank received has not passed (collective: every rank
        gets the same answer, as the save that follows is collective). A cloud that reclaims one machine signals
        its ranks only; the others stop for them, and their own clocks never started."""
        age = None if self.received is None else time.monotonic() - self.received
        ages = [a for a in distributed.all_gather_object(age) if a is not None]
        return not ages or max(ages) <= self.grace_s

