"""The ds_config reader (adaptive_ds/ds_config.py), and every shipped DeepSpeed config: known keys, consistent batch
sizes, an existing preset, one precision."""

import json
import re
from pathlib import Path

import pytest
from helpers.common import ROOT

from adaptive_ds import ds_config as reader
from adaptive_ds.presets import PRESETS, model_config, parameter_counts
from adaptive_ds.training.arguments import ConfigError, check_precision, parse

CONFIGS = sorted((ROOT / "adaptive_ds" / "ds_configs").glob("*.json"))  # shipped with the package
DEEPSPEED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping", "optimizer", "scheduler", "zero_optimization", "fp16", "bf16",
                  "steps_per_print", "wall_clock_breakdown", "activation_checkpointing", "checkpoint"}


def _world_size(path: Path) -> int:
    return 8 if "8gpu" in path.name else 1


def test_a_config_ships_for_every_preset_and_its_hardware():
    names = {p.name for p in CONFIGS}
    assert {"debug_cpu.json", "debug_200m_t4.json", "b1_t4.json", "b1_a100.json", "b1_h100.json",
            "b7_a100_40gb_offload.json", "b7_8gpu.json", "b7_moe_8gpu.json"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_is_valid(path):
    raw = json.loads(path.read_text())
    assert set(raw) - {"adaptive_ds"} <= DEEPSPEED_KEYS, set(raw) - DEEPSPEED_KEYS
    settings, ds_config = parse(["--ds_config", str(path)], _world_size(path))  # validates our block
    assert settings.preset in PRESETS
    micro, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config.get("gradient_accumulation_steps", 1)
    if "train_batch_size" in ds_config:
        assert ds_config["train_batch_size"] == micro * accum * _world_size(path)
    assert not (ds_config.get("fp16", {}).get("enabled") and ds_config.get("bf16", {}).get("enabled"))
    if "_t4" in path.name:
        assert ds_config["fp16"]["enabled"] and not ds_config.get("bf16", {}).get("enabled")
    if settings.preset != "debug":  # ~512K tokens per optimizer step
        tokens = micro * accum * _world_size(path) * PRESETS[settings.preset].seq_len
        assert 480_000 <= tokens <= 540_000


def test_b1_t4_offloads_the_optimizer_with_zero_2_and_checkpoints_activations():
    settings, ds_config = parse(["--ds_config", str(ROOT / "ds_configs" / "b1_t4.json")], 1)
    zero = ds_config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"
    assert settings.activation_checkpointing


def test_moe_configs_avoid_zero_3_and_split_the_experts():
    settings, ds_config = parse(["--ds_config", str(ROOT / "ds_configs" / "b7_moe_8gpu.json")], 8)
    assert ds_config["zero_optimization"]["stage"] == 2 and settings.model["moe_ep_size"] == 8
    config = model_config("b7", "moe", 32000, moe_ep_size=8)
    assert parameter_counts(config).total > 30e9
    with pytest.raises(ConfigError, match=re.escape("arch hybrid: DeepSpeed MoE does not run under ZeRO-3; use "
                                                    "zero_optimization stage 1 or 2 (with expert parallelism)")):
        parse(["--ds_config", str(ROOT / "ds_configs" / "b7_8gpu.json"), "--arch", "hybrid"], 8)


def test_bf16_is_refused_below_compute_capability_8():
    bf16 = {"bf16": {"enabled": True}}
    with pytest.raises(ConfigError, match="compute capability 8.0 or newer; this one is 7.5"):
        check_precision(bf16, (7, 5))
    check_precision(bf16, (8, 0))
    check_precision({"fp16": {"enabled": True}}, (7, 5))
    check_precision(bf16, None)  # CPU


# (micro, accumulation, train_batch_size, precision, ZeRO stage, optimizer offload), read off the JSON files by hand
SHIPPED = {
    "debug_cpu.json": (16, 1, None, "fp32", 1, "none"),
    "b1_t4.json": (4, 64, 256, "fp16", 2, "cpu"),
    "b1_h100.json": (8, 32, 256, "bf16", 1, "none"),
    "b7_8gpu.json": (2, 16, 256, "bf16", 3, "none"),
    "b7_moe_8gpu.json": (1, 32, 256, "bf16", 2, "cpu"),
}


@pytest.mark.parametrize("name", SHIPPED)
def test_the_reader_reads_the_shipped_configs(name):
    layout = reader.read(reader.load(str(ROOT / "ds_configs" / name)))
    assert (layout.micro_batch, layout.accumulation, layout.train_batch_size, layout.precision, layout.zero_stage,
            layout.offload_optimizer) == SHIPPED[name]
    assert layout.offload_param == "none" and layout.half_precision == (SHIPPED[name][3] != "fp32")
    assert layout.implied_world_size() == (None if name == "debug_cpu.json" else 256 // (layout.rows_per_rank_step))


def test_the_reader_knows_deepspeed_s_spellings_and_defaults():
    layout = reader.read({"train_micro_batch_size_per_gpu": 2, "bfloat16": {"enabled": True},
                          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert (layout.accumulation, layout.precision, layout.offload_param, layout.offload_optimizer) == (
        1, "bf16", "nvme", "none")
    assert reader.read({"train_micro_batch_size_per_gpu": 1}).zero_stage == 0  # no ZeRO section: stage 0


@pytest.mark.parametrize("config, world_size, message", [
    ({}, None, "must set train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_gpu": 2.5}, None, "batch sizes must be positive integers: "
                                                     "train_micro_batch_size_per_gpu=2.5"),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": True}, None,
     "gradient_accumulation_steps=True"),
    ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8}, 2, "train_batch_size 8 != "
     "train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 1 x world size 2 = 4"),
    ({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "bfloat16": {"enabled": True}}, None,
     "fp16 and bf16 are both enabled"),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": True}}, None,
     "zero_optimization.stage True is not one of 0, 1, 2, 3"),
])
def test_the_reader_names_what_is_wrong(config, world_size, message):
    found = reader.problems(config, world_size)
    assert any(message in p for p in found), found
    if world_size is None:  # read() raises the same problems, as one line
        with pytest.raises(ConfigError) as error:
            reader.read(config)
        assert message in str(error.value)


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name != "debug_cpu.json"], ids=lambda p: p.name)
def test_gpu_configs_leave_deepspeed_its_fused_adam(path):
    # DeepSpeed builds its fused CUDA Adam (FusedAdam; DeepSpeedCPUAdam where the optimizer is offloaded) for "Adam"
    # and "AdamW" unless "torch_adam" asks for torch's; only the CPU config, where FusedAdam cannot run, asks.
    optimizer = json.loads(path.read_text())["optimizer"]
    assert optimizer["type"] in ("Adam", "AdamW") and not optimizer["params"].get("torch_adam", False)
    assert json.loads((ROOT / "ds_configs" / "debug_cpu.json").read_text())["optimizer"]["params"]["torch_adam"]


def test_a_resume_on_another_number_of_processes_keeps_the_checkpoints_global_batch():
    """16 rows a step, written on 2 processes (micro-batch 4 x accumulation 2): on 1 process the accumulation
    doubles, with another micro-batch it is re-derived from that; a global batch that does not split is refused in
    one line naming a micro-batch that would."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16}
    assert reader.keep_global_batch(config, 16, 2) is config  # the same layout: nothing to re-derive
    one = reader.keep_global_batch(config, 16, 1, written_on=2)
    assert (one["train_micro_batch_size_per_gpu"], one["gradient_accumulation_steps"]) == (4, 4)
    assert "train_batch_size" not in one and config["train_batch_size"] == 16  # the caller's config is untouched
    assert reader.read(one).rows_per_rank_step == 16
    two = reader.keep_global_batch(config, 16, 1, micro_batch=8)
    assert (two["train_micro_batch_size_per_gpu"], two["gradient_accumulation_steps"]) == (8, 2)
    with pytest.raises(ConfigError, match="global batch of 16 rows does not split into micro-batches of 4 on 3 "
                                          "processes; pass a --micro_batch that divides 5"):
        reader.keep_global_batch(config, 16, 3)
