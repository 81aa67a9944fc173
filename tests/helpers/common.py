"""What tests share that is not a fixture: the repository's paths, a tiny model config and a tiny CPU ds_config
(also for module-scoped fixtures, which cannot take the function-scoped ones of conftest.py), and a command runner.

Tests take the fixtures of tests/conftest.py (`tiny_config`, `tiny_ds_config`, `run_command`) where they can.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from adaptive_ds.distributed import DISTRIBUTED_VARIABLES
from adaptive_ds.models import AdaptiveDSConfig

ROOT = Path(__file__).resolve().parents[2]
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


def logged_losses(out: Path) -> dict[int, float]:
    """Each step's loss in a run's metrics.jsonl, which logs each step once."""
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), "each step is logged once"
    return {r["step"]: r["loss"] for r in records}


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
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES
                 and not k.startswith(("SLURM_", "TORCHELASTIC_"))}  # they name a run's directory, its counts
    full_env = {**inherited, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(args, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def ends_within(seconds: int):
    """Fails the test (instead of hanging it) if the block is still running after `seconds`."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# What a script a test runs as a user would takes from the test's environment: where programs, the package, the
# caches and temporary files are (the JIT-built ops and the test run's corpus figures are shared), the locale, the
# GPUs, the thread share of a pytest worker and the Hub's offline switches. Nothing else: a variable of the caller's
# shell (OUT, DS_CONFIG, MASTER_PORT, an example's own ADAPTIVE_DS_OUT, a launcher's RANK) never reaches the script.
SCRIPT_ENVIRONMENT = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH",
                      "TORCH_EXTENSIONS_DIR", "ADAPTIVE_DS_CACHE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                      "CUDA_HOME", "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_OFFLINE",
                      "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def script_env(**extra) -> dict:
    """An environment made from scratch for a script a test runs as a user would: `SCRIPT_ENVIRONMENT` from this
    one, the test's Python first on PATH, unbuffered output, and `extra` (the script's own variables)."""
    env = {k: os.environ[k] for k in SCRIPT_ENVIRONMENT if k in os.environ}
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONUNBUFFERED="1", **extra)
    return env


def output_within(process: subprocess.Popen, timeout: int) -> str:
    """The output of `process` (started with start_new_session=True) once it ends; its whole process group is killed
    and the test fails if it outlives `timeout`."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{output[-3000:]}") from None
    return output


def debug_cpu_config(tmp_path, **changes) -> str:
    """ds_configs/debug_cpu.json written to tmp_path/ds.json with `changes`: top-level keys replaced, and `block`'s
    keys set in its adaptive_ds block."""
    with open(DEBUG_CPU) as f:
        config = json.load(f)
    for key, value in changes.items():
        if key == "block":
            config["adaptive_ds"].update(value)
        else:
            config[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def snapshot(directory) -> dict[str, bytes]:
    """Every file below `directory` (its path relative to it) and its bytes: a test compares two to see that nothing
    was written."""
    return {os.path.relpath(os.path.join(d, f), directory): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(directory) for f in names}


def once_per_run(tmp_path_factory, name: str, compute):
    """`compute(directory)`'s result (JSON-able), worked out by the first pytest worker that asks for it and read by
    every other one: a module-scoped fixture is otherwise computed once per worker that runs a test of its module,
    and a reference run of several processes is the costly kind. xdist's workers share the parent of their base
    temporary folders; without workers the base folder is this run's alone."""
    import filelock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    result = root / f"{name}.json"
    with filelock.FileLock(str(root / f"{name}.lock")):
        if not result.exists():
            directory = root / name
            directory.mkdir(exist_ok=True)
            result.write_text(json.dumps(compute(directory)))
        return json.loads(result.read_text())
