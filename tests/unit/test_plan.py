"""The planner: its memory model against stored and fresh measurements, fit decisions, throughput bounds and
costs."""

import json
import re

import pytest
from helpers.common import ROOT

from adaptive_ds.hardware import DEVICES
from adaptive_ds.presets import PRESETS
from adaptive_ds.tools.plan import SCENARIOS, main, plan, plan_config, validation_markdown, validation_table
from adaptive_ds.tools.plan_advice import advise


def _ds(name):
    return json.loads((ROOT / "ds_configs" / name).read_text())


def test_predicted_peaks_are_within_20_percent_of_every_stored_measurement():
    rows = validation_table()
    assert len(rows) >= 4 and {"cpu", "cuda"} <= {r["device"] for r in rows}
    for row in rows:
        assert abs(row["error"]) <= 0.20, row


def test_the_gpu_rows_are_an_external_reference_loaded_from_their_files():
    files = sorted((ROOT / "benchmarks" / "external").glob("t4_fit_mb*.json"))
    rows = [row for row in validation_table() if row["device"] == "cuda"]
    assert len(files) == len(rows) == 2
    for path, row in zip(files, rows, strict=True):
        text = path.read_text()
        figures, provenance = json.loads(text)["figures"], json.loads(text)["provenance"]
        assert row["measured_gib"] == figures["peak_alloc_GiB"] and row["micro_batch"] == figures["micro_batch"]
        assert row["preset"] == "b1" and row["arch"] == "dense"  # the independent model has b1's dimensions
        model = provenance["model"]
        assert (model["hidden_size"], model["num_hidden_layers"], model["intermediate_size"]) == (
            PRESETS["b1"].hidden_size, PRESETS["b1"].num_hidden_layers, PRESETS["b1"].intermediate_size)
        assert "external reference" in row["source"] and "not this project's code" in row["source"]
        assert {"what", "hardware", "software", "date"} <= set(provenance)
        assert not re.search(r'(^|[\s"(`])/\w', text)  # no absolute path of the machine it was measured on
    assert "external reference: an independent 1.1B Llama, not this project's code" in validation_markdown()


def test_b1_fits_a_t4_only_with_offload_which_the_usual_t4_host_cannot_hold():
    offload = plan("b1", "dense", "t4", _ds("b1_t4.json"), activation_checkpointing=True)
    # 18 bytes per parameter in CPU RAM: fp32 master weights and gradient partition, Adam's two moments, and the fp16
    # copy of the partition the updated weights go back through; and one fp16 gradient buffer the size of the
    # largest parameter, b1's 32,000 x 2,048 embedding (DeepSpeed's stage_1_and_2.py, `cpu_offload`)
    host = offload.total_parameters * 18 + 32000 * 2048 * 2
    assert offload.fits and offload.cpu_states_gib == pytest.approx(host / 2**30)
    assert not offload.runs and "18.6 GiB of CPU RAM per GPU, more than the 16 GiB per GPU of the usual t4 host, " \
        "AWS g4dn.xlarge" in offload.verdict
    no_offload = _ds("b1_t4.json")
    del no_offload["zero_optimization"]["offload_optimizer"]
    without = plan("b1", "dense", "t4", no_offload, activation_checkpointing=True)
    assert not without.fits
    assert [a.text.split(" ->")[0] for a in advise("b1", "dense", "t4", no_offload) if a.gpus > 1] == [
        "ZeRO-3 across 2 GPUs"]


def test_throughput_bound_and_cost_follow_from_the_flops():
    p = plan("b1", "dense", "a100", _ds("b1_a100.json"), tokens=10**9, mfu=0.4, price=2.0)
    assert p.tokens_per_s_bound == pytest.approx(DEVICES["a100"].peak_tflops * 1e12 / p.flops_per_token)
    assert p.tokens_per_s_projected == pytest.approx(0.4 * p.tokens_per_s_bound)
    assert p.hours == pytest.approx(1e9 / p.tokens_per_s_projected / 3600)
    assert p.cost_usd == pytest.approx(2.0 * p.hours)


def test_expert_parallelism_and_zero_3_divide_the_states():
    one = plan("b7", "moe", "h100", _ds("b7_moe_8gpu.json"), gpus=8, model_overrides={"moe_ep_size": 1})
    eight = plan("b7", "moe", "h100", _ds("b7_moe_8gpu.json"), gpus=8, model_overrides={"moe_ep_size": 8})
    assert eight.model_states_gib < 0.7 * one.model_states_gib  # experts / 8; the dense part stays
    assert eight.fits and eight.cpu_states_gib > 50  # the shipped config offloads the optimizer to fit
    dense_z3 = plan("b7", "dense", "h100", _ds("b7_8gpu.json"), gpus=8, activation_checkpointing=True)
    dense_z1 = plan("b7", "dense", "h100", {**_ds("b7_8gpu.json"), "zero_optimization": {"stage": 1}}, gpus=8)
    # bf16: ZeRO-3 shards all 2 + 2 + 16 bytes over 8 ranks; ZeRO-1 only the 16 optimizer bytes
    assert dense_z3.model_states_gib == pytest.approx(dense_z1.model_states_gib * (20 / 8) / (2 + 2 + 16 / 8))
    assert dense_z3.activations_with_checkpointing_gib < dense_z3.activations_without_checkpointing_gib


