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
    # 16 bytes per parameter in CPU RAM: fp32 master weights and gradients, Adam's two moments
    assert offload.fits and offload.cpu_states_gib == pytest.approx(offload.total_parameters * 16 / 2**30)
    assert not offload.runs and "16.4 GiB of CPU RAM per GPU, more than the 16 GiB" in offload.verdict
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
