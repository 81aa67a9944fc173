"""A stop request on the stand-in engine (tests/helpers/fake_engine.py): SIGTERM or SIGINT saves at the next step
boundary and the same command resumes; past the grace period or on unhealthy weights the run stops without a
checkpoint; a second signal stops it at once only once the grace period has passed."""

import json
import re
import signal

import pytest
from helpers.common import write_ds_config
from helpers.fake_engine import EngineLog, FakeEngine
from helpers.stop_runs import TINY, Signal, fake_run, train_losses

from adaptive_ds import distributed
from adaptive_ds.training import loop, train
from adaptive_ds.training.checkpoint import latest_tag
from adaptive_ds.training.stop import StopRequest, StopRequested


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_at_the_next_step_and_the_same_command_resumes(tmp_path, signum):
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a job started in the background
    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = EngineLog()
    fake_run(reference, Signal(uninterrupted, {}))
    log = EngineLog()
    with pytest.raises(StopRequested) as stopped:
        fake_run(tmp_path, Signal(log, {4: signum}))
    name = signal.Signals(signum).name
    assert str(stopped.value) == f"stopped by {name} at step 4, saved; rerun the same command to resume from step 4"
    assert stopped.value.signum == signum and latest_tag(str(tmp_path / "run")) == "step00000004"
    assert max(train_losses(tmp_path / "run")) == 4  # the step it stopped at logged its window
    summary = fake_run(tmp_path, Signal(log, {}))
    assert summary["resumed_from_step"] == 4
    assert log.losses == uninterrupted.losses  # every step's loss (the stand-in's weights went on from step 4's)
    assert summary["validation_loss"] == json.loads((reference / "run" / "summary.json").read_text())[
        "validation_loss"]
    assert signal.getsignal(signal.SIGINT) is before  # the loop's handlers are gone with it


def test_past_the_grace_period_or_on_unhealthy_weights_it_stops_without_a_checkpoint(tmp_path):
    log = EngineLog()
    with pytest.raises(StopRequested) as stopped:
        fake_run(tmp_path, Signal(log, {3: signal.SIGTERM}), "--stop_grace_s", "0", save_steps=2)
    assert str(stopped.value) == ("stopped by SIGTERM at step 3 without a checkpoint there (the grace period of 0 s "
                                  "had passed); rerun the same command to resume from step00000002")
    assert latest_tag(str(tmp_path / "run")) == "step00000002"
    (tmp_path / "b").mkdir()
    log = EngineLog()
    with pytest.raises(StopRequested) as stopped:
        fake_run(tmp_path / "b", Signal(log, {3: signal.SIGTERM}, nan_at_step=3))
    assert str(stopped.value) == ("stopped by SIGTERM at step 3 without a checkpoint there (its loss is not healthy); "
                                  "rerun the same command to start again (no checkpoint was saved yet)")


def test_without_an_output_dir_the_line_names_the_directory_the_run_chose(tmp_path, monkeypatch):
    """A run without --output_dir makes a new time-stamped directory at each start, so "the same command" alone
    would start another run: the line names the directory to pass."""
    monkeypatch.chdir(tmp_path)
    config = write_ds_config(tmp_path, 4, 2, max_steps=10, warmup_steps=1, log_steps=5, data_workers=0, model=TINY)
    log = EngineLog()
    monkeypatch.setattr(loop, "build_engine", lambda *a, **k: FakeEngine(*a, **k, log=log))
    with pytest.raises(StopRequested) as stopped:
        train(["--ds_config", config], hooks=Signal(log, {4: signal.SIGTERM}))
    (run,) = (tmp_path / "runs").iterdir()
    assert str(stopped.value) == (f"stopped by SIGTERM at step 4, saved; rerun the same command with --output_dir "
                                  f"runs/{run.name} to resume from step 4")
    summary = train(["--ds_config", config, "--output_dir", f"runs/{run.name}"], hooks=Signal(log, {}))
    assert summary["resumed_from_step"] == 4


class _Twice(Signal):
    """SIGINT before step 3 (Ctrl-C in the terminal), then SIGTERM inside it (deepspeed's launcher passing the same
    request on to its workers)."""

    def before_micro_batch(self, trainer, step, index, micro_batch):
        if step == 3 and index == 1:
            signal.raise_signal(signal.SIGTERM)