def test_cli_prints_the_plan(capsys):
    main(["--preset", "b1", "--arch", "moe", "--gpu", "t4", "--ds_config", str(ROOT / "ds_configs" / "b1_t4.json")])
    out = capsys.readouterr().out
    assert "projection" in out and "predicted peak" in out and "per 1B tokens" in out


def test_a_ds_config_file_is_planned_as_training_runs_it():
    # GPU count from the batch sizes; checkpointing and expert parallelism from the adaptive_ds block
    moe = plan_config("b7", "moe", "h100", str(ROOT / "ds_configs" / "b7_moe_8gpu.json"))
    assert moe.gpus == 8 and moe.fits
    assert moe.activations_gib == moe.activations_with_checkpointing_gib
    one = plan("b7", "moe", "h100", _ds("b7_moe_8gpu.json"), gpus=8, activation_checkpointing=True)
    assert moe.model_states_gib < 0.7 * one.model_states_gib  # ep 8 from the block, not the default 1


def test_write_regenerates_the_tables_and_keeps_the_rest(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nmeasured text\n\n<!-- plan:projections -->\nstale\n<!-- /plan:projections -->\n")
    main(["--write", str(md)])
    text = md.read_text()
    assert "measured text" in text and "stale" not in text and text.count("<!-- plan:projections -->") == 1
    assert "planner's model, not measurements" in text and "<!-- plan:validation -->" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line and " x " in line]
    assert len(rows) == sum(len(archs) for _, archs, _, _ in SCENARIOS)
    b1_t4 = next(r for r in rows if r.startswith("| dense |") and "b1_t4.json" in r)
    assert "fits" in b1_t4 and "does not fit" not in b1_t4
    assert any("does not fit" in r for r in rows if "| moe |" in r and "b1_t4.json" in r)
    with pytest.raises(SystemExit, match="not found"):
        main(["--write", str(tmp_path / "missing.md")])


def _layout(precision: str, zero_stage: int, offload: bool):
    from adaptive_ds.tools.planner import Layout

    return Layout(micro_batch=1, zero_stage=zero_stage, offload_optimizer=offload,
                  half_precision=precision != "fp32", activation_checkpointing=False)


def test_the_offloaded_states_are_what_deepspeed_allocates_for_them():
    """Hand-worked from DeepSpeed's stage_1_and_2.py with `cpu_offload`, 1,000 fp16 parameters under ZeRO-2: on
    the GPU the fp16 weights (2,000 bytes) and their gradients (2,000; partitioned over the ranks); in CPU RAM from
    initialisation the fp32 master partition (4,000), its fp32 gradient (4,000, made at initialisation for the
    offload) and the fp16 copy the updated weights go back through (2,000); at the first step CPU Adam's two fp32
    moments (8,000). Over two ranks each holds half of what ZeRO-2 partitions."""
    from adaptive_ds.tools.planner import model_state_bytes, state_bytes

    offload = _layout("fp16", 2, offload=True)
    one = state_bytes(1000, 0, 1, offload, 1)
    assert (one.weights, one.gradients, one.optimizer, one.moments, one.offloaded) == (2000, 2000, 10_000, 8000, True)
    assert model_state_bytes(1000, 0, 1, offload, 1) == (4000, 18_000)
    assert model_state_bytes(1000, 0, 1, offload, 1, optimizer_step=False) == (4000, 10_000)
    assert model_state_bytes(1000, 0, 1, offload, 2) == (2000 + 1000, 9000)
    # not offloaded: the master copy from initialisation, then the gradient partition and the moments at the step
    assert model_state_bytes(1000, 0, 1, _layout("fp16", 2, offload=False), 1) == (2000 + 2000 + 16_000, 0)
    assert model_state_bytes(1000, 0, 1, _layout("fp32", 0, offload=False), 1) == (4000 + 4000 + 8000, 0)


@pytest.mark.parametrize("preset, arch", [("debug", "dense"), ("debug", "moe"), ("debug", "hybrid"), ("b1", "dense"),
                                          ("b7", "moe")])
def test_the_largest_parameter_is_the_built_models(preset, arch):
    """The size of ZeRO-Offload's two gradient buffers, against the model itself (built on the meta device)."""
    import torch

    from adaptive_ds.models import AdaptiveDSForCausalLM
    from adaptive_ds.presets import model_config
    from adaptive_ds.tools.planner import largest_parameter

    config = model_config(preset, arch, 32000)
    with torch.device("meta"):
        model = AdaptiveDSForCausalLM(config)
    assert largest_parameter(config) == max(p.numel() for p in model.parameters())


