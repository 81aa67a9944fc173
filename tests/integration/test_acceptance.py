"""`python -m adaptive_ds.tools.acceptance` without CUDA: a dry run of every stage at tiny sizes on CPU, with the
shipped configs' fp16, bf16 and optimizer offload wherever DeepSpeed's CPU accelerator runs them, so the GPU
acceptance command cannot rot unseen; and one stage in a process of its own, as a CUDA machine runs each."""

import json
import math
import sys

import pytest
from deepspeed.accelerator import get_accelerator
from helpers.shipped import shipped

from adaptive_ds.tools import acceptance
from adaptive_ds.tools.acceptance import DRY_RUN_CASES, STAGES, TARGETS

ACCELERATOR = get_accelerator()


@pytest.mark.slow
def test_the_acceptance_command_dry_runs_every_stage_on_cpu(tmp_path, run_command):
    out, md = tmp_path / "acceptance.json", tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    done = run_command([sys.executable, "-m", "adaptive_ds.tools.acceptance", "--dry_run", "--out", str(out),
                        "--benchmarks_md", str(md)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dry run of every stage" in done.stderr
    assert done.stdout.strip().splitlines()[-1] == "dry run: every stage completed; no target measured"
    report = json.loads(out.read_text())
    assert report["dry_run"] and list(report["stages"]) == list(STAGES)
    stages = report["stages"]
    assert all(stage["ok"] for stage in stages.values())
    assert [v["verdict"] for v in report["targets"]] == ["not measured (dry run)"] * len(TARGETS)
    assert "6 tests collected" in stages["gpu_tests"]["summary"]
    assert stages["b1_t4"]["steps"] == 3 and math.isfinite(stages["b1_t4"]["train_loss"])
    # the stage's own files by their names: no path of the machine it ran on goes into a published report
    assert stages["b1_t4"]["command"] == ("python -m adaptive_ds.training --ds_config b1_t4_stage.json "
                                          "--output_dir b1_t4_stage_run --gpu_memory_gib 15")
    # the shipped configs' precision, loss scaling and offload, wherever DeepSpeed's accelerator here runs them
    b1_t4, b7 = shipped("b1_t4.json"), shipped("b7_a100_40gb_offload.json")
    assert stages["b1_t4"]["ds_config"]["zero_optimization"] == b1_t4["zero_optimization"]  # ZeRO-2, CPU Adam
    assert stages["b7"]["ds_config"]["zero_optimization"] == b7["zero_optimization"]
    if ACCELERATOR.is_fp16_supported():
        assert stages["b1_t4"]["ds_config"]["fp16"] == b1_t4["fp16"]
        assert stages["b1_t4"]["loss_scale"] == 2.0 ** b1_t4["fp16"]["initial_scale_power"]  # it ran in fp16
    if ACCELERATOR.is_bf16_supported():
        assert stages["b7"]["ds_config"]["bf16"] == b7["bf16"] and stages["benchmark"]["precision"] == "bf16"
    assert list(stages["benchmark"]["results"]) == DRY_RUN_CASES
    assert stages["benchmark"]["results"]["dense_compile"]["graph_breaks"] == 0
    assert len(stages["b7"]["losses"]) == 2 == stages["b7"]["finite_loss_steps"]
    assert stages["b7"]["predicted_peak_gib"] > 0
    text = md.read_text()
    assert "<!-- acceptance:dry -->" in text and "dry run on CPU" in text and report["commit"] in text
    assert "| dense debug_200m >= 45% MFU | benchmark | >= 45.0% | - | not measured (dry run) |" in text
    assert "<!-- throughput:debug:cpu -->" in text


@pytest.mark.slow
def test_on_a_cuda_machine_a_stage_runs_in_its_own_process_and_reports_back(tmp_path, monkeypatch):
    """The path a GPU run takes (a dry run without CUDA runs its stages in one process): here the cheapest stage,
    b7's dry run, through `--stage` in a child process that sees no CUDA."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = acceptance._run_stage("b7", True, tmp_path, micro_batch=2)
    assert result["ok"], result.get("error")
    assert len(result["losses"]) == 2 and result["seconds"] > 0 and (tmp_path / "b7.json").exists()
