"""The adaptive controller's decisions on synthetic sequences: out of memory, spikes and non-finite losses,
overflow steps, MoE balance, plateaus, MoD capacity, and a restored controller deciding as the original would."""

import json
import math

import pytest
from helpers.common import write_ds_config

from adaptive_ds.training import train
from adaptive_ds.training.controller import (
    Action,
    Controller,
    ControllerSettings,
    Knobs,
    StepReport,
    WindowReport,
)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _controller(tmp_path=None, knobs=None, **settings):
    path = str(tmp_path / "decisions.jsonl") if tmp_path else None
    return Controller(ControllerSettings(**settings), knobs or Knobs(micro_batch=8, accumulation=1), path)


# decisions, on synthetic sequences


def test_out_of_memory_halves_by_divisors_then_checkpoints_activations_then_stops():
    c = _controller(knobs=Knobs(micro_batch=12, accumulation=1))
    seen = []
    while (verdict := c.on_oom(3, RuntimeError("oom"))).action is Action.RETRY_STEP:
        seen.append((c.knobs.micro_batch, c.knobs.accumulation, c.knobs.activation_checkpointing))
    # 12 rows: the largest divisor of 12 not above half the micro-batch each time, the global batch kept
    assert seen == [(6, 2, False), (3, 4, False), (1, 12, False), (1, 12, True)]
    assert verdict.action is Action.STOP and verdict.failed and "offload" in verdict.reason


def test_out_of_memory_in_the_optimizer_step_rolls_back_instead_of_retrying():
    # the update may have reached part of the weights: retrying the step in place would apply it twice
    c = _controller(knobs=Knobs(micro_batch=8, accumulation=1))
    verdict = c.on_oom(5, RuntimeError("oom"), phase="optimizer step")
    assert verdict.action is Action.ROLL_BACK and (c.knobs.micro_batch, c.knobs.accumulation) == (4, 2)
    assert c.decisions[-1]["trigger"]["phase"] == "optimizer step"
    assert c.on_oom(6, RuntimeError("oom"), phase="backward").action is Action.RETRY_STEP


def test_out_of_memory_with_the_rule_off_stops_with_the_error():
    verdict = _controller(oom=False).on_oom(1, RuntimeError("CUDA out of memory"))
    assert verdict.action is Action.STOP and "CUDA out of memory" in verdict.reason


def test_a_spike_rolls_back_scales_the_lr_and_is_not_healthy():
    c = _controller(spike_window=4, spike_sigma=3.0)
    losses = [3.0, 2.9, 3.1, 3.0, 2.95]
    assert all(c.observe_step(StepReport(i, x)).action is Action.CONTINUE for i, x in enumerate(losses, 1))
    assert c.healthy
    at_step_4 = _controller(spike_window=4, spike_sigma=3.0)  # the state a checkpoint at step 4 saved
    for i, x in enumerate(losses[:4], 1):
        at_step_4.observe_step(StepReport(i, x))
    verdict = c.observe_step(StepReport(6, 4.0))  # mean 2.99, std ~0.07: far beyond 3 sigma
    assert verdict.action is Action.ROLL_BACK and c.knobs.lr_scale == 0.5 and not c.healthy
    c.rolled_back(at_step_4.state_dict())
    # back to the checkpoint's loss history (steps 1-4); the new learning-rate scale and the rollback stay
    assert c.healthy and c.losses == losses[:4] and c.knobs.lr_scale == 0.5 and c.rollbacks == 1