@pytest.mark.parametrize("optimizer_step", [True, False])
def test_a_cpu_process_with_the_optimizer_offloaded_holds_the_states_of_one_phase_at_a_time(optimizer_step):
    """b1 at 2 layers on b1_t4.json's engine, one process on CPU, hand-worked from the built model's P parameters and
    its largest tensor L: it holds the fp16 weights (2P), the host's states from initialisation (10P: fp32 master and
    gradient partition, fp16 staging copy) and the two fp16 gradient buffers (2 x 2L); then either the backward's fp16
    gradients (2P) and activations, or the step's Adam moments (8P), the larger. CPU Adam updates in place: no
    temporaries of torch's AdamW; the flatten copy is gone by then."""
    import torch

    from adaptive_ds.models import AdaptiveDSForCausalLM
    from adaptive_ds.presets import model_config

    layers = {"num_hidden_layers": 2}
    with torch.device("meta"):
        model = AdaptiveDSForCausalLM(model_config("b1", "dense", 32000, **layers))
    params, largest = sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())
    p = plan("b1", "dense", "h200", _ds("b1_t4.json"), model_overrides=layers, cpu_process=True, seq_len=256,
             activation_checkpointing=True, optimizer_step=optimizer_step)
    activations = p.activations_gib * 2**30
    after = 8 * params if optimizer_step else 2 * params + activations
    assert p.peak_gib * 2**30 == pytest.approx(2 * params + 10 * params + 4 * largest + after, rel=1e-9)
    assert p.cpu_states_gib * 2**30 == pytest.approx((18 if optimizer_step else 10) * params + 2 * largest, rel=1e-9)


def test_b1_on_a_t4_with_the_host_ram_given_refuses_a_small_host_and_takes_a_large_one(capsys):
    """--host_ram_gib: the machine's RAM, shared by its GPUs. b1_t4.json offloads 18.6 GiB per GPU: a 12.7 GiB
    host (a Colab T4's) is refused and named as given; a 29 GiB one (a Kaggle T4's) runs; 64 GiB shared by 4 GPUs
    is 16 per GPU, refused."""
    b1_t4 = ["--preset", "b1", "--gpu", "t4", "--ds_config", str(ROOT / "ds_configs" / "b1_t4.json")]
    main([*b1_t4, "--host_ram_gib", "12.7"])
    out = capsys.readouterr().out
    assert ("fits the GPU, but the offloaded optimizer needs 18.6 GiB of CPU RAM per GPU, more than the 12.7 GiB per "
            "GPU of the host given, --host_ram_gib 12.7 shared by 1 GPU") in out
    assert "a host with at least 19 GiB of CPU RAM per GPU (the host given has 12.7)" in out and "usual" not in out
    main([*b1_t4, "--host_ram_gib", "29", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert planned["runs"] and planned["host_memory_gib"] == 29 and planned["advice"] == []
    main([*b1_t4, "--host_ram_gib", "64", "--gpus_per_host", "4", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert not planned["runs"] and planned["host_memory_gib"] == 16
    assert planned["host_detail"] == "--host_ram_gib 64 shared by 4 GPUs"


@pytest.mark.parametrize("ds_config, named", [
    ("b1_t4.json", "host RAM: 18.6 GiB of CPU RAM per GPU for the offloaded optimizer, of the 16 GiB per GPU of the "
                   "usual t4 host, AWS g4dn.xlarge (1 GPU, 16 GiB) (--host_ram_gib: yours)"),
    ("debug_200m_t4.json", "host RAM: nothing offloaded to CPU RAM; host assumed: 16 GiB per GPU of the usual t4 "
                           "host, AWS g4dn.xlarge (1 GPU, 16 GiB) (--host_ram_gib: yours)"),
])
def test_the_printed_plan_names_the_host_it_assumes_whether_or_not_it_offloads(ds_config, named, capsys):
    preset = ds_config.split("_t4")[0]
    main(["--preset", preset, "--gpu", "t4", "--ds_config", str(ROOT / "ds_configs" / ds_config)])
    assert f"  {named}\n" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--host_ram_gib", "0"], "--host_ram_gib 0.0: the CPU RAM of each machine in GiB, a positive number"),
    (["--host_ram_gib", "inf"], "--host_ram_gib inf: the CPU RAM of each machine in GiB, a positive number"),
    (["--gpus_per_host", "2"], "--gpus_per_host divides --host_ram_gib among a machine's GPUs: pass --host_ram_gib"),
    (["--host_ram_gib", "64", "--gpus_per_host", "0"], "--gpus_per_host 0: the GPUs on each machine, a positive"),
])
def test_bad_host_flags_are_refused_in_one_line(flags, message):
    with pytest.raises(SystemExit) as raised:
        main(["--preset", "b1", "--gpu", "t4", *flags])
    assert str(raised.value).startswith(f"error: {message}") and "\n" not in str(raised.value)
