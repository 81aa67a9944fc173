"""The real-size folders: the committed published configs are the models their cards describe (transformers' own
classes count the parameters the cards state), the builder writes a folder with exactly the config it is given
(random weights in the config's dtype, the embedded tokenizer, the config's vocabulary), and the planner plans a
folder of no preset's shape from the folder. The measurement itself: tests/integration/test_realsize.py."""

import json

import pytest
import torch
from helpers.pretrained_folders import llama_folder
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.tools.realsize import _model_config, build_folder, config_differences, main, published_configs

# From each model card (Hugging Face Hub), written out here by hand: shape, vocabulary, tied embeddings, and the
# parameter count (Llama 3.2: 1.24B; Qwen2.5-0.5B: 0.49B, "0.36B non-embedding"; SmolLM2-360M: 361,821,120).
CARDS = {
    "Llama-3.2-1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, parameters=(1.235e9, 1.245e9)),
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, parameters=(0.485e9, 0.495e9)),
    "SmolLM2-360M": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         intermediate_size=2560, vocab_size=49152, parameters=(361_821_120, 361_821_120)),
}


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter, counted once


@pytest.mark.parametrize("name", sorted(CARDS))
def test_each_published_config_is_the_model_its_card_describes(name):
    config = _model_config(published_configs()[name])
    card = dict(CARDS[name])
    low, high = card.pop("parameters")
    assert {k: getattr(config, k) for k in card} == card
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert low <= _parameters(model) <= high
    if name == "Llama-3.2-1B":
        assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 32.0
    if name == "Qwen2.5-0.5B":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        assert model.model.layers[0].self_attn.o_proj.bias is None
    assert set(published_configs()) == set(CARDS)


def _shrunk(name: str, tmp_path):
    """The published config of `name` at test size: its shape shrunk, everything else (ties, biases, RoPE scaling,
    dtype, vocabulary) as published."""
    raw = json.loads(published_configs()[name].read_text())
    raw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if "head_dim" in raw:
        raw["head_dim"] = 16
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("name", sorted(CARDS))
def test_the_builder_writes_the_config_it_is_given_with_random_weights_and_the_embedded_tokenizer(name, tmp_path):
    config_path = _shrunk(name, tmp_path)
    folder = build_folder(config_path, tmp_path / "folder", seed=3)
    assert config_differences(folder, config_path) == []
    saved = json.loads((folder / "config.json").read_text())
    assert saved["vocab_size"] == CARDS[name]["vocab_size"] and saved["tie_word_embeddings"] is True
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == embedded_tokenizer().get_vocab()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert {str(f.get_tensor(k).dtype) for k in names} == {"torch.bfloat16"}
        assert "lm_head.weight" not in names  # tied: one tensor on disk
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert embedding.shape == (CARDS[name]["vocab_size"], 64) and embedding.float().std() > 0
    again = build_folder(config_path, tmp_path / "again", seed=3)
    with safe_open(str(again / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), embedding)  # seeded
    loaded = AutoModelForCausalLM.from_pretrained(folder)  # transformers reads it back as its own class
    assert type(loaded).__name__ == json.loads(published_configs()[name].read_text())["architectures"][0]


def test_a_folder_whose_config_differs_is_told_apart(tmp_path):
    """The check that decides whether the benchmark rebuilds a folder names the field that differs."""
    config_path = _shrunk("SmolLM2-360M", tmp_path)
    folder = build_folder(config_path, tmp_path / "folder")
    raw = json.loads(config_path.read_text())
    raw["rope_theta"] = 10000.0
    other = tmp_path / "other.json"
    other.write_text(json.dumps(raw))
    differences = config_differences(folder, other)
    assert len(differences) == 1 and differences[0].startswith("rope_parameters:")


def test_build_refuses_a_config_without_model_type_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(SystemExit, match=r"^error: --build .*bad\.json: .*no model_type") as raised:
        main(["--build", str(bad), str(tmp_path / "out")])
    assert "\n" not in str(raised.value) and not (tmp_path / "out").exists()