def test_a_rollback_forgets_the_validations_and_routing_windows_of_the_abandoned_steps():
    """Patience counts the evaluations of the weights the run keeps: those of steps a rollback undid do not count,
    nor do their routing windows; the decisions taken on them (the knobs) stay."""
    c = _controller(knobs=Knobs(micro_batch=8, accumulation=1, aux_coef=0.01), early_stopping_patience=3,
                    plateau_patience=1, balance_windows=2, min_improvement=0.01)
    c.observe_validation(2, 2.0)
    saved = c.state_dict()  # a checkpoint at step 2: best 2.0, nothing waited for yet
    c.observe_validation(4, 2.5)  # no improvement: the plateau scales the learning rate
    c.observe_window(WindowReport(4, moe={"load_balance": 0.5, "dead_experts": ["0:1"]}))
    assert c.evals_without_improvement == 1 and c.low_balance == 1 and c.knobs.lr_scale == 0.5
    c.rolled_back(saved)
    assert (c.best_validation, c.evals_without_improvement, c.low_balance, c.dead_streak) == (2.0, 0, 0, {})
    assert c.knobs.lr_scale == 0.5  # decided, kept
    # three more evaluations without improvement stop the run, not two (the undone one does not count)
    verdicts = [c.observe_validation(s, 2.5).action for s in (4, 6, 8)]
    assert verdicts == [Action.CONTINUE, Action.CONTINUE, Action.STOP]


def test_non_finite_losses_wait_then_roll_back_and_too_many_rollbacks_stop():
    c = _controller(nonfinite_steps=2, max_rollbacks=1)
    assert c.observe_step(StepReport(1, math.nan)).action is Action.CONTINUE and not c.healthy
    assert c.observe_step(StepReport(2, math.inf)).action is Action.ROLL_BACK
    c.rolled_back(_controller(nonfinite_steps=2, max_rollbacks=1).state_dict())  # a checkpoint at step 0
    c.observe_step(StepReport(3, math.nan))
    verdict = c.observe_step(StepReport(4, math.nan))
    assert verdict.action is Action.STOP and verdict.failed and "after 1 rollbacks" in verdict.reason


def test_fp16_overflow_steps_are_counted_and_bounded(tmp_path):
    c = _controller(tmp_path, max_overflow_steps=3)
    for step, skipped in enumerate([True, True, False, True, True, True], start=1):
        assert c.observe_step(StepReport(step, 1.0, overflow=skipped)).action is Action.CONTINUE
    verdict = c.observe_step(StepReport(7, 1.0, overflow=True))
    assert verdict.action is Action.STOP and "4 fp16 overflow steps in a row" in verdict.reason
    c.close()
    assert _jsonl(tmp_path / "decisions.jsonl")[-1]["trigger"] == {"overflow_steps_in_a_row": 4}


def test_a_skipped_step_is_counted_but_is_neither_a_spike_nor_a_loss_sample(tmp_path):
    """DeepSpeed skipped the update (an fp16 overflow, which large gradients and often a large loss come with): the
    weights did not move, so there is nothing to roll back and its loss says nothing of the weights the run keeps.
    The same loss on a step that was applied is a spike."""
    c = _controller(tmp_path, spike_window=3, spike_sigma=3.0)
    for step, loss in enumerate([3.0, 3.1, 2.9], start=1):
        c.observe_step(StepReport(step, loss))
    for step in (4, 5):
        assert c.observe_step(StepReport(step, 40.0, overflow=True)).action is Action.CONTINUE
    assert c.losses == [3.0, 3.1, 2.9] and c.overflow_run == 2 and c.healthy and c.decisions == []
    assert c.observe_step(StepReport(6, 40.0)).action is Action.ROLL_BACK and c.overflow_run == 0
    # a non-finite loss is judged even on a skipped step: NaN weights make every step overflow, and only a rollback
    # mends them
    c = _controller(nonfinite_steps=2)
    assert c.observe_step(StepReport(1, math.nan, overflow=True)).action is Action.CONTINUE and not c.healthy
    assert c.observe_step(StepReport(2, math.nan, overflow=True)).action is Action.ROLL_BACK


