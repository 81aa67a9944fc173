"""The consolidation scripts in OUTPUT_DIR/checkpoints (DeepSpeed's zero_to_fp32.py and zero_to_torch.py, with
their command lines and output files) for every architecture. Run as a user runs them, their state dict loads into
a fresh model with strict=True and equals final/'s weights tensor by tensor, every expert under its global number:
final/ holds the module weights, which in these fp32 runs are the fp32 master weights that ZeRO keeps."""

import json
import shutil
import sys

import pytest
import torch
from helpers.common import run_command, write_ds_config
from safetensors.torch import load_file

from adaptive_ds.models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from adaptive_ds.training import train
from adaptive_ds.training.checkpoint.consolidate import main, script_text

MODEL = {"num_hidden_layers": 2}
EXPERT = ".deepspeed_experts."


def _train(directory, arch, zero_stage=2):
    out = directory / "run"
    config = write_ds_config(directory, zero_stage=zero_stage, arch=arch, max_steps=1, log_steps=1, model=MODEL)
    train(["--ds_config", config, "--output_dir", str(out)])
    return out


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("moe"), "moe")


def _script(out, name, dest, *args):
    """`python OUTPUT_DIR/checkpoints/<name> OUTPUT_DIR/checkpoints DEST ...`, as DeepSpeed's docs say."""
    checkpoints = out / "checkpoints"
    return run_command([sys.executable, str(checkpoints / name), str(checkpoints), str(dest), *args])


def _read_output(folder):
    """The state dict in `folder`, read as transformers reads such a folder: the index's shards, or the one file."""
    indexes = list(folder.glob("*.index.json"))
    if indexes:
        files = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
    else:
        files = [p.name for p in folder.iterdir()]
    assert files, f"nothing written in {folder}"
    state = {}
    for name in files:
        part = load_file(folder / name) if name.endswith(".safetensors") else torch.load(folder / name)
        assert not set(part) & set(state)
        state.update(part)
    return state


def _final(out):
    return {k: v for path in sorted((out / "final").glob("*.safetensors")) for k, v in load_file(path).items()}


def _assert_equals_final(state, out, dtype=torch.float32):
    config = AdaptiveDSConfig.from_pretrained(out / "final")
    AdaptiveDSForCausalLM(config).load_state_dict(state, strict=True)
    final = _final(out)
    assert sorted(state) == sorted(final)
    for name, tensor in final.items():
        assert state[name].dtype == dtype, name
        assert torch.equal(state[name], tensor.to(dtype)), f"{name} differs from final/"
    if config.uses_moe:  # every expert of every MoE layer, by its global number
        experts = {name.split(EXPERT)[1].split(".")[0] for name in state if EXPERT in name}
        assert experts == {str(e) for e in range(config.num_routed_experts)}
    return config


def test_zero_to_fp32_in_the_checkpoint_folder_consolidates_an_moe_checkpoint(moe_run, tmp_path):
    result = _script(moe_run, "zero_to_fp32.py", tmp_path / "fp32")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "fp32").iterdir()) == ["pytorch_model.bin"]
    _assert_equals_final(_read_output(tmp_path / "fp32"), moe_run)


