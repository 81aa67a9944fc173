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
    assert offload.fits and offload.cpu_states_gib * 2**30 == B1_T4_PINNED_HOST_BYTES
    assert not offload.runs and "31.0 GiB of CPU RAM per GPU, more than the 16 GiB per GPU of the usual t4 host, " \
        "AWS g4dn.xlarge" in offload.verdict
    no_offload = _ds("b1_t4.json")
    del no_offload["zero_optimization"]["offload_optimizer"]
    without = plan("b1", "dense", "t4", no_offload, activation_checkpointing=True)
    assert not without.fits
    assert [a.text.split(" ->")[0] for a in advise("b1", "dense", "t4", no_offload) if a.gpus > 1] == [
        "ZeRO-3 across 2 GPUs"]


# b1 on b1_t4.json (fp16, ZeRO-2, CPU Adam, pin_memory, accumulation 64) on one T4, worked by hand from DeepSpeed's
# stage_1_and_2.py and torch's CachingHostAllocator (each pinned allocation rounded up to the next power of two).
# b1: P = 1,100,048,384 parameters; the no-decay group, 22 x 2 RMSNorms of 2,048 and the final one, 92,160; the decay
# group the other 1,099,956,224. Pinned, per group: the fp32 master partition and its fp32 gradient (4,399,824,896
# bytes each -> 2^33; 368,640 -> 2^19) and the fp16 copy (2,199,912,448 -> 2^32; 184,320 -> 2^18); the fp16 gradient
# buffer of the largest parameter, the 32,000 x 2,048 embedding (131,072,000 -> 2^27); with accumulation 64 an fp16
# buffer per parameter: the embedding and the LM head (2^27 each), per layer q and o (2,048 x 2,048: 2^23 each), k and
# v (256 x 2,048: 2^20 each), gate, up and down (5,632 x 2,048 = 23,068,672 bytes -> 2^25 each) and two norms (4,096
# each), and the final norm (4,096). Not pinned: CPU Adam's two fp32 moments (8P).
_B1_LAYER = 2 * 2**23 + 2 * 2**20 + 3 * 2**25 + 2 * 4096
B1_T4_PINNED_HOST_BYTES = (2 * 2**33 + 2**32 + 2 * 2**19 + 2**18 + 2**27 + 8 * 1_100_048_384
                           + 22 * _B1_LAYER + 2 * 2**27 + 4096)


def test_pinned_offload_buffers_are_counted_as_torchs_pinned_allocator_takes_them():
    """The same config unpinned: DeepSpeed's 18 bytes per parameter, the gradient buffer, and the accumulation
    buffers (2 bytes per parameter); pinned (as shipped), each pinned buffer at the next power of two; and a CPU
    process's peak never pinned (DeepSpeed's CPU accelerator pins nothing)."""
    params, largest = 1_100_048_384, 32000 * 2048
    pinned = plan("b1", "dense", "t4", _ds("b1_t4.json"), activation_checkpointing=True)
    unpinned_config = _ds("b1_t4.json")
    unpinned_config["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    unpinned = plan("b1", "dense", "t4", unpinned_config, activation_checkpointing=True)
    assert unpinned.cpu_states_gib * 2**30 == pytest.approx(18 * params + 2 * largest + 2 * params, rel=1e-12)
    assert unpinned.accumulation_buffers_gib * 2**30 == pytest.approx(2 * params) and unpinned.pinned_rounding_gib == 0
    assert pinned.pinned_rounding_gib == pytest.approx(pinned.cpu_states_gib - unpinned.cpu_states_gib)
    assert (pinned.accumulation, pinned.accumulation_buffers_gib) == (64, unpinned.accumulation_buffers_gib)
    one_step = {**_ds("b1_t4.json"), "gradient_accumulation_steps": 1, "train_batch_size": 4}
    alone = plan("b1", "dense", "t4", one_step, activation_checkpointing=True)
    assert alone.accumulation_buffers_gib == 0 and alone.cpu_states_gib * 2**30 == (
        B1_T4_PINNED_HOST_BYTES - 22 * _B1_LAYER - 2 * 2**27 - 4096)
    cpu = plan("b1", "dense", "t4", _ds("b1_t4.json"), activation_checkpointing=True, cpu_process=True)
    assert cpu.pinned_rounding_gib == 0 and cpu.cpu_states_gib == pytest.approx(unpinned.cpu_states_gib)


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


def _layout(precision: str, zero_stage: int, offload: bool, accumulation: int = 1):
    from adaptive_ds.tools.planner import Layout

    return Layout(micro_batch=1, zero_stage=zero_stage, offload_optimizer=offload,
                  half_precision=precision != "fp32", activation_checkpointing=False, accumulation=accumulation)


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
    # accumulation 2: an fp16 buffer per parameter of the rank's partition from the first micro-step (2,000; 1,000
    # on each of two ranks), before the first step too; none without offload, none under ZeRO-3's offload
    accumulating = _layout("fp16", 2, offload=True, accumulation=2)
    assert state_bytes(1000, 0, 1, accumulating, 1).accumulated == 2000
    assert model_state_bytes(1000, 0, 1, accumulating, 1, optimizer_step=False) == (4000, 12_000)
    assert model_state_bytes(1000, 0, 1, accumulating, 2) == (3000, 10_000)
    assert state_bytes(1000, 0, 1, _layout("fp16", 2, offload=False, accumulation=2), 1).accumulated == 0
    assert state_bytes(1000, 0, 1, _layout("fp16", 3, offload=True, accumulation=2), 1).accumulated == 0


@pytest.mark.parametrize("config, gpus, accumulation", [
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}, 4, 8),
    ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 64}, 4, 8),  # DeepSpeed derives 64 / (2 x 4)
    ({"train_micro_batch_size_per_gpu": 2}, 4, 1),
])
def test_the_layout_reads_the_accumulation_deepspeed_runs(config, gpus, accumulation):
    from adaptive_ds.tools.planner import Layout

    assert Layout.from_ds_config(config, False, gpus).accumulation == accumulation


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


