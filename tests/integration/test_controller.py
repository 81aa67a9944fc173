"""The adaptive controller in real runs on the DeepSpeed engine, one per behaviour, with the fault really
happening in the model or the process (tests/helpers/faults.py)."""

import json
import math

import pytest
from helpers.common import write_ds_config
from helpers.faults import Faults

from adaptive_ds.training import train
from adaptive_ds.training.checkpoint import latest_tag
from adaptive_ds.training.controller import (
    TrainingStopped,
)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# decisions, on synthetic sequences


# real runs, one per behaviour


def _config(tmp_path, micro=8, accum=1, controller=None, **block):
    return write_ds_config(tmp_path, micro, accum,
                           **{"max_steps": 6, "save_steps": 2, "controller": controller or {}, **block})


def test_a_nan_gradient_mid_accumulation_is_skipped_by_the_engine_and_counted(tmp_path):
    # A NaN enters one gradient in the second micro-batch of step 3. DeepSpeed's ZeRO optimizer finds the
    # non-finite gradient and skips that update (also in fp32): the weights stay finite, no rollback is needed,
    # and the controller counts the skipped step as it counts fp16 overflows.
    out = tmp_path / "run"
    faults = Faults(nan_grad_at=(3, 1))
    summary = train(["--ds_config", _config(tmp_path, micro=4, accum=2, max_steps=5), "--output_dir", str(out)],
                    hooks=faults)
    assert ("nan_grad", 3) in faults.fired
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["skipped_steps"] for m in metrics] == [0, 0, 1, 1, 1]
    assert all(math.isfinite(m["loss"]) for m in metrics) and math.isfinite(summary["validation_loss"])
    assert _jsonl(out / "decisions.jsonl") == []


def test_a_nan_weight_rolls_back_to_a_healthy_checkpoint_never_a_poisoned_one(tmp_path):
    # A NaN written into a weight before step 3: steps 3, 4 and 5 really compute NaN. Step 4 is a save
    # boundary inside the non-finite wait (3 steps): no checkpoint may be taken there, so the rollback at step 5
    # goes to step 2's healthy weights and the run recovers.
    out = tmp_path / "run"
    summary = train(["--ds_config", _config(tmp_path, max_steps=7, controller={"nonfinite_steps": 3}),
                     "--output_dir", str(out)], hooks=Faults(nan_weight_at_step=3))
    (decision,) = _jsonl(out / "decisions.jsonl")
    assert decision["step"] == 5 and decision["trigger"]["non_finite_steps"] == 3
    assert decision["knobs"]["lr_scale"] == 0.5
    abandoned = _jsonl(out / "abandoned_metrics.jsonl")
    assert [m["step"] for m in abandoned] == [3, 4] and all(m["abandoned"] for m in abandoned)
    assert not any(math.isfinite(m["loss"]) for m in abandoned)
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 8)) and all(math.isfinite(m["loss"]) for m in metrics)
    for tag in sorted((out / "checkpoints").glob("step*")):
        assert math.isfinite(json.loads((tag / "run.json").read_text())["loss"])
    assert math.isfinite(summary["validation_loss"])


def test_a_real_loss_spike_rolls_back_lowers_the_lr_and_logs_each_step_once(tmp_path):
    reference = tmp_path / "reference"
    train(["--ds_config", _config(tmp_path, max_steps=8), "--output_dir", str(reference)])
    lrs = {m["step"]: m["lr"] for m in _jsonl(reference / "metrics.jsonl")}
    out = tmp_path / "run"
    controller = {"spike_window": 3, "spike_sigma": 3.0}
    train(["--ds_config", _config(tmp_path, max_steps=8, controller=controller), "--output_dir", str(out)],
          hooks=Faults(spike_at_step=6))
    (decision,) = _jsonl(out / "decisions.jsonl")
    assert decision["step"] == 6 and decision["action"].startswith("roll back")
    assert decision["trigger"]["loss"] > decision["trigger"]["window_mean"] + 3 * decision["trigger"]["window_std"]
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))  # one record per step, none repeated
    # back to step 4's checkpoint: step 5's record is kept apart, marked; the spiking step 6 was never logged
    assert [m["step"] for m in _jsonl(out / "abandoned_metrics.jsonl")] == [5]
    for m in metrics:
        assert m["lr"] == pytest.approx(lrs[m["step"]] * (0.5 if m["step"] >= 5 else 1.0), rel=1e-6)
    run = json.loads((out / "checkpoints" / "step00000008" / "run.json").read_text())
    assert run["data_steps"] == 10  # the data of steps 5 and 6 was skipped, not replayed