def test_a_second_signal_within_the_grace_period_still_saves(tmp_path):
    with pytest.raises(StopRequested) as stopped:
        fake_run(tmp_path, _Twice(EngineLog(), {3: signal.SIGINT}))
    assert str(stopped.value) == "stopped by SIGINT at step 3, saved; rerun the same command to resume from step 3"
    assert latest_tag(str(tmp_path / "run")) == "step00000003"


def test_a_second_signal_past_the_grace_period_stops_at_once(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        fake_run(tmp_path, _Twice(EngineLog(), {3: signal.SIGINT}), stop_grace_s=0)
    assert latest_tag(str(tmp_path / "run")) is None


def test_a_signal_on_a_rank_that_stops_for_a_peers_signal_only_marks():
    """agreed() adopts a peer's signal without a clock of this rank's own (received stays None): a signal that then
    reaches this rank (the launcher passing the stop on) must not break its save with a TypeError."""
    request = StopRequest(30)
    request.signum = signal.SIGTERM  # as agreed() leaves a rank that stops for another rank's signal
    with request:
        signal.raise_signal(signal.SIGTERM)
    assert request.signum == signal.SIGTERM and request.received is None


def test_the_grace_period_runs_from_the_first_signal_any_rank_received(monkeypatch):
    """On a preemptible cluster the cloud signals the machine it takes, not rank 0's: the ranks that stop for another
    rank's signal must not find the grace period fresh. Here this process is rank 0 of two, never signalled, and its
    peer received the signal 40 s ago (the gathered ages stand in for the peer's answer)."""
    from adaptive_ds.training import stop

    request = stop.StopRequest(grace_s=30)
    request.signum = signal.SIGTERM  # adopted from the peer at the agreement: this rank received nothing itself
    monkeypatch.setattr(distributed, "all_gather_object", lambda age: [age, 40.0])
    assert not request.within_grace()
    monkeypatch.setattr(distributed, "all_gather_object", lambda age: [age, 5.0])
    assert request.within_grace()


def test_the_agreements_own_group_waits_no_longer_than_the_runs_collectives(monkeypatch):
    """On NCCL the agreement runs in a gloo group of its own, which torch would create with gloo's 30-minute default:
    a hung peer must fail it after the run's collective timeout, as it fails every other collective."""
    from datetime import timedelta

    from adaptive_ds.training import stop

    made = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(stop.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(stop.dist, "new_group", lambda **kwargs: made.append(kwargs))
    stop.StopRequest(grace_s=30, timeout_s=120)
    assert made == [{"backend": "gloo", "timeout": timedelta(seconds=120)}]


class _Unread:
    """The metrics with a step loss still on the device; reading it tells the controller."""

    def __init__(self, controller):
        self.unread, self.controller = True, controller

    def read(self):
        self.unread, self.controller.healthy = False, self.controller.judged
        return loop.CONTINUE


@pytest.mark.parametrize("judged, line", [(True, "saved"), (False, "without a checkpoint there (its loss is not "
                                                                   "healthy)")])
def test_an_agreed_stop_ends_the_run_even_with_a_step_loss_unread_and_judges_it_before_saving(judged, line):
    """A stop that every rank agreed on ends the run whatever else holds (here a loss still on the device, which the
    cadence's save waits for): the loss is read first, and the weights are saved only where it was healthy."""
    from types import SimpleNamespace

    from adaptive_ds.training.metrics import PhaseClock

    calls = []
    controller = SimpleNamespace(healthy=None, judged=judged)

    def save_on_stop(step, stop, healthy):
        calls.append(("save_on_stop", step, healthy))
        raise StopRequested(f"stopped at step {step}, {'saved' if healthy else line}", stop.signum)

    checkpointer = SimpleNamespace(maybe_save=lambda step, healthy: calls.append(("maybe_save", step, healthy)),
                                   save_on_stop=save_on_stop)
    trainer = SimpleNamespace(metrics=_Unread(controller), controller=controller, checkpointer=checkpointer,
                              clock=PhaseClock())
    trainer._stop_on_signal = lambda step, stop: loop.Trainer._stop_on_signal(trainer, step, stop)
    stop = StopRequest(grace_s=30)
    stop.signum = signal.SIGTERM
    with pytest.raises(StopRequested, match=re.escape(line)):
        loop.Trainer._handle(trainer, loop._SIGNALLED, 7, stop)
    assert calls == [("maybe_save", 7, judged), ("save_on_stop", 7, judged)] and not trainer.metrics.unread
