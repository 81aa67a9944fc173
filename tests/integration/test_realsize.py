"""The real-size benchmark's measurement, at test size: the folder built, `--init_from` it in a process of its own
with debug_cpu.json's engine, each phase's peak recorded beside the planner's projection, and a model whose step
the planner projects beyond the machine run forward and backward only, saying so. Its width mode: the debug preset at
one and two layers on b1_t4.json's engine (fp16, ZeRO-2, CPU Adam), each in a process of its own, fitted; and the
planner's offloaded states against the buffers DeepSpeed allocates for them."""

import json

import psutil
import pytest
import torch
from helpers.shipped import HALF_PRECISION, needs, shipped
from transformers import LlamaForCausalLM

from adaptive_ds import distributed
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.presets import model_config
from adaptive_ds.tools import realsize
from adaptive_ds.tools.realsize import markdown, run_benchmark

FP16 = HALF_PRECISION["fp16"]  # b1_t4.json

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


@pytest.fixture
def debug_on_b1_t4(tmp_path):
    """b1_t4.json as shipped (its engine, its block's activation checkpointing) at the debug preset."""
    config = shipped(FP16)
    config["adaptive_ds"]["preset"] = "debug"
    path = tmp_path / "debug_t4.json"
    path.write_text(json.dumps(config))
    return str(path)


@needs("fp16")
def test_the_width_mode_measures_each_depth_in_its_own_process_and_fits_them(debug_on_b1_t4):
    from adaptive_ds.tools.realsize_width import run_width_benchmark

    report = run_width_benchmark("debug", debug_on_b1_t4, [1, 2], seq_len=32, vocab_size=512)
    assert list(report["models"]) == ["1", "2"] and report["preset_layers"] == 4
    assert (report["precision"], report["loss_scale"], report["zero_stage"], report["offload_optimizer"]) == (
        "fp16", "dynamic", 2, "cpu")
    for n, m in report["models"].items():
        with torch.device("meta"):  # the model a training run of that depth builds, at the vocabulary asked
            built = AdaptiveDSForCausalLM(model_config("debug", "dense", 512, num_hidden_layers=int(n)))
        assert m["parameters"] == m["planned_parameters"] == sum(p.numel() for p in built.parameters())
        assert m["vocab_size"] == 512 and set(m["phases_gib"]) == {"load", "engine", "forward_backward", "step"}
        assert m["measured_gib"] == max(m["phases_gib"].values()) > 0
        # hand-worked from the built model's P parameters and largest tensor L at the step, the projected peak phase:
        # the GPU's fp16 weights and gradient buffer (2P + 2L); the host's fp32 master and gradient partition, fp16
        # copy, Adam's moments and its gradient buffer (18P + 2L)
        params, largest = m["parameters"], max(p.numel() for p in built.parameters())
        assert m["projected_phase"] == "step"
        assert m["projected_device_gib"] * 2**30 == pytest.approx(2 * params + 2 * largest, rel=1e-9)
        assert m["projected_host_gib"] * 2**30 == pytest.approx(18 * params + 2 * largest, rel=1e-9)
    fit = report["fit"]
    assert fit["layers"] == [1, 2] and fit["measured_at_preset"] is False
    assert fit["residuals_gib"] == pytest.approx({"1": 0.0, "2": 0.0}, abs=1e-9)  # two points: on the line
    assert fit["fitted_gib_at_preset"] == pytest.approx(fit["intercept_gib"] + 4 * fit["slope_gib_per_layer"])
    assert report["host"]["projected_host_gib"] > 0 and "Colab (T4)" in report["host"]["hosts_gib"]
    assert "which were **not measured**" in markdown(report)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _held(zero) -> int:
    """The bytes of every CPU tensor the ZeRO optimizer holds, reached through its attributes (lists, dicts, DeepSpeed's
    and torch's optimizer objects, a tensor's .grad), each storage counted once."""
    storages, seen = {}, set()

    def walk(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and obj.untyped_storage().data_ptr():
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            if obj.grad is not None:
                walk(obj.grad, depth + 1)
            return
        if id(obj) in seen or depth > 8 or isinstance(obj, torch.nn.Module):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for value in obj.values():
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for value in obj:
                walk(value, depth + 1)
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value, depth + 1)

    walk(zero)
    return sum(storages.values())


@needs("fp16")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_planners_offloaded_states_are_the_buffers_deepspeed_allocates(accumulation, monkeypatch):
    """The independent reference of `planner.state_bytes`, `largest_parameter` and `planner_host` for b1_t4.json's
    engine: DeepSpeed's own ZeRO-2 optimizer with CPU offload on one rank, every CPU tensor it holds summed after
    initialisation, after each micro-step and after the step (on a CPU the GPU's side is CPU tensors too: the fp16
    weights and the GPU-side gradient buffer), and every buffer it asks its accelerator to pin (a no-op on a CPU,
    recorded here)."""
    from deepspeed.accelerator import get_accelerator

    from adaptive_ds.tools.planner import Layout, largest_parameter, state_bytes
    from adaptive_ds.tools.planner_host import offload_host_bytes, optimizer_groups, pinned_bytes
    from adaptive_ds.tools.realsize_run import engine_config
    from adaptive_ds.training.engine import build_engine

    pinned = []
    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "pin_memory", lambda tensor, *a, **k: pinned.append(tensor.nbytes) or tensor)
    distributed.init_distributed()
    config = model_config("debug", "dense", 512, num_hidden_layers=1)
    model = AdaptiveDSForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    ds_config = {**engine_config({}, FP16), "gradient_accumulation_steps": accumulation}
    del ds_config["adaptive_ds"]
    engine = build_engine(model, ds_config, warmup_steps=0, max_steps=1, min_lr_ratio=0.1)
    zero = engine.optimizer
    assert type(zero.optimizer).__name__ == "DeepSpeedCPUAdam" and zero.cpu_offload_pin_memory
    layout = Layout.from_ds_config(ds_config, False)
    states, staging = state_bytes(params, 0, 1, layout, 1), 2 * largest_parameter(config)
    assert zero.temp_grad_buffer_for_cpu_offload.numel() == zero.temp_grad_buffer_for_gpu_offload.numel() == (
        largest_parameter(config))
    assert [p.numel() for p in zero.single_partition_of_fp32_groups] == pytest.approx(
        [elements for elements, _ in optimizer_groups(config)], abs=16)  # ZeRO pads each partition for alignment
    gpu_side = states.weights + staging
    assert _held(zero) == pytest.approx(gpu_side + states.optimizer + staging, rel=1e-2)
    for micro in range(accumulation):
        ids = torch.randint(2, 500, (1, 32))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()  # the optimizer steps at the last micro-step only
        moments = states.moments if micro == accumulation - 1 else 0
        held = gpu_side + states.optimizer + staging + states.accumulated + moments
        assert _held(zero) == pytest.approx(held, rel=1e-2), micro
    assert states.accumulated == (2 * params if accumulation > 1 else 0)
    # what it pins, one buffer at a time: per param group the master partition, its gradient and the fp16 copy; the
    # gradient buffer; with accumulation a buffer per parameter; not the moments, which CPU Adam makes pageable
    tensors = list(model.parameters())
    assert len(pinned) == 3 * len(optimizer_groups(config)) + 1 + (len(tensors) if accumulation > 1 else 0)
    for take in (pinned_bytes, float):
        assert sum(map(take, pinned)) == pytest.approx(
            offload_host_bytes(config, True, accumulation, 1, False, pinned=take is pinned_bytes), rel=1e-2)
