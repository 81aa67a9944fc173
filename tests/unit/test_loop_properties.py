"""The training loop's cadences over random settings, on a stand-in engine (tests/helpers/fake_engine.py) so that
each run takes a fraction of a second: validation, logging and checkpoints each at their own cadence, whatever the
others are; a run killed and resumed (also with another micro-batch), a loss spike rolled back, a non-finite loss
and an out-of-memory error change none of it. The loop, the controller, the checkpoint files, the metrics and the
data pipeline are the real ones; what the expected cadences are is computed here, step by step, from the settings
alone."""

import functools
import json
import math
import re
import tempfile
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.common import write_ds_config
from helpers.fake_engine import EngineLog, FakeEngine, FakeFaults, Killed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_ds import data
from adaptive_ds.data import embedded
from adaptive_ds.training import loop, train
from adaptive_ds.training.controller import TrainingStopped
from adaptive_ds.training.validation import Validator

SEQ_LEN = 256  # the debug preset's
MICRO, ACCUMULATION = 4, 2
ROWS = MICRO * ACCUMULATION  # rows per step on the one process
GLOBAL_BATCH = ROWS * SEQ_LEN  # tokens per step
TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# The embedded corpus's blocks are a pure function of (namespace, index, seq_len, tier): made once per test process
# here, not once per run (every run of these tests reads the same seed's blocks); the data pipeline is unchanged.
_BLOCKS = functools.lru_cache(maxsize=None)(embedded.block)


def _no_plot(*args, **kwargs) -> None:
    """The run's loss chart is not what these tests check (tests/unit/test_loss_plot.py does, non-finite losses among
    its cases): drawn after each of hypothesis's many runs, it would double these tests' time."""


def _train(argv: list[str], log: EngineLog, faults: FakeFaults, validations: list[int]):
    """One run on the stand-in engine; `validations` receives the step of every validation it runs."""
    real_run = Validator.run

    def counted(self, engine, step, *args):
        validations.append(step)
        return real_run(self, engine, step, *args)

    with mock.patch.object(loop, "build_engine", partial(FakeEngine, log=log)), \
            mock.patch.object(Validator, "run", counted), \
            mock.patch.object(loop, "plot_losses", _no_plot), mock.patch.object(data, "block", _BLOCKS):
        return train(argv, hooks=faults)


def _expected_checkpoints(final: int, save_steps: int, keep_last: int, healthy) -> list[int]:
    """The checkpoints a run keeps, as the cadence is stated: at each multiple of save_steps before the end (a
    boundary met while the loss is unhealthy waits for the first healthy step after it), and at the end when that
    step is healthy; the last keep_last of them stay."""
    saved, pending = [], False
    for step in range(1, final + 1):
        pending = pending or (save_steps > 0 and step % save_steps == 0 and step < final)
        if pending and healthy(step):
            saved.append(step)
            pending = False
    if healthy(final) and saved[-1:] != [final]:
        saved.append(final)
    return saved[-keep_last:]


@st.composite
def scenarios(draw):
    max_steps = draw(st.integers(1, 18))
    kill = draw(st.none() | st.integers(2, max_steps)) if max_steps > 1 else None
    return dict(
        max_steps=max_steps,
        budget=draw(st.sampled_from(["max_steps", "tokens"])),
        tokens_short_by=draw(st.integers(0, GLOBAL_BATCH - 1)),  # a token budget just above max_steps - 1 steps
        log_steps=draw(st.integers(1, 7)),
        eval_steps=draw(st.integers(0, 7)),
        save_steps=draw(st.integers(0, 6)),
        keep_last=draw(st.integers(1, 3)),
        kill_before_step=kill,
        resume_micro_batch=draw(st.none() | st.sampled_from([1, 2, 4, 8])) if kill else None,
        # early stopping after this many validations without improvement (0: off); nothing improves by 100 nats
        patience=draw(st.integers(0, 3)),
        spike_at_step=draw(st.none() | st.integers(1, max_steps)),
        nan_at_step=draw(st.none() | st.integers(1, max_steps)),
        oom_at_step=draw(st.none() | st.integers(1, max_steps)),
    )


