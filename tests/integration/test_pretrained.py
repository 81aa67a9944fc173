"""Training from pretrained weights (--init_from) through the real engine: the first step's loss is the stock
model's on that step's batch, the run starts afresh and records its base model, a resume loads its own checkpoint
(and checks that the folder is still the one it started from), data of another vocabulary is refused; a MoD or
hybrid run at capacity 1.0 writes a final/ that evaluates as the dense model, and as its own Llama export."""

import json
import os
import shutil

import pytest
import torch
from helpers.common import logged_losses, write_ds_config
from helpers.pretrained_folders import DEBUG, llama_folder, mixtral_folder, stock_folder
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from adaptive_ds import pretrained
from adaptive_ds.data import build_training_data
from adaptive_ds.export.convert import main as export
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.training import train
from adaptive_ds.training.arguments import ConfigError
from adaptive_ds.training.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("llama"), shape=DEBUG)


def _first_batch(rows: int, seed: int) -> dict:
    data = build_training_data("embedded", 64, seed, workers=0)
    batches = data.step_batches(0, rows)
    try:
        return next(batches)
    finally:
        batches.close()


@pytest.mark.parametrize("arch, zero_stage", [("dense", 1), ("moe", 2)])
def test_a_run_from_a_stock_llama_starts_at_the_stock_models_loss(llama, tmp_path, arch, zero_stage):
    # moe: upcycled, dropless in training too, so that its first step sees the dense function
    model = {"moe_drop_tokens": False} if arch == "moe" else {}
    config = write_ds_config(tmp_path, micro=2, zero_stage=zero_stage, arch=arch, max_steps=2, init_from=str(llama),
                             seed=7, model=model)
    out = tmp_path / "run"
    summary = train(["--ds_config", config, "--output_dir", str(out)])
    batch = _first_batch(2, 7)
    with torch.no_grad():
        stock = LlamaForCausalLM.from_pretrained(llama).eval()(**batch).loss.item()
    assert logged_losses(out)[1] == pytest.approx(stock, rel=1e-5, abs=1e-6)
    digest = pretrained.Source.open(str(llama)).content_hash
    assert summary["base_model"] == str(llama) and summary["base_model_sha256"] == digest
    assert summary["steps"] == 2 and summary["tokens_seen"] == 2 * 2 * 64 and summary["seq_len"] == 64
    identity = json.loads((out / "run_identity.json").read_text())
    assert identity["base_model"] == {"source": str(llama), "sha256": digest,
                                      "files": pretrained.Source.open(str(llama)).identity(None)["files"]}


@pytest.mark.parametrize("family, arch, zero_stage", [("qwen2", "dense", 1), ("qwen3", "hybrid", 2)])
def test_a_run_from_a_tied_qwen_trains_tied_and_exports_back_to_its_class(tmp_path, family, arch, zero_stage):
    """Tied embeddings, q/k/v biases (Qwen2) and q/k norm with a head_dim of its own (Qwen3) through the real engine:
    the first step's loss is the stock model's, the embedding and the LM head stay one tensor through training, and a
    dense final/ exports with `--to auto` to the class it came from, with the trained model's logits."""
    stock_class, config_class, extra = {"qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
                                        "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 64})}[family]
    folder = stock_folder(tmp_path / family, stock_class, config_class, DEBUG, tie_word_embeddings=True, **extra)
    model = {"mod_capacity": 1.0, "mod_layer_interval": 1, "moe_drop_tokens": False} if arch == "hybrid" else {}
    config = write_ds_config(tmp_path, micro=2, zero_stage=zero_stage, arch=arch, max_steps=2, init_from=str(folder),
                             seed=7, model=model)
    out = tmp_path / "run"
    train(["--ds_config", config, "--output_dir", str(out)])
    with torch.no_grad():
        stock = stock_class.from_pretrained(folder).eval()(**_first_batch(2, 7)).loss.item()
    assert logged_losses(out)[1] == pytest.approx(stock, rel=1e-5, abs=1e-6)
    trained = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert trained.config.source_model_type == family and trained.config.tie_word_embeddings
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(out / "final" / "model.safetensors")  # saved once
    if arch == "dense":
        from adaptive_ds.export.convert import main as export

        export([str(out / "final"), str(tmp_path / "hf"), "--to", "auto"])
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        assert type(exported) is stock_class
        ids = _first_batch(2, 7)["input_ids"]
        with torch.no_grad():
            gap = (exported(ids).logits - trained(ids).logits[..., :exported.config.vocab_size]).abs().max()
        assert gap < 1e-5


def test_a_resume_loads_its_own_checkpoint_and_checks_the_folder(llama, tmp_path, monkeypatch):
    folder = tmp_path / "llama"
    shutil.copytree(llama, folder)
    out = tmp_path / "run"
    config = write_ds_config(tmp_path, micro=2, max_steps=2, init_from=str(folder))
    train(["--ds_config", config, "--output_dir", str(out)])

    def refuse(*args, **kwargs):
        raise AssertionError("a resume read the init weights")

    with monkeypatch.context() as patched:  # an unchanged folder is neither loaded nor hashed again
        patched.setattr(pretrained.Source, "load_into", refuse)
        patched.setattr(pretrained, "content_hash", refuse)
        summary = train(["--ds_config", config, "--output_dir", str(out), "--max_steps", "3"])
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    size = (folder / "model.safetensors").stat().st_size
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})  # the same size, another content
    stat = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert (folder / "model.safetensors").stat().st_size == size
    with pytest.raises(CheckpointError, match="base_model.sha256"):
        train(["--ds_config", config, "--output_dir", str(out), "--max_steps", "4"])


