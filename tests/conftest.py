"""The test run's shared set-up and fixtures. tests/unit runs in milliseconds against fakes (no process started, no
DeepSpeed engine: tests/unit/conftest.py refuses both); tests/integration runs the real engine, subprocesses,
2-process runs and faults. What tests share that is not a fixture is in tests/helpers/common.py."""

import gc
import logging
import os
import shutil
import signal
import tempfile
from functools import partial

import pytest
import torch
from helpers import common
from helpers.worksteal import worksteal_order

from adaptive_ds.distributed import use_this_environments_ninja

# The environment's ninja for every JIT build in this process too (the test helpers' own extensions are built before
# any process group exists), as adaptive_ds does at init_distributed; run_command passes the PATH on.
use_this_environments_ninja()

# One disk cache of derived corpus figures for the whole session and its subprocesses (adaptive_ds/data/
# disk_cache.py): hermetic (not the user's ~/.cache), yet each figure is computed once, not once per process.
_SESSION_CACHE = None
if "ADAPTIVE_DS_CACHE" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="adaptive_ds-test-cache-")
    os.environ["ADAPTIVE_DS_CACHE"] = _SESSION_CACHE

# Under pytest -n, each worker (and each process it starts) gets its share of the cores, not all of them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)  # the same count in this process and its subprocesses


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


_PROCESS_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGALRM)


@pytest.fixture(autouse=True)
def _signal_handlers():
    """Each test leaves the process's signal handlers as it found them, whatever it ran in-process (the training
    command installs its own) and however it ended: a handler left behind changes how every later test's child
    processes die."""
    handlers = {signum: signal.getsignal(signum) for signum in _PROCESS_SIGNALS}
    yield
    for signum, handler in handlers.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def _functional_linear():
    """Each test leaves `torch.nn.functional.linear` as it found it: DeepSpeed's ZeRO-3 `zero.Init` replaces it for
    the rest of the process with its own autograd.Function (deliberately: "this will persist unless manually reset"),
    so one in-process ZeRO-3 test would change what every later test in that worker multiplies with (and what
    torch.compile traces: its backward reads ZeRO-3's per-parameter status, which a plain parameter lacks)."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


@pytest.fixture(autouse=True)
def _adaptive_ds_logging():
    """Each test leaves the `adaptive_ds` logger as it found it: a run in the test's process replaces its handler with
    one on the stderr of that moment, which under capsys or capfd is a capture that closes with the test; a later
    test's message would go to it ("--- Logging error ---")."""
    logger = logging.getLogger("adaptive_ds")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture
def tiny_config():
    """A tiny model config of an architecture: `tiny_config("moe", num_local_experts=8)`."""
    return common.tiny_config


@pytest.fixture
def tiny_ds_config(tmp_path):
    """A tiny CPU ds_config written into the test's tmp_path: `tiny_ds_config(micro=2, accum=1, zero_stage=1,
    **adaptive_ds_block)` returns its path; each call writes a new file."""
    return partial(common.write_ds_config, tmp_path)


@pytest.fixture
def run_command():
    """Runs a command from the repository root: `run_command([...], timeout=600, **env)`."""
    return common.run_command


def pytest_collection_modifyitems(config, items):
    # The long multi-process runs first in each worker's share of the collection, then the other integration tests,
    # the unit tests last (worksteal_order): under pytest -n the workers start on the long ones together and share
    # out the short ones at the end, instead of waiting on a long one last. Every worker collects the same order (a
    # function of the items and the worker count).
    tiers = [0 if "slow" in item.keywords else 1 if "integration" in item.path.parts else 2 for item in items]
    items[:] = worksteal_order(items, tiers, _WORKERS)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish():
    """What a worker holds once it has collected (torch, transformers, DeepSpeed, every test module: about a million
    objects) is left out of the garbage collector's work from here on, as the training command does after its
    imports (training/__main__.py): DeepSpeed's explicit gc.collect() calls (its bf16 optimizer makes two per
    parameter group) and CPython's full collections would otherwise scan all of it each time, 0.35 s a collection."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