def _last_step(case: dict) -> int:
    """Where the run ends: max_steps, or the validation that exhausts the patience (the first validation sets the
    best; each later one fails to improve on it by 100 nats), counting the validations of the steps it keeps."""
    eval_steps, patience = case["eval_steps"], case["patience"]
    if patience and eval_steps:
        return min(case["max_steps"], eval_steps * (patience + 1))
    return case["max_steps"]


def _check_run(case: dict, directory: Path) -> None:
    final = _last_step(case)
    budget = case["max_steps"] * GLOBAL_BATCH - case["tokens_short_by"]
    length = ["--max_steps", str(case["max_steps"])] if case["budget"] == "max_steps" else ["--tokens", str(budget)]
    controller = {"spike_window": 2, "spike_sigma": 3.0, "early_stopping_patience": case["patience"],
                  "min_improvement": 100.0}
    config = write_ds_config(directory, MICRO, ACCUMULATION, warmup_steps=1, log_steps=case["log_steps"],
                             eval_steps=case["eval_steps"], save_steps=case["save_steps"],
                             keep_last=case["keep_last"], data_workers=0, model=TINY, controller=controller)
    out = directory / "run"
    argv = ["--ds_config", config, "--output_dir", str(out), *length]
    log, validations = EngineLog(), []
    faults = FakeFaults(log, case["kill_before_step"], case["spike_at_step"], case["nan_at_step"], case["oom_at_step"])
    try:
        try:
            summary = _train(argv, log, faults, validations)
        except Killed:  # the same command again, perhaps with another split of the same global batch
            micro = case["resume_micro_batch"]
            summary = _train([*argv, *(["--micro_batch", str(micro)] if micro else [])], log, faults, validations)
    except TrainingStopped as stopped:  # a spike before any checkpoint: nothing to roll back to
        assert "needs a rollback but there is no checkpoint yet" in str(stopped)
        assert ("spike", case["spike_at_step"]) in faults.fired and not list((out / "checkpoints").glob("step*"))
        return

    # the run's length: max_steps, or ceil(budget / global batch); the schedule built over exactly that; an early
    # stop ends it sooner
    assert summary["steps"] == final and summary["tokens_seen"] == final * GLOBAL_BATCH
    if case["budget"] == "tokens" and final == case["max_steps"]:
        assert budget <= summary["tokens_seen"] < budget + GLOBAL_BATCH
    assert set(log.schedule_lengths) == {case["max_steps"]}

    # one metrics.jsonl record per step that logged or validated, in order; the abandoned ones kept apart
    records = _jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps))
    assert all(r["tokens_seen"] == r["step"] * GLOBAL_BATCH for r in records)
    assert all(r["abandoned"] for r in _jsonl(out / "abandoned_metrics.jsonl"))
    every = range(1, final + 1)
    assert [r["step"] for r in records if "loss" in r] == [s for s in every if s % case["log_steps"] == 0
                                                           or s == final]
    eval_steps = case["eval_steps"]
    assert [r["step"] for r in records if "validation_loss" in r] == [
        s for s in every if (eval_steps and s % eval_steps == 0) or s == final]
    assert set(steps) == {r["step"] for r in records if "loss" in r or "validation_loss" in r}
    # the summary's validation is the last step's, not a second one; no step is validated more often than trained
    assert summary["validation_loss"] == records[-1]["validation_loss"]
    assert all(validations.count(s) <= max(1, log.executions[s]) for s in set(validations))
    assert all(r["micro_batch"] * r["accumulation"] == ROWS for r in records if "loss" in r)

    # checkpoints at their cadence, postponed past an unhealthy loss, the last keep_last kept
    healthy = lambda step: math.isfinite(log.losses[step])  # noqa: E731 - the final trajectory's losses
    kept = sorted(int(p.name[4:]) for p in (out / "checkpoints").glob("step*") if re.fullmatch(r"step\d{8}", p.name))
    assert kept == _expected_checkpoints(final, case["save_steps"], case["keep_last"], healthy)
    for step in kept:
        run = json.loads((out / "checkpoints" / f"step{step:08d}" / "run.json").read_text())
        assert run["step"] == step and math.isfinite(run["loss"])

    # a resume with another --micro_batch trains the rest of the run split as asked (until an out-of-memory)
    fired = [name for name, _ in faults.fired]
    micro = case["resume_micro_batch"]
    if "kill" in fired and micro and "oom" not in fired[fired.index("kill"):]:
        resumed = [r for r in records if "loss" in r and r["step"] > summary["resumed_from_step"]]
        assert all(r["micro_batch"] == micro for r in resumed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
def test_cadences_hold_in_every_combination_of_settings(case):
    with tempfile.TemporaryDirectory() as directory:
        _check_run(case, Path(directory))


@pytest.mark.parametrize("eval_steps, expected", [(7, [7, 14, 21, 28, 30]), (25, [25, 30]), (0, [30])])
def test_validation_follows_eval_steps_not_the_logging_cadence(tmp_path, eval_steps, expected, tiny_ds_config):
    log, validations = EngineLog(), []
    config = tiny_ds_config(MICRO, ACCUMULATION, max_steps=30, log_steps=10, eval_steps=eval_steps,
                            data_workers=0, model=TINY)
    out = tmp_path / "run"
    summary = _train(["--ds_config", config, "--output_dir", str(out)], log, FakeFaults(log), validations)
    records = _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if "validation_loss" in r] == expected == validations
    assert [r["step"] for r in records if "loss" in r] == [10, 20, 30]
    assert summary["validation_loss"] == records[-1]["validation_loss"]