ODD = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


def test_the_planner_plans_a_folder_of_no_presets_shape_from_the_folder(tmp_path, capsys):
    """No preset has this shape: the plan is the folder's model (transformers' Llama counts its parameters) at the
    folder's context (64 tokens, the run's seq_len), and names no preset."""
    from adaptive_ds.tools.plan import main as plan_main

    folder = llama_folder(tmp_path / "odd", shape=ODD)
    plan_main(["--init_from", str(folder), "--gpu", "t4", "--json"])
    planned = json.loads(capsys.readouterr().out)
    stock = LlamaForCausalLM.from_pretrained(folder)
    assert planned["preset"] is None and planned["seq_len"] == 64
    assert planned["total_parameters"] == _parameters(stock)
    plan_main(["--init_from", str(folder), "--gpu", "t4"])
    text = capsys.readouterr().out
    assert text.startswith(f"{folder} (preset none) dense on 1 x t4, seq 64") and "fits" in text


@pytest.mark.parametrize("make, expected", [
    (lambda path: path / "missing", "no such folder"),
    (lambda path: path, "holds no config.json"),
    (lambda path: (path / "config.json").write_text(json.dumps({"model_type": "gpt2"})) and path,
     "is a 'gpt2' model; supported model types"),
])
def test_plan_init_from_a_folder_that_does_not_open_answers_in_one_line(tmp_path, make, expected):
    from adaptive_ds.tools.plan import main as plan_main

    folder = make(tmp_path)
    with pytest.raises(SystemExit, match=f"^error: init_from .*{expected}") as raised:
        plan_main(["--init_from", str(folder), "--gpu", "t4"])
    assert "\n" not in str(raised.value)


def test_a_plan_before_the_first_step_holds_the_master_copy_but_no_adam_moments():
    """Hand-worked, fp32 ZeRO-1 on one rank: weights 4 + gradients 4 + DeepSpeed's fp32 master copy 4 bytes per
    parameter before the first step, + its gradient partition 4 and Adam's two moments 8 at the step."""
    from adaptive_ds.tools.planner import Layout, model_state_bytes

    layout = Layout(micro_batch=1, zero_stage=1, offload_optimizer=False, half_precision=False,
                    activation_checkpointing=False)
    assert model_state_bytes(1000, 0, 1, layout, 1, optimizer_step=False) == (12_000, 0)
    assert model_state_bytes(1000, 0, 1, layout, 1) == (24_000, 0)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_plan_init_from_answers_for_each_published_model_at_real_size(name, tmp_path, capsys):
    """A folder with the published config (the planner reads the config only): the plan is that model, as many
    parameters as transformers' own class holds (tied embeddings once, Qwen2's biases), at the run's seq_len, and it
    answers for a T4: a fit, or what runs instead."""
    from adaptive_ds.tools.plan import main as plan_main

    (tmp_path / "config.json").write_text(published_configs()[name].read_text())
    plan_main(["--init_from", str(tmp_path), "--gpu", "t4", "--json"])
    planned = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        stock = AutoModelForCausalLM.from_config(_model_config(published_configs()[name]))
    assert planned["total_parameters"] == _parameters(stock) and planned["preset"] is None
    assert planned["seq_len"] == 2048  # max_position_embeddings up to the longest preset's
    assert planned["runs"] or planned["advice"]


def test_a_measurement_without_the_memory_it_needs_is_refused_in_one_line(monkeypatch):
    import psutil

    from adaptive_ds.tools import realsize

    short = psutil.virtual_memory()._replace(available=2**30)
    monkeypatch.setattr(realsize.psutil, "virtual_memory", lambda: short)
    with pytest.raises(SystemExit, match=r"^error: the measurement needs about 20.0 GiB .* 1.0 GiB are available: "
                                         r"run it alone, or pass --wait") as raised:
        realsize.wait_for_memory(20.0, wait_s=0)
    assert "\n" not in str(raised.value)
    realsize.wait_for_memory(0.5, wait_s=0)  # enough: returns at once
