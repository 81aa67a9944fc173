"""No orphans: a training process whose launcher is gone stops as on SIGTERM (a stop request: it saves at the next
step boundary, then exits) instead of training on unattended, holding the port, with nothing saved.

The launcher is the `deepspeed`, `torchrun` or `accelerate` process the user started, or one it started in turn:
under `deepspeed` a worker's parent is deepspeed.launcher.launch, whose parent is the runner the user signalled, and a
SIGINT sent to the runner's PID alone kills the runner and leaves launch.py and the workers running. This module
imports no torch: `training/__main__.py` starts the watch before the imports (seconds) in which a launcher could die.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import psutil

logger = logging.getLogger(__name__)


# How a launcher's process shows in its command line: the console scripts, and the modules they run (deepspeed's
# runner starts `python -m deepspeed.launcher.launch`, which starts the workers; accelerate and torchrun host
# torch's elastic agent in their own process).
_LAUNCHER_SCRIPTS = {"deepspeed", "ds", "torchrun", "accelerate"}
_LAUNCHER_MODULES = {"deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                     "torch.distributed.launch", "accelerate.commands.launch", "accelerate.commands.accelerate_cli"}


def is_launcher(cmdline: list[str]) -> bool:
    """Whether a process's command line is one of the launchers that start training processes."""
    if not cmdline:
        return False
    if not os.path.basename(cmdline[0]).startswith("python"):  # a console script started directly
        return os.path.basename(cmdline[0]) in _LAUNCHER_SCRIPTS
    args = _after_interpreter_options(cmdline[1:])
    if args[:1] == ["-m"]:
        return len(args) > 1 and args[1] in _LAUNCHER_MODULES
    return bool(args) and os.path.basename(args[0]) in _LAUNCHER_SCRIPTS


def _after_interpreter_options(args: list[str]) -> list[str]:
    """The arguments of `python [OPTIONS] (-m MODULE | SCRIPT) ...` from `-m` or the script on (-u, -W ARG, -X ARG)."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-m":
        i += 2 if args[i] in ("-W", "-X") else 1
    return args[i:]


def launcher_chain(process: psutil.Process | None = None) -> list[psutil.Process]:
    """This process's launchers, nearest first: its ancestors up to the first that is no launcher (a shell, srun,
    Slurm's step daemon). Under `deepspeed` that is deepspeed.launcher.launch and the runner the user started."""
    chain, parent = [], (process or psutil.Process()).parent()
    while parent is not None:
        try:
            if not is_launcher(parent.cmdline()):
                break
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            break
        chain.append(parent)
        parent = parent.parent()
    return chain


class LauncherWatch:
    """Sends this process SIGTERM when one of its launchers is gone (killed, or dead of a signal sent to it alone).

    A daemon thread checks every `poll_s` seconds, so the stop is requested within `poll_s` of the launcher's end;
    psutil's `is_running` compares start times, so a reused PID does not pass for the launcher. A process that
    no launcher started (a plain `python` start, whose parent is a shell) watches nothing. Before the training loop
    SIGTERM ends the process with its one line; in the loop it is a stop request (stop.py).
    """

    def __init__(self, poll_s: float = 1.0, chain: list[psutil.Process] | None = None):
        self.poll_s = poll_s
        self.chain = launcher_chain() if chain is None else chain
        self.gone: psutil.Process | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        if self.chain:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            gone = next((p for p in self.chain if not _alive(p)), None)
            if gone is not None:
                self.gone = gone
                logger.warning("the launcher (PID %d) is gone; stopping as on SIGTERM", gone.pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return


def _alive(process: psutil.Process) -> bool:
    """Running, and not a zombie: a launcher that died stays in the process table until its parent reaps it."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