def test_a_run_from_a_folder_of_no_presets_shape_claims_no_preset(tmp_path):
    folder = llama_folder(tmp_path / "tiny")  # TINY: the shape of no preset
    config = write_ds_config(tmp_path, micro=2, max_steps=1, init_from=str(folder))
    block = json.loads(open(config).read())
    del block["adaptive_ds"]["preset"]
    open(config, "w").write(json.dumps(block))
    out = tmp_path / "run"
    summary = train(["--ds_config", config, "--output_dir", str(out)])
    assert summary["preset"] is None and summary["seq_len"] == 64  # its max_position_embeddings (up to 2048)
    assert json.loads((out / "run_identity.json").read_text())["preset"] is None


def test_data_of_another_vocabulary_is_refused_in_one_line(llama, tmp_path):
    config = write_ds_config(tmp_path, init_from=str(llama), data="embedded:hard")
    with pytest.raises(ConfigError, match="not the tokenizer of init_from") as error:
        train(["--ds_config", config, "--output_dir", str(tmp_path / "run")])
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def _stock_loss(model_class, folder, rows: int, seed: int) -> float:
    with torch.no_grad():
        return model_class.from_pretrained(folder).eval()(**_first_batch(rows, seed)).loss.item()


@pytest.mark.slow
def test_expert_parallel_ranks_each_load_their_own_experts_of_a_mixtral(tmp_path, run_command):
    from transformers import MixtralForCausalLM

    folder = mixtral_folder(tmp_path / "mixtral", shape=DEBUG)
    out = tmp_path / "run"
    config = write_ds_config(tmp_path, micro=2, zero_stage=2, arch="moe", max_steps=1, init_from=str(folder), seed=3)
    result = run_command(["torchrun", "--nproc_per_node", "2", "launchers/train.py", "--ds_config", config,
                          "--ep_size", "2", "--output_dir", str(out)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # the first step's loss over both ranks' rows is the stock model's on the global batch: each rank held 2 of the 4
    # experts, the ones its expert-parallel rank owns
    assert logged_losses(out)[1] == pytest.approx(_stock_loss(MixtralForCausalLM, folder, 4, 3), rel=1e-5)


@pytest.mark.slow
def test_accelerate_launch_starts_from_a_stock_llama(llama, tmp_path, run_command):
    out = tmp_path / "run"
    result = run_command(["accelerate", "launch", "--config_file", "launchers/accelerate_deepspeed.yaml",
                          "launchers/train.py", "--init_from", str(llama), "--max_steps", "1", "--seed", "5",
                          "--output_dir", str(out)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["base_model"] == str(llama) and summary["seq_len"] == 64
    # debug_cpu.json: 16 rows per process
    assert logged_losses(out)[1] == pytest.approx(_stock_loss(LlamaForCausalLM, llama, 32, 5), rel=1e-5)


def test_weights_that_do_not_match_their_config_are_refused_in_one_line(llama, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(llama, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors")
    config = write_ds_config(tmp_path, micro=2, max_steps=1, init_from=str(folder))
    with pytest.raises(ConfigError, match="has no tensor 'model.norm.weight'") as error:
        train(["--ds_config", config, "--output_dir", str(tmp_path / "run")])
    assert "\n" not in str(error.value)


def _capacity_one_run(llama, tmp_path, arch: str, lr: float, steps: int):
    """A run of `arch` retrofitted to the stock Llama at capacity 1.0 in every block: (its final/ model in eval
    mode, as it loads, and its summary)."""
    config = write_ds_config(tmp_path, micro=2, arch=arch, max_steps=steps, init_from=str(llama), seed=7,
                             model={"mod_capacity": 1.0, "mod_layer_interval": 1})
    block = json.loads(open(config).read())
    block["optimizer"]["params"]["lr"] = lr
    open(config, "w").write(json.dumps(block))
    summary = train(["--ds_config", config, "--output_dir", str(tmp_path / "run")])
    model = AdaptiveDSForCausalLM.from_pretrained(tmp_path / "run" / "final").eval()
    assert model.model.mod_routing == "causal"  # as it loads: evaluation's default routing
    return model, summary


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_a_capacity_one_retrofit_after_a_step_at_lr_0_evaluates_as_the_stock_llama(llama, tmp_path, arch):
    model, summary = _capacity_one_run(llama, tmp_path, arch, lr=0.0, steps=1)
    assert summary["validation_causal_routed_share"] == 1.0  # validation ran every token through every block
    ids = _first_batch(2, 7)["input_ids"]
    stock = LlamaForCausalLM.from_pretrained(llama).eval()
    torch.testing.assert_close(_logits(model, ids), _logits(stock, ids), rtol=0, atol=1e-5)


def test_a_trained_capacity_one_mod_run_evaluates_as_its_llama_export(llama, tmp_path):
    model, _ = _capacity_one_run(llama, tmp_path, "mod", lr=3e-3, steps=2)
    ids = _first_batch(2, 7)["input_ids"]
    scores = []  # each block's router logits in the evaluation below
    handles = [layer.router.register_forward_hook(lambda m, args, out: scores.append(out))
               for layer in model.model.layers]
    evaluated = _logits(model, ids)
    for handle in handles:
        handle.remove()
    assert any((s <= 0).any() for s in scores)  # trained toward routing all, not there yet: its sign skips some
    export(["--to", "llama", str(tmp_path / "run" / "final"), str(tmp_path / "llama")])
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    stock = LlamaForCausalLM.from_pretrained(llama).eval()
    assert not torch.allclose(_logits(exported, ids), _logits(stock, ids), atol=1e-3)  # it trained
    torch.testing.assert_close(evaluated, _logits(exported, ids), rtol=0, atol=1e-5)
