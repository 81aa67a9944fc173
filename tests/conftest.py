import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from adaptive_ds.distributed import DISTRIBUTED_VARIABLES, use_this_environments_ninja
from adaptive_ds.models import AdaptiveDSConfig

ROOT = Path(__file__).resolve().parents[1]

# The environment's ninja for every JIT build in this process too (the test helpers' own extensions are built before
# any process group exists), as adaptive_ds does at init_distributed; run_command passes the PATH on.
use_this_environments_ninja()

# One disk cache of derived corpus figures for the whole session and its subprocesses (adaptive_ds/data/
# disk_cache.py): hermetic (not the user's ~/.cache), yet each figure is computed once, not once per process.
_SESSION_CACHE = None
if "ADAPTIVE_DS_CACHE" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="adaptive_ds-test-cache-")
    os.environ["ADAPTIVE_DS_CACHE"] = _SESSION_CACHE
DEBUG_CPU = str(ROOT / "ds_configs" / "debug_cpu.json")


def tiny_config(arch: str, **overrides) -> AdaptiveDSConfig:
    fields = dict(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
                  num_experts_per_tok=2, mod_capacity=0.5, mod_layer_interval=1, moe_drop_tokens=False,
                  eos_token_id=1, pad_token_id=0)
    fields.update(overrides)
    return AdaptiveDSConfig(**fields)


def write_ds_config(directory: Path, micro: int = 2, accum: int = 1, zero_stage: int = 1, **block) -> str:
    """A tiny CPU training config (fp32, torch AdamW, preset debug) in `directory`; `block` adds to or overrides
    its ``adaptive_ds`` block. Each call writes a new file, so a test can hold several."""
    config = {
        "adaptive_ds": {"preset": "debug", "max_steps": 4, "warmup_steps": 1, "log_steps": 1, "eval_batches": 1,
                        **block},
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "zero_optimization": {"stage": zero_stage}, "steps_per_print": 10**6,
    }
    path = Path(directory) / f"ds{len(list(Path(directory).glob('ds*.json')))}.json"
    path.write_text(json.dumps(config))
    return str(path)




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Where each launcher takes its rendezvous port; all default to 29500, which concurrent tests (pytest -n) share.
_PORT_FLAGS = {("torchrun",): "--master_port", ("deepspeed",): "--master_port",
               ("accelerate", "launch"): "--main_process_port"}


def with_free_port(args: list[str]) -> list[str]:
    """`args` with a free rendezvous port for its launcher, unless it names one already."""
    for launcher, flag in _PORT_FLAGS.items():
        n = len(launcher)
        if tuple(args[:n]) == launcher and flag not in args:
            return [*args[:n], flag, str(free_port()), *args[n:]]
    return list(args)


def run_command(args: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run a command from the repository root with the test's Python first on PATH (and a launcher on a port
    of its own)."""
    args = with_free_port(args)
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    full_env = {**inherited, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(args, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


# Under pytest -n, each worker (and each process it starts) gets its share of the cores, not all of them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)  # the same count in this process and its subprocesses


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    # The long multi-process runs first (a stable sort keeps each group's order): under pytest -n the workers
    # start on them together and share out the short tests at the end, instead of waiting on a long one last.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
