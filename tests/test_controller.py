"""The adaptive controller, exercised by injecting each trigger into real CPU runs."""

import json

import pytest
from conftest import write_ds_config

from adaptive_ds.training import train
from adaptive_ds.training.controller import TrainingStopped


def _config(tmp_path, micro=8, accum=1, controller=None, **block):
    return write_ds_config(tmp_path, micro, accum,
                           **{"max_steps": 6, "save_steps": 2, "controller": controller or {}, **block})


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_global_batch(tmp_path):
    out = tmp_path / "run"
    faults = {"oom_micro_batch_above": 2, "oom_from_step": 3}
    summary = train(["--ds_config", _config(tmp_path, controller={"faults": faults}), "--output_dir", str(out)])
    decisions = _jsonl(out / "decisions.jsonl")
    assert [(d["step"], d["trigger"]["micro_batch"], d["settings"]["micro_batch"], d["settings"]["accumulation"])
            for d in decisions] == [(3, 8, 4, 2), (3, 4, 2, 4)]
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]  # the failed step was retried, nothing lost
    assert all(m["micro_batch"] * m["accumulation"] == 8 for m in metrics)  # same global batch
    assert [m["micro_batch"] for m in metrics] == [8, 8, 2, 2, 2, 2]
    assert summary["tokens_seen"] == 6 * 8 * 256 and (out / "final" / "model.safetensors").exists()
    # the settings that worked are persisted: a resumed run starts from them and needs no new decision
    run = json.loads((out / "checkpoints" / "step00000006" / "run.json").read_text())
    assert run["controller"]["micro_batch"] == 2 and run["controller"]["accumulation"] == 4
    train(["--ds_config", _config(tmp_path, controller={"faults": faults}, max_steps=8), "--output_dir", str(out)])
    assert len(_jsonl(out / "decisions.jsonl")) == 2
    assert [m["micro_batch"] for m in _jsonl(out / "metrics.jsonl")][-2:] == [2, 2]


def test_out_of_memory_at_micro_batch_one_checkpoints_activations_then_stops(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="out of memory at micro-batch 1.*offload"):
        train(["--ds_config", _config(tmp_path, micro=2, controller={"faults": {"oom_micro_batch_above": 0}}),
               "--output_dir", str(out)])
    actions = [d["action"] for d in _jsonl(out / "decisions.jsonl")]
    assert actions == ["halve micro-batch, double accumulation, retry the step",
                       "enable activation checkpointing, retry the step", "stop"]


def test_activation_checkpointing_trains_the_same_as_without(tmp_path):
    a = train(["--ds_config", _config(tmp_path, max_steps=3, save_steps=0), "--output_dir", str(tmp_path / "a")])
    b = train(["--ds_config", _config(tmp_path, max_steps=3, save_steps=0, activation_checkpointing=True),
               "--output_dir", str(tmp_path / "b")])
    assert b["validation_loss"] == pytest.approx(a["validation_loss"], rel=1e-5)


def _reference_lrs(tmp_path, max_steps):
    out = tmp_path / "reference"
    train(["--ds_config", _config(tmp_path, max_steps=max_steps), "--output_dir", str(out)])
    return {m["step"]: m["lr"] for m in _jsonl(out / "metrics.jsonl")}


def test_a_loss_spike_rolls_back_lowers_the_lr_and_skips_the_data(tmp_path):
    reference = _reference_lrs(tmp_path, 8)
    out = tmp_path / "run"
    controller = {"faults": {"spike_at_step": 5}, "spike_window": 3, "spike_sigma": 3.0}
    train(["--ds_config", _config(tmp_path, max_steps=8, controller=controller), "--output_dir", str(out)])
    (decision,) = _jsonl(out / "decisions.jsonl")
    assert decision["step"] == 5 and decision["action"].startswith("roll back")
    assert decision["trigger"]["loss"] > decision["trigger"]["window_mean"] + 3 * decision["trigger"]["window_std"]
    assert decision["settings"]["lr_scale"] == 0.5 and decision["settings"]["rollbacks"] == 1
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))  # nothing logged before the rollback is lost
    for m in metrics:
        expected = reference[m["step"]] * (0.5 if m["step"] >= 5 else 1.0)
        assert m["lr"] == pytest.approx(expected, rel=1e-6)
    run = json.loads((out / "checkpoints" / "step00000008" / "run.json").read_text())
    assert run["data_steps"] == 9  # the spiking step's data was skipped, not replayed


def test_non_finite_losses_roll_back_and_too_many_rollbacks_stop(tmp_path):
    out = tmp_path / "run"
    controller = {"faults": {"nan_at_steps": [4, 5]}, "nonfinite_steps": 2}
    train(["--ds_config", _config(tmp_path, controller=controller), "--output_dir", str(out)])
    (decision,) = _jsonl(out / "decisions.jsonl")
    assert decision["step"] == 5 and decision["trigger"]["non_finite_steps"] == 2
    assert (out / "final" / "model.safetensors").exists()
    stopped = tmp_path / "stopped"
    with pytest.raises(TrainingStopped, match="after 0 rollbacks"):
        train(["--ds_config", _config(tmp_path, controller={**controller, "max_rollbacks": 0}),
               "--output_dir", str(stopped)])
    assert (stopped / "checkpoints" / "latest").exists()  # what was written stays


