"""What only a CUDA machine can check; skipped elsewhere (conftest), run by `python -m adaptive_ds.tools.acceptance`.

The grouped GEMM against the per-expert path in bfloat16; fp16 training under DeepSpeed's loss scaler; bf16
training; a real CUDA out-of-memory under --gpu_memory_gib recovered in place; NCCL with one process; ZeRO-2
with the optimizer offloaded to DeepSpeed's CPU Adam.
"""

import copy
import json
import sys

import pytest
import torch
from helpers.common import ROOT, run_command

from adaptive_ds.models.moe import MoEFeedForward, use_grouped_mm

pytestmark = pytest.mark.gpu
RECORDER = str(ROOT / "tests" / "helpers" / "train_recording_steps.py")


def _edit(path: str, **top_level) -> str:
    """Add or replace top-level keys of the ds_config at `path` (write_ds_config writes the adaptive_ds block)."""
    with open(path) as f:
        config = json.load(f)
    config.update(top_level)
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _train(tmp_path, config: str, *extra: str, launcher: tuple[str, ...] = (sys.executable,)) -> tuple[list, dict]:
    """Run the training command through the step recorder: (steps recorded, summary.json)."""
    out, record = tmp_path / "run", tmp_path / "steps.json"
    done = run_command([*launcher, RECORDER, str(record), "--ds_config", config, "--output_dir", str(out), *extra])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(record.read_text()), json.loads((out / "summary.json").read_text())


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_grouped_gemm_equals_the_per_expert_path_in_bf16(tiny_config):
    layer = MoEFeedForward(tiny_config("moe", hidden_size=256, intermediate_size=512, num_local_experts=8,
                                       moe_grouped_gemm="always")).cuda().bfloat16()
    torch.nn.init.normal_(layer.moe.deepspeed_moe.gate.wg.weight, std=0.5)
    reference = copy.deepcopy(layer)
    reference.experts.grouped_gemm = "never"
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    assert use_grouped_mm(x, "always") and not use_grouped_mm(x, "never")
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    (out, routing), (ref, ref_routing) = layer(xs[0]), reference(xs[1])
    torch.testing.assert_close(routing.expert_counts, ref_routing.expert_counts, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(layer.named_parameters(), reference.parameters(), strict=True):
        scale = q.grad.float().abs().max().clamp_min(1e-3)
        assert (p.grad.float() - q.grad.float()).abs().max() / scale < 2e-2, name


def test_fp16_overflow_steps_are_skipped_and_counted(tmp_path, tiny_ds_config):
    # A loss scale of 2^32 overflows fp16 gradients: DeepSpeed skips the step and halves the scale until it fits.
    config = _edit(tiny_ds_config(max_steps=30, log_steps=1),
                   fp16={"enabled": True, "initial_scale_power": 32, "loss_scale_window": 1000, "hysteresis": 1})
    steps, summary = _train(tmp_path, config)
    assert steps[0]["device"].startswith("cuda") and steps[0]["loss_scale"] == 2.0**32
    assert steps[1]["skipped_steps"] == 1 and steps[1]["overflow_run"] == 1 and steps[1]["loss_scale"] == 2.0**31
    assert steps[-1]["overflow_run"] == 0 and steps[-1]["skipped_steps"] < len(steps) - 1  # it recovered
    assert summary["steps"] == 30 and summary["validation_loss"] == summary["validation_loss"]  # not NaN


def test_bf16_trains(tmp_path, tiny_ds_config):
    config = _edit(tiny_ds_config(max_steps=20, log_steps=5), bf16={"enabled": True})
    steps, summary = _train(tmp_path, config, "--arch", "moe")
    losses = [m["loss"] for m in _jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert steps[0]["device"].startswith("cuda") and steps[-1]["skipped_steps"] == 0
    assert losses[-1] < losses[0] - 0.5, losses


def test_a_real_cuda_out_of_memory_is_recovered_in_place(tmp_path, tiny_ds_config):
    # debug_200m at micro-batch 16 x 2048 tokens in fp32 needs far more activations than an 8 GiB cap holds: the
    # first step really fails in the CUDA allocator, and the controller halves the micro-batch until it fits (2).
    config = tiny_ds_config(micro=16, accum=1, preset="debug_200m", max_steps=2, log_steps=1,
                            eval_batches=1)
    steps, summary = _train(tmp_path, config, "--gpu_memory_gib", "8")
    decisions = _jsonl(tmp_path / "run" / "decisions.jsonl")
    assert decisions and all("CUDA out of memory" in d["trigger"]["error"] for d in decisions), decisions
    assert decisions[0]["step"] == 1 and decisions[0]["trigger"]["micro_batch"] == 16
    knobs = decisions[-1]["knobs"]
    assert knobs["micro_batch"] < 16 and knobs["micro_batch"] * knobs["accumulation"] == 16
    assert summary["steps"] == 2


def test_nccl_with_one_process(tmp_path, tiny_ds_config):
    config = tiny_ds_config(max_steps=3)
    steps, summary = _train(tmp_path, config, launcher=("torchrun", "--nproc_per_node", "1"))
    assert steps[0]["backend"] == "nccl" and steps[0]["device"] == "cuda:0"
    assert summary["steps"] == 3


def test_zero2_with_cpu_adam_offload(tmp_path, tiny_ds_config):
    config = _edit(tiny_ds_config(zero_stage=2, max_steps=6, log_steps=1),
                   zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
                   bf16={"enabled": True},
                   optimizer={"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}})
    steps, summary = _train(tmp_path, config)
    assert steps[0]["zero_stage"] == 2 and steps[0]["offload"] and steps[0]["optimizer"] == "DeepSpeedCPUAdam"
    losses = [m["loss"] for m in _jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert summary["steps"] == 6 and losses[-1] < losses[0]
    assert list((tmp_path / "run" / "checkpoints").glob("*/*optim_states.pt"))  # the offloaded states are saved