def test_early_stopping_counts_the_evaluations_of_eval_steps(tmp_path, tiny_ds_config):
    """Patience counts validations at their own cadence (every 3 steps here, with a log every 10 steps)."""
    log, validations = EngineLog(), []
    config = tiny_ds_config(MICRO, ACCUMULATION, max_steps=30, log_steps=10, eval_steps=3,
                            data_workers=0, model=TINY,
                            controller={"early_stopping_patience": 2, "min_improvement": 100.0})
    out = tmp_path / "run"
    summary = _train(["--ds_config", config, "--output_dir", str(out)], log, FakeFaults(log), validations)
    assert validations == [3, 6, 9] and summary["steps"] == 9
    stops = [d for d in _jsonl(out / "decisions.jsonl") if d["action"] == "stop early"]
    assert [d["step"] for d in stops] == [9]
    assert [r["step"] for r in _jsonl(out / "metrics.jsonl") if "loss" in r] == [9]  # the last step logs


def _run(tmp_path, log, faults, *args, **block) -> tuple[dict, list[dict]]:
    """A run on the stand-in engine into tmp_path/run: its summary and metrics records."""
    config = write_ds_config(tmp_path, MICRO, ACCUMULATION, **{"warmup_steps": 1, "log_steps": 1, "data_workers": 0,
                                                                "model": TINY, **block})
    out = tmp_path / "run"
    summary = _train(["--ds_config", config, "--output_dir", str(out), *args], log, faults, [])
    return summary, _jsonl(out / "metrics.jsonl")


def test_a_finished_run_started_again_reports_its_last_loss_and_trains_nothing(tmp_path):
    log = EngineLog()
    first, records = _run(tmp_path, log, FakeFaults(log), max_steps=4, save_steps=2)
    again, _ = _run(tmp_path, log, FakeFaults(log), max_steps=4, save_steps=2)
    assert again["resumed_from_step"] == 4 and again["steps"] == 4 and log.executions[5] == 0
    assert again["train_loss"] == records[-1]["loss"]  # the checkpoint's, not NaN
    assert again["validation_loss"] == first["validation_loss"]


def test_a_run_that_stopped_early_is_finished_when_its_command_runs_again(tmp_path):
    log = EngineLog()
    early = {"early_stopping_patience": 1, "min_improvement": 100.0}
    first, _ = _run(tmp_path, log, FakeFaults(log), max_steps=12, eval_steps=2, controller=early)
    assert first["steps"] == 4  # best at 2, no improvement at 4
    again, records = _run(tmp_path, log, FakeFaults(log), max_steps=12, eval_steps=2, controller=early)
    assert again["steps"] == 4 and log.executions[5] == 0 and [r["step"] for r in records] == [1, 2, 3, 4]
    assert again["validation_loss"] == first["validation_loss"]