def test_too_many_rollbacks_stop_and_leave_what_was_written(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="after 0 rollbacks"):
        train(["--ds_config", _config(tmp_path, controller={"max_rollbacks": 0}), "--output_dir", str(out)],
              hooks=Faults(nan_weight_at_step=3))
    assert latest_tag(str(out)) == "step00000002"


def test_out_of_memory_mid_accumulation_halves_the_micro_batch_and_keeps_the_global_batch(tmp_path):
    out = tmp_path / "run"
    faults = Faults(oom_micro_batch_above=2, oom_from_step=3, oom_at_micro_index=1)
    summary = train(["--ds_config", _config(tmp_path, micro=4, accum=2), "--output_dir", str(out)], hooks=faults)
    decisions = _jsonl(out / "decisions.jsonl")
    assert [(d["step"], d["trigger"]["micro_batch"], d["knobs"]["micro_batch"], d["knobs"]["accumulation"])
            for d in decisions] == [(3, 4, 2, 4)]
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]  # the failed step was retried, nothing lost
    assert [(m["micro_batch"], m["accumulation"]) for m in metrics] == [(4, 2)] * 2 + [(2, 4)] * 4
    # tokens/s counts each step's rows once, whatever the split: 8 rows x 256 tokens per step over the window's
    # data and train seconds (one step a window here), also for the step that was split again
    assert all(m["tokens_per_s"] * m["window_s"] == pytest.approx(8 * 256, rel=1e-6) for m in metrics)
    assert summary["tokens_seen"] == 6 * 8 * 256
    run = json.loads((out / "checkpoints" / "step00000006" / "run.json").read_text())
    assert run["controller"]["knobs"]["micro_batch"] == 2  # a resumed run starts from the knobs that worked


def test_out_of_memory_at_micro_batch_one_checkpoints_activations_then_stops(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="out of memory at micro-batch 1.*offload"):
        train(["--ds_config", _config(tmp_path, micro=2), "--output_dir", str(out)],
              hooks=Faults(oom_micro_batch_above=0))
    actions = [d["action"] for d in _jsonl(out / "decisions.jsonl")]
    assert actions == ["halve micro-batch, double accumulation, retry the step",
                       "enable activation checkpointing, retry the step", "stop"]


def test_micro_batch_auto_finds_the_largest_that_fits(tmp_path):
    out = tmp_path / "run"
    train(["--ds_config", _config(tmp_path, micro=2, accum=6, max_steps=3), "--output_dir", str(out),
           "--micro_batch", "auto"], hooks=Faults(oom_micro_batch_above=3))
    decisions = _jsonl(out / "decisions.jsonl")
    assert decisions[0]["action"].startswith("micro-batch auto") and decisions[0]["knobs"]["micro_batch"] == 12
    # 12 rows per step: 12 fails, 6 fails, 3 fits (the largest divisor of 12 not above half of 6)
    assert [d["knobs"]["micro_batch"] for d in decisions[1:]] == [6, 3]
    assert {(m["micro_batch"], m["accumulation"]) for m in _jsonl(out / "metrics.jsonl")} == {(3, 4)}


def test_activation_checkpointing_trains_the_same_as_without(tmp_path):
    a = train(["--ds_config", _config(tmp_path, max_steps=3, save_steps=0), "--output_dir", str(tmp_path / "a")])
    b = train(["--ds_config", _config(tmp_path, max_steps=3, save_steps=0, activation_checkpointing=True),
               "--output_dir", str(tmp_path / "b")])
    assert b["validation_loss"] == pytest.approx(a["validation_loss"], rel=1e-5)


def test_early_stopping_ends_the_run_saved_as_usual(tmp_path):
    out = tmp_path / "run"
    controller = {"plateau_patience": 1, "early_stopping_patience": 3, "min_improvement": 100.0}
    summary = train(["--ds_config", _config(tmp_path, controller=controller, max_steps=20, eval_steps=2),
                     "--output_dir", str(out)])
    actions = [(d["step"], d["action"]) for d in _jsonl(out / "decisions.jsonl")]
    assert actions == [(4, "scale the learning rate (plateau)"), (6, "scale the learning rate (plateau)"),
                       (8, "stop early")]
    assert summary["steps"] == 8 and latest_tag(str(out)) == "step00000008"
    assert (out / "final" / "model.safetensors").exists()


