"""Adding an architecture touches models/ and presets.py only: a toy one (the dense decoder with a GELU MLP instead
of SwiGLU) is added to a copy of the package by editing those alone, then trained through the copy's unchanged
training/ and saved as a final/ folder that loads, with its toy MLP, where the package cannot be imported."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from helpers.common import DEBUG_CPU, ROOT

TOY_MODULE = '''\
"""The toy architecture's MLP: down(gelu(up(x))), without SwiGLU's gate."""

import torch.nn.functional as F
from torch import nn


class GELUMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.down_proj(F.gelu(self.up_proj(hidden_states)))


def gelu_mlp_parameters(config) -> int:
    return 2 * config.hidden_size * config.intermediate_size
'''

TOY_SPEC = '''
from .toy import GELUMLP, gelu_mlp_parameters  # noqa: E402

register_architecture(ArchitectureSpec("toy", "dense with a GELU MLP", mlp=GELUMLP,
                                       mlp_parameters=gelu_mlp_parameters))
'''

TOY_VARIANT = 'VARIANTS["toy"] = ArchVariant("toy", about="dense with a GELU MLP")\n'
VARIANTS_END = "\nARCHITECTURES = tuple("  # presets.py: the line after the table of variants


def _digests(package) -> dict[str, str]:
    """Each file of the package outside models/ and presets.py, by content."""
    return {path.relative_to(package).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(package.rglob("*")) if path.is_file() and "__pycache__" not in path.parts
            and path.relative_to(package).parts[0] != "models" and path.name != "presets.py"}


def _add_the_toy_architecture(package) -> None:
    """The whole change: a module with its MLP, its spec registered, its variant named."""
    (package / "models" / "toy.py").write_text(TOY_MODULE)
    with open(package / "models" / "architectures.py", "a") as f:
        f.write(TOY_SPEC)
    presets = (package / "presets.py").read_text()
    assert presets.count(VARIANTS_END) == 1
    (package / "presets.py").write_text(presets.replace(VARIANTS_END, "\n" + TOY_VARIANT + VARIANTS_END[1:]))


@pytest.mark.slow
def test_a_toy_architecture_added_in_models_and_presets_trains_through_the_unchanged_trainer(tmp_path):
    package = tmp_path / "adaptive_ds"
    shutil.copytree(ROOT / "adaptive_ds", package, ignore=shutil.ignore_patterns("__pycache__"))
    before = _digests(package)
    _add_the_toy_architecture(package)
    assert _digests(package) == before  # training/, tools/, export/, ... unchanged

    out = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT")},
           "PYTHONPATH": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    # from the copy's folder, so that `-m` finds the copy (the working directory comes first on the path)
    run = subprocess.run([sys.executable, "-m", "adaptive_ds.training", "--ds_config", DEBUG_CPU, "--arch", "toy",
                          "--max_steps", "8", "--log_steps", "1", "--warmup_steps", "2", "--eval_batches", "1",
                          "--output_dir", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses  # from about ln(vocab): it learns
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arch"] == "toy" and math.isfinite(summary["validation_loss"])
    assert (out / "final" / "toy.py").is_file()  # the copy's model code, toy MLP included, went with the weights

    # the final/ folder alone, without any adaptive_ds importable: the toy MLP, the counted parameters
    script = (
        "import sys; sys.modules['adaptive_ds'] = None\n"
        "import json, torch; from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out / 'final')!r}, trust_remote_code=True)\n"
        "logits = m(input_ids=torch.tensor([[1, 2, 3]])).logits\n"
        "print(json.dumps({'mlp': [type(layer.mlp).__name__ for layer in m.model.layers], 'arch': m.config.arch,\n"
        "                  'parameters': sum(p.numel() for p in m.parameters()),\n"
        "                  'finite': bool(torch.isfinite(logits).all())}))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "run", env={**env, "PYTHONPATH": ""},
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    found = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert found["mlp"] == ["GELUMLP"] * 4 and found["arch"] == "toy" and found["finite"]
    # presets.parameter_counts read the toy's MLP size from its spec: 2 h f per block, not SwiGLU's 3 h f
    assert summary["total_parameters"] == found["parameters"]
