"""The shipped half-precision configs trained as configured (tests/helpers/shipped.py) on this machine's DeepSpeed
accelerator: fp16 with dynamic loss scaling as `b1_t4.json` writes it (ZeRO-2, the optimizer offloaded to
DeepSpeed's CPU Adam), and bf16 as `b1_a100.json` writes it (ZeRO-2).

An overflow injected where DeepSpeed meets one (an infinite gradient) is skipped: the weights and the learning-rate
schedule stay, the step and its tokens count, the loss scale falls as the config's `hysteresis` says, and the
controller sees a skipped step rather than a loss sample. The routers and gates (MoE's top-k softmax, MoD's router
and its predictor) stay sound: each architecture's losses in half precision stay within a stated tolerance of
fp32's (`b1_t4.json`'s engine with its fp16 turned off). Where the accelerator lacks a half precision, its tests skip
with that reason."""

import json

import pytest
import torch
from helpers.faults import Faults
from helpers.shipped import HALF_PRECISION, EngineFacts, as_configured, expected_facts, in_fp32, needs, shipped

from adaptive_ds.presets import PRESETS
from adaptive_ds.training import train

FP16, BF16 = HALF_PRECISION["fp16"], HALF_PRECISION["bf16"]
ARCHITECTURES = ("dense", "moe", "mod", "hybrid")
STEPS = 20
# The most a step's loss (nats per token) may differ from fp32's over STEPS steps. DeepSpeed keeps fp32 master
# weights in both, so the differences are the half-precision forward and backward's roundings (fp16 keeps 11
# significant bits, bf16 8), carried through 20 updates and the routers' top-k choices: a few thousandths on this
# machine, for every architecture, the tolerance several times that and under a tenth of what 20 steps of training move
# the loss by. What it guards: a router, gate or softmax whose half-precision math departs from fp32's by more than
# roundings (one that saturates or overflows), which a NaN loss or a larger difference would show.
TOLERANCE = {"fp16": 0.02, "bf16": 0.02}


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class _Watch(Faults):
    """The faults, and before each step what the run holds: the weights, the learning-rate schedule's step count and
    the controller's loss samples and overflow count."""

    def __init__(self, **faults):
        super().__init__(**faults)
        self.seen: dict[int, dict] = {}

    def before_step(self, trainer, step: int) -> None:
        super().before_step(trainer, step)
        self.seen[step] = {"weights": [p.detach().clone() for p in trainer.engine.module.parameters()],
                           "schedule_step": trainer.engine.lr_scheduler.last_epoch,
                           "samples": list(trainer.controller.losses),
                           "overflow_run": trainer.controller.overflow_run}


@needs("fp16")
def test_an_overflow_is_skipped_and_the_loss_scale_falls_as_the_hysteresis_says(tmp_path):
    fp16 = shipped(FP16)["fp16"]
    assert fp16["hysteresis"] == 2 and fp16["loss_scale"] == 0  # dynamic: halved after two overflows in a row
    scale = 2.0 ** fp16["initial_scale_power"]
    out, watch = tmp_path / "run", _Watch(inf_grad_at_steps=(3, 4))
    config = as_configured(FP16, tmp_path, max_steps=6, warmup_steps=10)  # in warm-up: each step moves the LR
    summary = train(["--ds_config", config, "--output_dir", str(out)], hooks=watch)
    assert watch.fired == [("inf_grad", 3), ("inf_grad", 4)]
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 2, 2, 2]
    assert [r["loss_scale"] for r in records] == [scale, scale, scale, scale / 2, scale / 2, scale / 2]
    # skipped: the weights and the LR schedule stay where step 2 left them; the data was used
    seen = watch.seen
    assert all(torch.equal(a, b) for a, b in zip(seen[3]["weights"], seen[5]["weights"], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(seen[2]["weights"], seen[3]["weights"], strict=True))
    assert [seen[s]["schedule_step"] for s in (3, 4, 5, 6)] == [2, 2, 2, 3]
    lrs = [r["lr"] for r in records]
    assert lrs[1] == lrs[2] == lrs[3] < lrs[4] < lrs[5]
    tokens = 2 * PRESETS["debug"].seq_len  # micro-batch 1 x accumulation 2
    assert [r["tokens_seen"] for r in records] == [tokens * s for s in range(1, 7)]
    assert summary["steps"] == 6 and summary["tokens_seen"] == 6 * tokens
    # the controller: two skipped steps in a row, no loss sample of them, no decision
    assert seen[5]["overflow_run"] == 2 and seen[5]["samples"] == [records[0]["loss"], records[1]["loss"]]
    assert seen[6]["overflow_run"] == 0 and len(seen[6]["samples"]) == 3
    assert not (out / "decisions.jsonl").exists() or (out / "decisions.jsonl").read_text() == ""


_FP32: dict[str, list[float]] = {}  # each architecture's reference losses, once per test process
# The debug preset's first 2 blocks, one micro-batch a step (the overflow test above accumulates two): the comparison
# is of the model's math, each architecture's routed blocks included, at half the cost.
_COMPARED = {"max_steps": STEPS, "warmup_steps": 2, "accumulation": 1, "model": {"num_hidden_layers": 2}}


def _run(config: str, out, hooks=None) -> list[dict]:
    train(["--ds_config", config, "--output_dir", str(out)], hooks=hooks)
    return _records(out)


def _fp32_losses(arch: str, tmp_path_factory) -> list[float]:
    """`b1_t4.json`'s engine in fp32 (ZeRO-2, DeepSpeed's CPU Adam): the reference of both half precisions (the
    bf16 config's FusedAdam makes the same AdamW update, with the same settings)."""
    if arch not in _FP32:
        directory = tmp_path_factory.mktemp(f"fp32-{arch}")
        config = in_fp32(as_configured(FP16, directory, **_COMPARED, arch=arch))
        _FP32[arch] = [r["loss"] for r in _run(config, directory / "fp32")]
    return _FP32[arch]


@pytest.mark.parametrize("precision, name", [pytest.param(p, name, marks=needs(p))
                                             for p, name in HALF_PRECISION.items()])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_in_half_precision_follows_fp32(arch, precision, name, tmp_path, tmp_path_factory):
    facts = EngineFacts()
    records = _run(as_configured(name, tmp_path, **_COMPARED, arch=arch), tmp_path / "run", facts)
    assert facts.facts == expected_facts(name)  # the shipped engine section, as written
    routed = {"moe": arch in ("moe", "hybrid"), "mod": arch in ("mod", "hybrid")}
    assert {kind: kind in records[-1] for kind in routed} == routed  # its routers ran (their statistics logged)
    losses = [r["loss"] for r in records]
    assert shipped(name)["optimizer"] == shipped(FP16)["optimizer"]  # the reference's AdamW and its settings
    reference = _fp32_losses(arch, tmp_path_factory)
    differences = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
    assert len(losses) == STEPS and max(differences) <= TOLERANCE[precision], differences
    assert losses[-1] < losses[0] - 0.25  # and it learns
