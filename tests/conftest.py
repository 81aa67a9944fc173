import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptive_ds.models import AdaptiveDSConfig

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CPU = str(ROOT / "ds_configs" / "debug_cpu.json")


def tiny_config(arch: str, **overrides) -> AdaptiveDSConfig:
    fields = dict(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
                  num_experts_per_tok=2, mod_capacity=0.5, mod_layer_interval=1, moe_drop_tokens=False,
                  eos_token_id=1, pad_token_id=0)
    fields.update(overrides)
    return AdaptiveDSConfig(**fields)


# Set in this process by in-process runs (a world of one); a child must start its own process group.
DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_command(args: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run a command from the repository root with the test's Python first on PATH."""
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    full_env = {**inherited, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(args, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