@pytest.mark.parametrize("micro_batch, seq_len, checkpointing, phase", [(1, 256, True, "step"),
                                                                         (8, 2048, False, "backward")])
@pytest.mark.parametrize("optimizer_step", [True, False])
def test_a_cpu_process_with_the_optimizer_offloaded_holds_the_states_of_one_phase_at_a_time(
        micro_batch, seq_len, checkpointing, phase, optimizer_step):
    """b1 at 2 layers on b1_t4.json's engine at accumulation 1 (the width measurement's), one process on CPU,
    hand-worked from the built model's P parameters and its largest tensor L: from initialisation it holds what a GPU
    would, the fp16 weights (2P) and the offload's GPU-side gradient buffer (2L), and the host's states (10P: fp32
    master and gradient partition, fp16 staging copy) and its gradient buffer (2L); then either the backward's fp16
    gradients (2P) and activations A (a GPU's), or the step's Adam moments (8P, the host's), the larger phase: 8P
    beats 2P + A at micro-batch 1 x 256 with checkpointing, and loses at 8 x 2048 without. The peak's host part is
    that phase's. CPU Adam updates in place: no temporaries of torch's AdamW; the flatten copy is gone by then."""
    import torch

    from adaptive_ds.models import AdaptiveDSForCausalLM
    from adaptive_ds.presets import model_config

    layers = {"num_hidden_layers": 2}
    with torch.device("meta"):
        model = AdaptiveDSForCausalLM(model_config("b1", "dense", 32000, **layers))
    params, largest = sum(p.numel() for p in model.parameters()), max(p.numel() for p in model.parameters())
    engine = {**_ds("b1_t4.json"), "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1}
    engine.pop("train_batch_size")
    p = plan("b1", "dense", "h200", engine, model_overrides=layers, cpu_process=True, seq_len=seq_len,
             activation_checkpointing=checkpointing, optimizer_step=optimizer_step)
    activations = p.activations_gib * 2**30
    backward = (2 * params + 2 * largest + 2 * params + activations, 10 * params + 2 * largest)
    step = (2 * params + 2 * largest, 10 * params + 2 * largest + 8 * params)
    assert (sum(step) > sum(backward)) == (phase == "step")
    device, host = step if optimizer_step and phase == "step" else backward
    assert p.peak_gib * 2**30 == pytest.approx(device + host, rel=1e-9)
    assert p.peak_host_gib * 2**30 == pytest.approx(host, rel=1e-9)
    assert p.cpu_states_gib * 2**30 == pytest.approx((18 if optimizer_step else 10) * params + 2 * largest, rel=1e-9)


def test_b1_on_a_t4_with_the_host_ram_given_refuses_a_small_host_and_takes_a_large_one(capsys):
    """--host_ram_gib: the machine's RAM, shared by its GPUs. b1_t4.json keeps 31.0 GiB per GPU in host RAM
    (`B1_T4_PINNED_HOST_BYTES`): a 12.7 GiB host (a Colab T4's) is refused and named as given, and so is a 29 GiB one
    (a Kaggle T4's); a 32 GiB one runs; 64 GiB shared by 4 GPUs is 16 per GPU, refused. An advice on more GPUs than
    the machine given has keeps its share per GPU (more such machines), and says so."""
    b1_t4 = ["--preset", "b1", "--gpu", "t4", "--ds_config", str(ROOT / "ds_configs" / "b1_t4.json")]
    main([*b1_t4, "--host_ram_gib", "12.7"])
    out = capsys.readouterr().out
    assert ("fits the GPU, but the offloaded optimizer needs 31.0 GiB of CPU RAM per GPU, more than the 12.7 GiB per "
            "GPU of the host given, --host_ram_gib 12.7 on each machine of 1 GPU") in out
    assert "a host with at least 32 GiB of CPU RAM per GPU (the host given has 12.7)" in out and "usual" not in out
    assert "ZeRO-3 across 2 GPUs" in out and "shared by" not in out
    main([*b1_t4, "--host_ram_gib", "29", "--json"])
    assert not json.loads(capsys.readouterr().out)["runs"]
    main([*b1_t4, "--host_ram_gib", "32", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert planned["runs"] and planned["host_memory_gib"] == 32 and planned["advice"] == []
    main([*b1_t4, "--host_ram_gib", "64", "--gpus_per_host", "4", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert not planned["runs"] and planned["host_memory_gib"] == 16
    assert planned["host_detail"] == "--host_ram_gib 64.0 on each machine of 4 GPUs"


@pytest.mark.parametrize("ds_config, named", [
    ("b1_t4.json", "host RAM: 31.0 GiB of CPU RAM per GPU for the offloaded optimizer, of the 16 GiB per GPU of the "
                   "usual t4 host, AWS g4dn.xlarge (1 GPU, 16 GiB) (--host_ram_gib: yours)\n    of which 2.0 GiB of "
                   "gradient accumulation buffers (accumulation 64: DeepSpeed keeps one per parameter in the training "
                   "precision); 10.4 GiB of pinned-memory rounding (pin_memory: torch's CUDA pinned allocator rounds "
                   "each pinned buffer up to the next power of two)"),
    ("debug_200m_t4.json", "host RAM: nothing offloaded to CPU RAM; host assumed: 16 GiB per GPU of the usual t4 "
                           "host, AWS g4dn.xlarge (1 GPU, 16 GiB) (--host_ram_gib: yours)"),
])
def test_the_printed_plan_names_the_host_it_assumes_whether_or_not_it_offloads(ds_config, named, capsys):
    preset = ds_config.split("_t4")[0]
    main(["--preset", preset, "--gpu", "t4", "--ds_config", str(ROOT / "ds_configs" / ds_config)])
    assert f"  {named}\n" in capsys.readouterr().out


def test_a_gpu_of_no_usual_host_names_the_flag_once(capsys):
    main(["--preset", "b1", "--gpu", "rtx3090", "--price", "0.5", "--ds_config",
          str(ROOT / "ds_configs" / "b1_t4.json")])
    line = next(line for line in capsys.readouterr().out.splitlines() if "host RAM:" in line)
    assert line.endswith("(no usual rtx3090 host is known: compare with the machine's, or pass --host_ram_gib)")
    assert line.count("--host_ram_gib") == 1


@pytest.mark.parametrize("flags, message", [
    (["--host_ram_gib", "0"], "--host_ram_gib 0: the CPU RAM of each machine in GiB, a finite number of at least 0.1"),
    (["--host_ram_gib", "1e-9"], "--host_ram_gib 1e-09: the CPU RAM of each machine in GiB, a finite number of at "
                                 "least 0.1"),
    (["--host_ram_gib", "inf"], "--host_ram_gib inf: the CPU RAM of each machine in GiB, a finite number"),
    (["--gpus_per_host", "2"], "--gpus_per_host divides --host_ram_gib among a machine's GPUs: pass --host_ram_gib"),
    (["--host_ram_gib", "64", "--gpus_per_host", "0"], "--gpus_per_host 0: the GPUs on each machine, a positive"),
    (["--validate", "--host_ram_gib", "64"], "--host_ram_gib plan one configuration; --validate and --write plan the "
                                             "measured and the shipped ones with their usual hosts"),
    (["--write", "BENCHMARKS.md", "--host_ram_gib", "64", "--gpus_per_host", "2"], "--host_ram_gib, --gpus_per_host "
                                                                                   "plan one configuration"),
])
def test_bad_host_flags_are_refused_in_one_line(flags, message, monkeypatch):
    monkeypatch.setattr("adaptive_ds.tools.plan.write_benchmarks", lambda path: pytest.fail("written"))
    monkeypatch.setattr("adaptive_ds.tools.plan.validation_table", lambda: pytest.fail("validated"))
    with pytest.raises(SystemExit) as raised:
        main(["--preset", "b1", "--gpu", "t4", *flags])
    assert str(raised.value).startswith(f"error: {message}") and "\n" not in str(raised.value)


@pytest.mark.parametrize("arch, shape, cap", [
    ("dense", {"num_hidden_layers": 2}, None),
    ("moe", {"num_hidden_layers": 3}, 100_000),  # one layer's experts above the cap: DeepSpeed's cut
    ("moe", {"num_hidden_layers": 3}, 400_000),  # whole layers under the cap
    ("hybrid", {"num_hidden_layers": 4, "moe_use_residual": True}, 150_000),
    ("moe", {"num_hidden_layers": 2, "moe_expert_granularity": 2, "moe_ep_size": 2}, 1_000_000),  # local experts
])
def test_the_optimizer_groups_are_the_ones_training_hands_deepspeed(arch, shape, cap):
    """Against the trainer's own param groups (`training.optim.parameter_groups` on the model prepared for DeepSpeed,
    the groups ZeRO flattens and partitions, and whose partitions the offload pins one by one)."""
    from adaptive_ds.models import AdaptiveDSForCausalLM
    from adaptive_ds.presets import model_config
    from adaptive_ds.tools.planner_host import optimizer_groups
    from adaptive_ds.training import moe_adapter
    from adaptive_ds.training.optim import DEEPSPEED_MOE_GROUP_CAP, parameter_groups

    config = model_config("debug", arch, 512, **shape)
    model = AdaptiveDSForCausalLM(config)
    moe_adapter.prepare(model)
    groups = parameter_groups(model, 0.1, cap or DEEPSPEED_MOE_GROUP_CAP)
    assert optimizer_groups(config, cap) == [(sum(p.numel() for p in g["params"]), bool(g.get("moe"))) for g in groups]


def test_a_pinned_allocation_is_the_next_power_of_two():
    from adaptive_ds.tools.planner_host import pinned_bytes

    assert [pinned_bytes(n) for n in (1, 5, 4096, 4097, 23_068_672)] == [1, 8, 4096, 8192, 2**25]


@pytest.mark.parametrize("preset, arch, name, gpus, model", [
    ("b1", "dense", "b1_t4.json", 1, {}),
    ("b1", "moe", "b1_t4.json", 4, {"moe_ep_size": 2}),
    ("b7", "hybrid", "b7_moe_8gpu.json", 8, {"moe_ep_size": 8}),
])
def test_the_host_buffers_one_by_one_add_up_to_the_per_parameter_count(preset, arch, name, gpus, model):
    """Unpinned, `planner_host`'s buffers (per param group, per parameter) hold what `state_bytes` counts per
    parameter: the pinned figure rounds the same buffers, no others."""
    from adaptive_ds.tools.planner import model_facts
    from adaptive_ds.tools.planner_host import offload_host_bytes

    config = _ds(name)
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
    block = {**config.get("adaptive_ds", {}).get("model", {}), **model}
    p = plan(preset, arch, "h100", config, gpus=gpus, model_overrides=block)
    facts = model_facts(preset, arch, 32000, block)
    assert p.accumulation > 1 and p.pinned_rounding_gib == 0
    assert p.cpu_states_gib * 2**30 == pytest.approx(
        offload_host_bytes(facts.config, True, p.accumulation, gpus, True, pinned=False), rel=1e-9)