def test_zero_to_torch_writes_bf16_safetensors_shards_with_an_index(moe_run, tmp_path):
    dest = tmp_path / "bf16"
    result = _script(moe_run, "zero_to_torch.py", dest, "--dtype", "bf16", "--safe_serialization",
                     "--max_shard_size", "100KB", "--tag", "step00000001")
    assert result.returncode == 0, result.stderr[-3000:]
    shards = sorted(p.name for p in dest.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (dest / "model.safetensors.index.json").is_file()
    _assert_equals_final(_read_output(dest), moe_run, dtype=torch.bfloat16)


@pytest.mark.parametrize("arch", ["hybrid", "dense"])
def test_zero_to_fp32_consolidates_hybrid_and_dense_checkpoints(tmp_path, arch):
    # dense goes through DeepSpeed's own reader; the hybrid's MoE blocks through the experts' ZeRO partitions. The
    # scripts are the same for every architecture (run as a user runs them above): their main, in this process.
    out = _train(tmp_path, arch, zero_stage=1 if arch == "dense" else 2)
    assert (out / "checkpoints" / "zero_to_fp32.py").read_text() == script_text("zero_to_fp32.py")
    main([str(out / "checkpoints"), str(tmp_path / "fp32"), "--safe_serialization"])
    assert sorted(p.name for p in (tmp_path / "fp32").iterdir()) == ["model.safetensors"]
    _assert_equals_final(_read_output(tmp_path / "fp32"), out)


def _one_line_error(argv):
    with pytest.raises(SystemExit) as error:
        main(argv)
    message = str(error.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_bad_input_gets_one_line_and_nothing_is_removed(moe_run, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(moe_run / "checkpoints", checkpoints)
    tag = checkpoints / "step00000001"
    before = sorted(p.name for p in tag.iterdir())
    assert "no 'latest' file" in _one_line_error([str(tmp_path), str(tmp_path / "o1")])
    assert "is a checkpoint tag folder" in _one_line_error([str(tag), str(tmp_path / "o2")])
    assert "no checkpoint tag 'step00000009'" in _one_line_error([str(checkpoints), str(tmp_path / "o3"),
                                                                   "--tag", "step00000009"])
    assert "step00000001" in _one_line_error([str(checkpoints), str(tmp_path / "o3"), "--tag", "step00000009"])
    assert "is no folder" in _one_line_error([str(tmp_path / "missing"), str(tmp_path / "o4")])

    used = tmp_path / "used"
    used.mkdir()
    (used / "pytorch_model.bin").write_text("keep")
    assert "already holds pytorch_model.bin" in _one_line_error([str(checkpoints), str(used)])
    assert (used / "pytorch_model.bin").read_text() == "keep"

    optimizer = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in _one_line_error([str(checkpoints), str(tmp_path / "o5")])
    assert not (tmp_path / "o5").exists() or not list((tmp_path / "o5").iterdir())
    assert sorted(p.name for p in tag.iterdir()) == before


def test_the_script_says_in_one_line_that_it_needs_adaptive_ds(moe_run, tmp_path, run_command):
    # -S: no site-packages, so neither adaptive_ds nor torch can be imported
    checkpoints = moe_run / "checkpoints"
    result = run_command([sys.executable, "-S", str(checkpoints / "zero_to_fp32.py"), str(checkpoints),
                          str(tmp_path / "out")])
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert "needs adaptive_ds" in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_expert_parallel_moe_checkpoint_consolidates_every_rank_s_experts(tmp_path, run_command, tiny_ds_config):
    """Two processes, ep_size 2: each rank's optimizer partition holds its experts numbered from 0."""
    config = tiny_ds_config(zero_stage=2, arch="moe", max_steps=1, log_steps=1, model=MODEL)
    out = tmp_path / "run"
    result = run_command(["torchrun", "--nproc_per_node", "2", "-m", "adaptive_ds.training", "--ds_config", config,
                          "--output_dir", str(out), "--ep_size", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    result = _script(out, "zero_to_fp32.py", tmp_path / "fp32")
    assert result.returncode == 0, result.stderr[-3000:]
    tag = out / "checkpoints" / "step00000001"
    assert json.loads((tag / "run.json").read_text())["identity"]["model"]["moe_ep_size"] == 2
    state = _read_output(tmp_path / "fp32")
    config = _assert_equals_final(state, out)
    # DeepSpeed's expert files (module weights, written by each ep rank under the global number): the same tensors
    expert_files = sorted(tag.glob("layer_*_expert_*_mp_rank_00_model_states.pt"))
    assert len(expert_files) == config.num_routed_experts * MODEL["num_hidden_layers"]
    for path in expert_files:
        for name, tensor in torch.load(path, weights_only=False).items():
            assert torch.equal(state[name], tensor), name