class _RecordAuxCoefficient(Faults):
    """Records, before each step, the aux-loss coefficient the model's loss uses."""

    def __init__(self):
        super().__init__()
        self.coefficients = {}

    def before_step(self, trainer, step):
        self.coefficients[step] = trainer.engine.module.router_aux_loss_coef


def test_poor_moe_balance_raises_the_aux_coefficient_the_loss_uses_not_the_saved_one(tmp_path):
    out = tmp_path / "run"
    controller = {"balance_threshold": 0.9999, "balance_windows": 1, "aux_coef_max": 0.04}
    seen = _RecordAuxCoefficient()
    train(["--ds_config", _config(tmp_path, controller=controller), "--arch", "moe", "--output_dir", str(out)],
          hooks=seen)
    raised = [d for d in _jsonl(out / "decisions.jsonl") if d["action"] == "raise the aux-loss coefficient"]
    assert [(d["step"], d["knobs"]["aux_coef"]) for d in raised] == [(1, 0.02), (2, 0.04)]
    # the loss of each step uses the coefficient decided before it (logged every step here)
    assert seen.coefficients == {1: 0.01, 2: 0.02, 3: 0.04, 4: 0.04, 5: 0.04, 6: 0.04}
    # what is saved is the model as configured: the controller's knob is the run's, not the model's
    assert json.loads((out / "final" / "config.json").read_text())["router_aux_loss_coef"] == 0.01
    for tag in (out / "checkpoints").glob("step*"):
        assert json.loads((tag / "run.json").read_text())["identity"]["model"]["router_aux_loss_coef"] == 0.01


def test_a_raised_aux_coefficient_returns_to_the_configured_one_in_the_model(tmp_path):
    # The first run raises the coefficient (balance never good enough) and saves it in its knobs; the resumed run
    # finds balance good and must lower it back to the ds_config's 0.01, captured when the run was built.
    out = tmp_path / "run"
    raise_it = {"balance_threshold": 0.9999, "balance_windows": 1, "aux_coef_max": 0.04}
    train(["--ds_config", _config(tmp_path, controller=raise_it, max_steps=2), "--arch", "moe",
           "--output_dir", str(out)])
    run = json.loads((out / "checkpoints" / "step00000002" / "run.json").read_text())
    assert run["controller"]["knobs"]["aux_coef"] == 0.04  # raised at steps 1 and 2, saved with the checkpoint
    seen = _RecordAuxCoefficient()
    train(["--ds_config", _config(tmp_path, controller={"balance_threshold": 0.0}, max_steps=5), "--arch", "moe",
           "--output_dir", str(out)], hooks=seen)
    lowered = [d["knobs"]["aux_coef"] for d in _jsonl(out / "decisions.jsonl")
               if d["action"] == "lower the aux-loss coefficient"]
    assert lowered == [0.02, 0.01]
    assert seen.coefficients == {3: 0.04, 4: 0.02, 5: 0.01}  # the resumed run starts from the saved knob
    assert json.loads((out / "final" / "config.json").read_text())["router_aux_loss_coef"] == 0.01


def test_mod_capacity_moves_toward_a_flops_target_in_the_model(tmp_path):
    out = tmp_path / "run"
    controller = {"mod_flops_target": 0.3, "mod_capacity_bounds": [0.25, 1.0]}
    # from capacity 0.5 in every block, so that the controller can move it both ways within the bounds
    train(["--ds_config", _config(tmp_path, controller=controller), "--arch", "mod", "--variant", "mod:half",
           "--output_dir", str(out)])
    metrics = _jsonl(out / "metrics.jsonl")
    capacities = [m["mod"]["capacity"] for m in metrics]
    assert capacities[0] == 0.5 and capacities[-1] < capacities[0] and min(capacities) >= 0.25
    # the model really routed that share: skip rate = 1 - capacity (seq 256, ceil)
    for m, capacity in zip(metrics, capacities, strict=True):
        assert m["mod"]["skip_rate"] == pytest.approx(1 - math.ceil(capacity * 256) / 256)
