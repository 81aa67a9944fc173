"""Adding an architecture touches models/ and presets.py only: a toy one (MoD routing around a GELU MLP instead of
SwiGLU, measured against the same GELU decoder with every block on every token) is added to a copy of the package by
editing those alone, then trained through the copy's unchanged training/ and saved as a final/ folder that loads, with
its toy MLP, where the package cannot be imported.

The toy differs from the built-in architectures in what the trainer computes from its spec: the FLOPs reduction it
logs is measured against the toy's own unrouted architecture, with the toy's own MLP counted, so a trainer that
knew the architectures by kind (its unrouted baseline the SwiGLU dense model) logs another number."""

import filecmp
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from helpers.common import DEBUG_CPU, ROOT

# the MLP of its own the unit tests register too: a module that imports torch only, as models/ files must
TOY_MODULE = (ROOT / "tests" / "helpers" / "own_mlp.py").read_text()

TOY_SPEC = '''
from .toy import GELUMLP, own_mlp_parameters  # noqa: E402

register_architecture(ArchitectureSpec("gelu", "dense with a GELU MLP", mlp=GELUMLP,
                                       mlp_parameters=own_mlp_parameters))
register_architecture(ArchitectureSpec("toy", "MoD routing around a GELU MLP", mod=True, mlp=GELUMLP,
                                       mlp_parameters=own_mlp_parameters, unrouted="gelu"))
'''

TOY_VARIANTS = ('VARIANTS["gelu"] = ArchVariant("gelu", about="dense with a GELU MLP")\n'
                'VARIANTS["toy"] = ArchVariant("toy", about="MoD routing around a GELU MLP")\n')
VARIANTS_END = "\nARCHITECTURES = tuple("  # presets.py: the line after the table of variants


def _changed(package, original) -> set[str]:
    """The files of `package` that are not in `original`, or differ from its, and the files it lacks."""
    def files(root):
        return {path.relative_to(root).as_posix() for path in root.rglob("*")
                if path.is_file() and "__pycache__" not in path.parts}
    ours, theirs = files(package), files(original)
    return (ours ^ theirs) | {name for name in ours & theirs
                              if not filecmp.cmp(package / name, original / name, shallow=False)}


def _add_the_toy_architecture(package) -> None:
    """The whole change: a module with its MLP, its spec registered, its variant named."""
    (package / "models" / "toy.py").write_text(TOY_MODULE)
    with open(package / "models" / "architectures.py", "a") as f:
        f.write(TOY_SPEC)
    presets = (package / "presets.py").read_text()
    assert presets.count(VARIANTS_END) == 1
    (package / "presets.py").write_text(presets.replace(VARIANTS_END, "\n" + TOY_VARIANTS + VARIANTS_END[1:]))


@pytest.mark.slow
def test_a_toy_architecture_added_in_models_and_presets_trains_through_the_unchanged_trainer(tmp_path):
    package = tmp_path / "adaptive_ds"
    shutil.copytree(ROOT / "adaptive_ds", package, ignore=shutil.ignore_patterns("__pycache__"))
    _add_the_toy_architecture(package)
    # the copy is the repository's package but for the toy's module and the two tables: training/, tools/, export/
    # and every other module unchanged
    assert _changed(package, ROOT / "adaptive_ds") == {"models/toy.py", "models/architectures.py", "presets.py"}

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
    _assert_the_logged_mod_statistics(out)
    assert (out / "final" / "toy.py").is_file()  # the copy's model code, toy MLP included, went with the weights

    # the final/ folder alone, without any adaptive_ds importable: the toy MLP, the counted parameters
    script = (
        "import sys; sys.modules['adaptive_ds'] = None\n"
        "import json, torch; from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out / 'final')!r}, trust_remote_code=True)\n"
        "logits = m(input_ids=torch.tensor([[1, 2, 3]])).logits\n"
        "blocks = [getattr(layer, 'block', layer) for layer in m.model.layers]  # a MoD block wraps the layer\n"
        "print(json.dumps({'mlp': [type(block.mlp).__name__ for block in blocks], 'arch': m.config.arch,\n"
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


def _toy_flops(config: dict, routed: float) -> float:
    """Training FLOPs of one token, counted here from the toy's dimensions (6 per matmul parameter of the tokens a
    block runs, 12 h S r^2 for attention's scores over a sequence of S positions, the LM head on every token): each
    block's attention and GELU MLP, and each MoD block's router on every token, its block on the `routed` share."""
    h, f, seq = config["hidden_size"], config["intermediate_size"], config["max_position_embeddings"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    block = 2 * h * h + 2 * h * kv + 2 * h * f  # q, o; k, v; the GELU MLP's up and down projections (no gate)
    flops = 6.0 * config["vocab_size"] * h
    for layer in range(config["num_hidden_layers"]):
        if routed < 1 and (layer + 1) % config["mod_layer_interval"] == 0:
            flops += 6.0 * block * routed + 12.0 * h * seq * routed ** 2 + 6.0 * h
        else:
            flops += 6.0 * block + 12.0 * h * seq
    return flops


def _assert_the_logged_mod_statistics(out) -> None:
    """Each step's MoD statistics: the toy's capacity, and its FLOPs reduction against the GELU decoder, counted from
    the toy's own dimensions (a trainer measuring against the SwiGLU dense model logs a larger reduction)."""
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["arch"] == "toy" and config["mod_causal_routing"] == "router"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mods = [record["mod"] for record in records if "loss" in record]
    assert len(mods) == 8
    for mod in mods:
        routed = 1.0 - mod["skip_rate"]  # training routes exactly the capacity's top-k tokens in each MoD block
        assert mod["capacity"] == config["mod_capacity"] and routed == pytest.approx(config["mod_capacity"])
        expected = 1.0 - _toy_flops(config, routed) / _toy_flops(config, 1.0)
        assert mod["flops_reduction"] == pytest.approx(expected, rel=1e-9), (mod, expected)