def test_poor_moe_balance_raises_the_aux_coefficient_within_bounds(tmp_path):
    out = tmp_path / "run"
    controller = {"balance_threshold": 0.9999, "balance_windows": 1, "aux_coef_max": 0.04}
    train(["--ds_config", _config(tmp_path, controller=controller), "--arch", "moe", "--output_dir", str(out)])
    raised = [d for d in _jsonl(out / "decisions.jsonl") if d["action"] == "raise the aux-loss coefficient"]
    assert [d["settings"]["aux_coef"] for d in raised] == [0.02, 0.04]
    assert all(d["trigger"]["load_balance"] < 0.9999 for d in raised)
    final = json.loads((out / "final" / "config.json").read_text())
    assert final["router_aux_loss_coef"] == 0.04


def test_the_controller_can_be_switched_off(tmp_path):
    with pytest.raises(Exception, match="injected out-of-memory"):
        train(["--ds_config", _config(tmp_path, controller={"oom": False, "faults": {"oom_micro_batch_above": 2}}),
               "--output_dir", str(tmp_path / "run")])
    with pytest.raises(ValueError, match="unknown controller key"):
        train(["--ds_config", _config(tmp_path, controller={"oom_retry": 1}), "--output_dir", str(tmp_path / "x")])


def test_micro_batch_auto_finds_the_largest_that_fits(tmp_path):
    out = tmp_path / "run"
    controller = {"faults": {"oom_micro_batch_above": 3}}
    train(["--ds_config", _config(tmp_path, micro=2, accum=6, controller=controller, max_steps=3),
           "--output_dir", str(out), "--micro_batch", "auto"])
    decisions = _jsonl(out / "decisions.jsonl")
    assert decisions[0]["action"].startswith("micro-batch auto") and decisions[0]["settings"]["micro_batch"] == 12
    # 12 rows per step: 12 fails, 6 fails, 3 fits (the largest divisor of 12 not above half of 6)
    assert [d["settings"]["micro_batch"] for d in decisions[1:]] == [6, 3]
    assert {(m["micro_batch"], m["accumulation"]) for m in _jsonl(out / "metrics.jsonl")} == {(3, 4)}


def test_plateau_scales_the_lr_and_early_stopping_ends_the_run(tmp_path):
    out = tmp_path / "run"
    # min_improvement larger than any change: every evaluation after the first counts as a plateau
    controller = {"plateau_patience": 1, "early_stopping_patience": 3, "min_improvement": 100.0}
    summary = train(["--ds_config", _config(tmp_path, controller=controller, max_steps=20, eval_steps=2),
                     "--output_dir", str(out)])
    actions = [(d["step"], d["action"]) for d in _jsonl(out / "decisions.jsonl")]
    assert actions == [(4, "scale the learning rate (plateau)"), (6, "scale the learning rate (plateau)"),
                       (8, "stop early")]
    assert summary["steps"] == 8 and (out / "final" / "model.safetensors").exists()


def test_mod_capacity_moves_toward_a_flops_target_within_bounds(tmp_path):
    out = tmp_path / "run"
    controller = {"mod_flops_target": 0.3, "mod_capacity_bounds": [0.25, 1.0]}
    train(["--ds_config", _config(tmp_path, controller=controller), "--arch", "mod", "--output_dir", str(out)])
    capacities = [m["mod"]["capacity"] for m in _jsonl(out / "metrics.jsonl")]
    assert capacities[0] == 0.5 and capacities[-1] < capacities[0] and min(capacities) >= 0.25
    assert all(d["action"] == "adjust MoD capacity" for d in _jsonl(out / "decisions.jsonl"))


def test_fp16_overflow_steps_are_counted_and_bounded(tmp_path):
    from adaptive_ds.training.controller import Controller, ControllerSettings, ControllerState

    controller = Controller(ControllerSettings(max_overflow_steps=3), ControllerState(4, 1), str(tmp_path))
    for step, skipped in enumerate([True, True, False, True, True, True], start=1):
        controller.observe_overflow(step, skipped)  # a clean step resets the run of overflows
    with pytest.raises(TrainingStopped, match="4 fp16 overflow steps in a row"):
        controller.observe_overflow(7, True)
    controller.close()
    assert _jsonl(tmp_path / "decisions.jsonl")[-1]["trigger"] == {"overflow_steps_in_a_row": 4}


def test_experts_that_stay_dead_are_reported_once(tmp_path):
    from adaptive_ds.training.controller import Controller, ControllerSettings, ControllerState

    controller = Controller(ControllerSettings(balance_windows=2, balance_threshold=0.0), ControllerState(4, 1),
                            str(tmp_path))
    for step in (1, 2, 3):
        controller.observe_routing(step, {"load_balance": 0.9, "dead_experts": ["0:5"]}, 0.01)
    controller.close()
    (report,) = _jsonl(tmp_path / "decisions.jsonl")
    assert report["action"] == "report dead expert" and report["trigger"] == {"dead_expert": "0:5", "windows": 2}


@pytest.mark.slow
def test_a_kill_during_controller_decisions_leaves_a_resumable_run(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import DISTRIBUTED_VARIABLES, ROOT, run_command

    from adaptive_ds.training.checkpoint import latest_tag

    controller = {"faults": {"oom_micro_batch_above": 2, "oom_from_step": 2, "spike_at_step": 7},
                  "spike_window": 3, "spike_sigma": 3.0}
    command = [sys.executable, "launchers/train.py", "--ds_config",
               _config(tmp_path, controller=controller, max_steps=12), "--output_dir", str(tmp_path / "run")]
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while (latest_tag(str(tmp_path / "run")) or "") < "step00000006" and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = run_command(command)
    assert again.returncode == 0, again.stderr[-2000:]
    metrics = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert metrics[-1]["micro_batch"] == 2  # the OOM decision survived the kill through the checkpoint
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
