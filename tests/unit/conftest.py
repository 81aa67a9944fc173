"""Unit tests run in milliseconds against fakes: a test here that starts a process (a subprocess, a loader worker,
a launcher) or builds a DeepSpeed engine fails at that call. Those belong in tests/integration."""

import multiprocessing.process
import subprocess
from datetime import timedelta

import deepspeed
import matplotlib.font_manager  # noqa: F401  (see below)
import pytest
import torch.distributed as dist

from adaptive_ds import distributed

# matplotlib builds its font cache on first import, on a machine where it has none yet, and asks fontconfig
# (`fc-list`, a process) for the system's fonts. That is the environment's one-off set-up, not the code under test
# starting a process: it happens here, before the guard below, so that a report test that draws a figure passes on a
# fresh machine as on one whose cache is warm.


def _refused(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test {what}: it belongs in tests/integration")

    return refuse


def _world_of_one(timeout_s: float | None = None) -> None:
    """`distributed.init_distributed` for a plain start, as torch alone makes it: gloo over an in-process store.
    The package's own collectives are torch's; DeepSpeed's communication layer, which only its engine uses, would
    load its shared-memory op (a ninja process, a compile on first use)."""
    if not dist.is_initialized():
        timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, **timeout)


@pytest.fixture(autouse=True)
def _no_process_and_no_engine(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refused("starts a process"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refused("starts a process"))
    monkeypatch.setattr(deepspeed, "initialize", _refused("builds a DeepSpeed engine"))
    monkeypatch.setattr(distributed, "init_distributed", _world_of_one)
    joined = dist.is_initialized()
    yield
    # The world of one ends with the test that made it: it has none of a launcher's variables, so a later
    # integration test in this worker, finding a group already there, would build its engine without LOCAL_RANK.
    if dist.is_initialized() and not joined:
        dist.destroy_process_group()
