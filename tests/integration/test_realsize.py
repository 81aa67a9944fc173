"""The real-size benchmark's measurement, at test size: the folder built, `--init_from` it in a process of its own
with debug_cpu.json's engine, each phase's peak recorded beside the planner's projection, and a model whose step
the planner projects beyond the machine run forward and backward only, saying so."""

import json

import psutil
import pytest
from transformers import LlamaForCausalLM

from adaptive_ds.tools import realsize
from adaptive_ds.tools.realsize import markdown, run_benchmark

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 1024}


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def test_the_benchmark_measures_a_built_folder_with_a_step_beside_the_planner(tmp_path, tiny):
    report = run_benchmark({"tiny": tiny}, tmp_path / "work", seq_len=32)
    m = report["models"]["tiny"]
    stock = LlamaForCausalLM.from_pretrained(tmp_path / "work" / "tiny")
    assert m["parameters"] == m["planned_parameters"] == sum(p.numel() for p in stock.parameters())
    assert m["optimizer_step"] and m["why_no_step"] is None and m["weights_dtype"] == "BF16"
    assert set(m["phases_gib"]) == {"load", "engine", "forward_backward", "step"}
    assert m["measured_gib"] == max(m["phases_gib"].values()) > 0 and m["projected_gib"] > 0
    assert m["peak_rss_gib"] > m["rss_before_model_gib"] > 0
    assert report["seq_len"] == 32 and report["ds_config"] == "ds_configs/debug_cpu.json"
    text = markdown(report)
    assert "| tiny | " in text and "forward, backward, optimizer step" in text and "No optimizer step" not in text
    built = (tmp_path / "work" / "tiny" / "model.safetensors").stat().st_mtime_ns
    realsize.ensure_folder(tiny, tmp_path / "work", seed=0)  # the same config: the folder is reused
    assert (tmp_path / "work" / "tiny" / "model.safetensors").stat().st_mtime_ns == built


def test_a_step_beyond_the_machine_runs_forward_and_backward_only_and_says_so(tmp_path, tiny, monkeypatch):
    """A machine of 1 KiB: the planner's step does not fit it, so the process runs no optimizer step."""
    small = psutil.virtual_memory()._replace(total=1024)
    monkeypatch.setattr(realsize.psutil, "virtual_memory", lambda: small)
    report = run_benchmark({"tiny": tiny}, tmp_path / "work", seq_len=32)
    m = report["models"]["tiny"]
    assert not m["optimizer_step"] and "step" not in m["phases_gib"]
    assert m["why_no_step"].startswith("the planner projects") and m["projected_gib"] < m["projected_step_gib"]
    text = markdown(report)
    assert "forward and backward only" in text and "No optimizer step: tiny: the planner projects" in text


def test_a_folder_the_run_refuses_ends_the_benchmark_with_the_runs_line(tmp_path):
    path = tmp_path / "gelu.json"
    path.write_text(json.dumps({**TINY, "hidden_act": "gelu"}))
    with pytest.raises(SystemExit, match="hidden_act 'gelu'"):
        run_benchmark({"gelu": path}, tmp_path / "work", seq_len=32)
