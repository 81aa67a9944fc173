"""SIGTERM during training in the training command's own process, on one process and on two (every rank signalled,
as a scheduler signals a job): the run saves at the next step boundary and stops with a line that says the same
command resumes it, and the resumed run's losses are the uninterrupted run's; loader workers ignore the signals
their process decides on."""

import json
import signal
import sys

import pytest
from helpers.common import ROOT
from helpers.fake_engine import EngineLog, FakeFaults
from helpers.stop_runs import Signal, fake_run, train_losses

from adaptive_ds.training import train
from adaptive_ds.training.checkpoint import latest_tag

FAULTS_SCRIPT = str(ROOT / "tests" / "helpers" / "train_with_faults.py")


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_the_training_command_saves_on_sigterm_and_resumes_where_it_stopped(tmp_path, processes, run_command,
                                                                            tiny_ds_config):
    """The real engine, every rank signalled before step 3 (no periodic save): the ranks agree on one boundary (the
    step itself on one process, the next on two: the agreement is read one step after it is offered), save there,
    exit 143; the same command resumes and its losses are the uninterrupted run's.

    The signalled run is the training command in its own process(es); the uninterrupted reference runs in this one,
    on one process with the same global batch: bit for bit against one process, to float32 summation order against
    two. One process's resume runs here too; two processes' is the same command again."""
    config = tiny_ds_config(2, 2, max_steps=6, log_steps=1, warmup_steps=1)
    reference, out = tmp_path / "reference", tmp_path / "run"
    # the same global batch on one process: 2 rows x 2 micro-batches x the processes
    reference_config = tiny_ds_config(2, 2 * processes, max_steps=6, log_steps=1, warmup_steps=1)
    train(["--ds_config", reference_config, "--output_dir", str(reference)])
    launcher = ["torchrun", "--nproc_per_node", "2"] if processes == 2 else [sys.executable]
    faults = json.dumps({"signal_before_step": 3})
    done = run_command([*launcher, FAULTS_SCRIPT, faults, "--ds_config", config, "--output_dir", str(out)])
    stop_step = 3 if processes == 1 else 4
    line = f"stopped by SIGTERM at step {stop_step}, saved; rerun the same command to resume from step {stop_step}"
    assert line in done.stderr.splitlines(), done.stderr[-3000:]
    assert (done.returncode == 128 + signal.SIGTERM) if processes == 1 else done.returncode != 0
    assert latest_tag(str(out)) == f"step{stop_step:08d}" and not (out / "summary.json").exists()
    if processes == 1:
        train(["--ds_config", config, "--output_dir", str(out)])
    else:
        done = run_command([*launcher, "launchers/train.py", "--ds_config", config, "--output_dir", str(out)])
        assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == stop_step
    got, want = train_losses(out), train_losses(reference)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    if processes == 1:
        assert got == want
    else:
        assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5)


@pytest.mark.slow
def test_a_signal_during_the_last_step_is_heard_on_two_processes(tmp_path, run_command, tiny_ds_config):
    """On two processes the agreement offered at a boundary is read at the next one, and the last step has none:
    the ranks settle once after it, so a signal during the last step saves there and stops as any other does (before,
    the run went on to its final validation unsaved); the same command then finishes the run without a step."""
    config = tiny_ds_config(2, 2, max_steps=4, log_steps=1, warmup_steps=1)
    launcher, out = ["torchrun", "--nproc_per_node", "2"], tmp_path / "run"
    done = run_command([*launcher, FAULTS_SCRIPT, json.dumps({"signal_before_step": 4}), "--ds_config", config,
                        "--output_dir", str(out)])
    line = "stopped by SIGTERM at step 4, saved; rerun the same command to resume from step 4"
    assert line in done.stderr.splitlines() and done.returncode != 0, done.stderr[-3000:]
    assert latest_tag(str(out)) == "step00000004" and not (out / "summary.json").exists()
    done = run_command([*launcher, "launchers/train.py", "--ds_config", config, "--output_dir", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 4


def test_a_loader_worker_ignores_the_signals_its_process_decides_on(tmp_path):
    """A scheduler signals the whole process group: the data loader's workers must not die of it before the
    training process has saved."""
    log = EngineLog()
    workers_ignore = []

    class Check(Signal):
        def before_step(self, trainer, step):
            if step == 2:
                import psutil

                this = psutil.Process()
                # the loader's workers: forked from this process (its command line), not a helper another test in
                # this pytest worker left running (a logging service, say)
                for child in [c for c in this.children() if c.cmdline() == this.cmdline()]:
                    status = open(f"/proc/{child.pid}/status").read()
                    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1],
                                  16)
                    workers_ignore.append(all(ignored >> (s - 1) & 1 for s in (signal.SIGTERM, signal.SIGINT)))
            super().before_step(trainer, step)

    fake_run(tmp_path, Check(log, {}), max_steps=3, data_workers=1)
    assert workers_ignore and all(workers_ignore)


def test_a_stop_request_on_a_resumed_finished_run_writes_nothing_over_its_checkpoint(tmp_path, monkeypatch):
    """A run resumed at its last step trains nothing; a signal before it ends stops it at the checkpoint it resumed
    from, which is on disk already: nothing is written over it (a save there would rewrite the latest checkpoint in
    place, the one case a failed save cannot undo)."""
    from adaptive_ds.training import stop as stop_module

    fake_run(tmp_path, FakeFaults(EngineLog()), save_steps=10)
    step = tmp_path / "run" / "checkpoints" / "step00000010"
    before = {p.name: p.stat().st_mtime_ns for p in step.rglob("*")}
    (tmp_path / "run" / "summary.json").unlink()  # so that the same command resumes it
    real = stop_module.StopRequest.settle

    def signalled(self):
        self._mark(signal.SIGTERM, None)
        return real(self)

    monkeypatch.setattr(stop_module.StopRequest, "settle", signalled)
    with pytest.raises(stop_module.StopRequested, match="stopped by SIGTERM at step 10, saved"):
        fake_run(tmp_path, FakeFaults(EngineLog()), save_steps=10)
    assert {p.name: p.stat().st_mtime_ns for p in step.rglob("*")} == before