def test_the_micro_batch_a_run_was_asked_for_is_not_applied_again_over_an_out_of_memory_halving(tmp_path):
    """--micro_batch 4, halved to 2 by an out-of-memory error at step 2, killed before step 5: the same command
    resumes at the split that fits; another --micro_batch is applied."""
    log = EngineLog()
    faults = FakeFaults(log, kill_before_step=5, oom_at_step=2)
    with pytest.raises(Killed):
        _run(tmp_path, log, faults, "--micro_batch", "4", max_steps=8, save_steps=4)
    _, records = _run(tmp_path, log, faults, "--micro_batch", "4", max_steps=8, save_steps=4)
    assert [(r["step"], r["micro_batch"]) for r in records] == [(1, 4)] + [(s, 2) for s in range(2, 9)]
    log = EngineLog()
    (tmp_path / "b").mkdir()
    with pytest.raises(Killed):
        _run(tmp_path / "b", log, FakeFaults(log, kill_before_step=5), "--micro_batch", "4", max_steps=8,
             save_steps=4)
    _, records = _run(tmp_path / "b", log, FakeFaults(log), "--micro_batch", "1", max_steps=8, save_steps=4)
    assert [r["micro_batch"] for r in records] == [4] * 4 + [1] * 4


def test_validation_runs_in_forwards_of_the_micro_batch_that_fits(tmp_path):
    """After an out-of-memory halving the held-out set is the same, in forwards of the smaller micro-batch."""
    log, sizes = EngineLog(), []
    real_call = FakeEngine.__call__

    def recording(self, input_ids, **kwargs):
        if not self.module.training:
            sizes.append(input_ids.shape[0])
        return real_call(self, input_ids, **kwargs)

    with mock.patch.object(FakeEngine, "__call__", recording):
        summary, _ = _run(tmp_path, log, FakeFaults(log, oom_at_step=1), max_steps=2, eval_batches=2)
    assert sizes == [2, 2, 2, 2]  # two held-out batches of the ds_config's 4 rows, in forwards of 2
    assert math.isfinite(summary["validation_loss"])


@pytest.mark.parametrize("log_steps, eval_steps, save_steps, reads", [
    (5, 0, 0, 4),  # the windows of steps 5, 10, 15, 20
    (1, 0, 0, 20),  # a window a step: a read a step
    (10, 4, 6, 8),  # windows at 10, 20; validations at 4, 8, 12, 16, 20; saves at 6, 12, 18: reads at 4, 6, 8,
                    # 10, 12, 16, 18, 20
])
def test_the_step_losses_reach_the_host_once_per_window_validation_or_save(tmp_path, log_steps, eval_steps,
                                                                          save_steps, reads):
    """A 20-step run reads its step losses from the device in one transfer where a logging window, a validation or a
    checkpoint needs them, never once a step (a host synchronisation per optimizer step)."""
    from helpers.fake_engine import CountingTensor

    log = EngineLog()
    CountingTensor.reads = 0
    _run(tmp_path, log, FakeFaults(log), max_steps=20, log_steps=log_steps, eval_steps=eval_steps,
         save_steps=save_steps)
    assert CountingTensor.reads == reads


def test_a_step_copies_to_the_device_without_waiting_for_it(tmp_path):
    """A copy to the device that is not non_blocking waits for the device's stream to drain (torch synchronises after
    it): once a step would make the host wait for the steps before it, which the losses left on the device avoid.
    Every copy the training loop makes to the engine's device is recorded (the stand-in's device is the CPU, where
    torch would not wait, but the loop's call is the same)."""
    log, blocking = EngineLog(), []
    to = torch.Tensor.to

    def recording(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and not kwargs.get("non_blocking", False):
            blocking.append((tuple(self.shape), args))
        return to(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "to", recording):
        _run(tmp_path, log, FakeFaults(log), max_steps=3, eval_steps=0)
    assert blocking == []