def test_the_aux_coefficient_rises_under_poor_balance_and_returns_to_the_configured_value():
    c = _controller(knobs=Knobs(8, 1, aux_coef=0.01), balance_threshold=0.8, balance_windows=2, aux_coef_max=0.04)
    coefs = []
    for step, balance in enumerate([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9], start=1):
        c.observe_window(WindowReport(step, moe={"load_balance": balance, "dead_experts": []}))
        coefs.append(c.knobs.aux_coef)
    # up by 2x every 2 poor windows, capped at 0.04; then down by 2x per good window to exactly the configured
    assert coefs == [0.01, 0.02, 0.02, 0.04, 0.04, 0.04, 0.02, 0.01, 0.01, 0.01]


def test_experts_that_stay_dead_are_reported_once(tmp_path):
    c = _controller(tmp_path, knobs=Knobs(8, 1, aux_coef=0.01), balance_windows=2, balance_threshold=0.0)
    for step in (1, 2, 3):
        c.observe_window(WindowReport(step, moe={"load_balance": 0.9, "dead_experts": ["0:5"]}))
    c.close()
    (report,) = _jsonl(tmp_path / "decisions.jsonl")
    assert report["action"] == "report dead expert" and report["trigger"] == {"dead_expert": "0:5", "windows": 2}


def test_plateau_scales_the_lr_and_early_stopping_ends_the_run():
    c = _controller(plateau_patience=1, early_stopping_patience=3, min_improvement=0.01)
    verdicts = [c.observe_validation(s, x) for s, x in enumerate([2.0, 1.5, 1.499, 1.6, 1.5], 1)]
    assert [v.action for v in verdicts] == [Action.CONTINUE] * 4 + [Action.STOP]
    assert not verdicts[-1].failed and c.knobs.lr_scale == 0.25  # two plateaus scaled it, the third stopped


def test_mod_capacity_follows_the_schedule_or_moves_toward_a_flops_target():
    c = Controller(ControllerSettings(), Knobs(8, 1, mod_capacity=0.5), mod_capacity_warmup_steps=4)
    assert [c.knobs_at(s).mod_capacity for s in (1, 2, 3, 5, 9)] == [1.0, 0.875, 0.75, 0.5, 0.5]
    c = Controller(ControllerSettings(mod_flops_target=0.3, mod_capacity_bounds=(0.25, 1.0)),
                   Knobs(8, 1, mod_capacity=0.5))
    for step in range(1, 6):
        capacity = c.knobs_at(step).mod_capacity
        # a FLOPs fraction that tracks the capacity (half the model's FLOPs are outside routed blocks)
        c.observe_window(WindowReport(step, mod={"capacity": capacity, "flops_reduction": 0.5 * (1 - capacity)}))
    assert c.knobs_at(6).mod_capacity == 0.25  # pushed down to the lower bound, never below


def test_a_restored_controller_decides_as_the_original_would():
    settings = dict(spike_window=3, spike_sigma=2.0, nonfinite_steps=2, balance_windows=2, balance_threshold=0.8)
    a = _controller(knobs=Knobs(8, 1, aux_coef=0.01), **settings)
    for step, loss in enumerate([2.0, 2.1, 1.9, math.nan], 1):
        a.observe_step(StepReport(step, loss))
    a.observe_window(WindowReport(4, moe={"load_balance": 0.5, "dead_experts": ["1:2"]}))
    b = _controller(knobs=Knobs(8, 1, aux_coef=0.01), **settings)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for c in (a, b):  # the second NaN in a row and a second poor window: both must act on the saved counters
        c.observe_step(StepReport(5, math.nan))
        c.observe_window(WindowReport(5, moe={"load_balance": 0.5, "dead_experts": ["1:2"]}))
    assert a.state_dict() == b.state_dict() and b.rollbacks == 1 and b.knobs.aux_coef == 0.02


# real runs, one per behaviour


def _config(tmp_path, micro=8, accum=1, controller=None, **block):
    return write_ds_config(tmp_path, micro, accum,
                           **{"max_steps": 6, "save_steps": 2, "controller": controller or {}, **block})


def test_unknown_controller_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown controller key"):
        train(["--ds_config", _config(tmp_path, controller={"oom_retry": 1}), "--output_dir", str(tmp_path / "x")])
