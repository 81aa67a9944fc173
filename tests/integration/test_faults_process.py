"""A process of a two-process run dies or hangs: the survivor leaves within a bounded time with one line, and the
same command resumes both processes from the last complete checkpoint."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.common import ROOT, free_port, write_ds_config

from adaptive_ds.distributed import DISTRIBUTED_VARIABLES
from adaptive_ds.training.__main__ import _lost_a_process, _stopped
from adaptive_ds.training.checkpoint import latest_tag
from adaptive_ds.training.stop import Progress

STOPPED = re.compile(r"error: (lost contact with another process \((.+)\)|stopped by SIGTERM \(.+\)|"
                     r"a data loader worker died \(.+\)) at step (\d+); "
                     r"rerun the same command to resume from checkpoint \S+/checkpoints/(step\d{8})")
MAX_STEPS = 12


def _command(tmp_path, out, timeout_s):
    config = write_ds_config(tmp_path, 2, 1, max_steps=MAX_STEPS, warmup_steps=2, save_steps=2, log_steps=1,
                             collective_timeout_s=timeout_s)
    return ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "launchers/train.py",
            "--ds_config", config, "--output_dir", str(out)]


def _start_until_checkpoint(command, out, log):
    """The launcher, started and left running until the run's first checkpoint is complete, and its rank-1 worker."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    with open(log, "w") as sink:
        launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while latest_tag(str(out)) is None and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    # the training process of rank 1: a direct child of the launcher (its data workers inherit RANK=1 too)
    workers = [p for p in psutil.Process(launcher.pid).children() if _rank(p) == "1"]
    assert len(workers) == 1 and launcher.poll() is None, log.read_text()[-3000:]
    return launcher, workers[0]


def _rank(process: psutil.Process) -> str | None:
    try:
        return process.environ().get("RANK")
    except psutil.NoSuchProcess:  # a short-lived helper process that has just exited
        return None


def _stopped_line(text):
    lines = STOPPED.findall(text)
    assert len(lines) == 1, text[-3000:]  # the survivor's one line
    return lines[0]


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_with_one_line_and_the_same_command_resumes(tmp_path, run_command):
    out, log = tmp_path / "run", tmp_path / "first.log"
    command = _command(tmp_path, out, timeout_s=60)
    launcher, victim = _start_until_checkpoint(command, out, log)
    try:
        victim.send_signal(signal.SIGKILL)
        killed = time.time()
        returncode = launcher.wait(timeout=90)
        assert time.time() - killed < 90
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert returncode != 0
    _, _, step, tag = _stopped_line(log.read_text())
    assert tag == latest_tag(str(out)) and int(step) >= int(tag[4:])

    again = run_command(command)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == int(tag[4:]) and summary["world_size"] == 2
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, MAX_STEPS + 1))


@pytest.mark.slow
def test_a_hung_rank_stops_the_run_after_the_collective_timeout(tmp_path):
    out, log = tmp_path / "run", tmp_path / "first.log"
    launcher, victim = _start_until_checkpoint(_command(tmp_path, out, timeout_s=20), out, log)
    try:
        victim.send_signal(signal.SIGSTOP)  # alive, holding its connections, never answering
        hung = time.time()
        while not STOPPED.search(log.read_text()) and time.time() - hung < 90:
            time.sleep(0.2)
        waited = time.time() - hung
        victim.send_signal(signal.SIGKILL)  # else the launcher waits out its grace period for the stopped worker
        assert launcher.wait(timeout=60) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    message, reason, _, _ = _stopped_line(log.read_text())
    assert message.startswith("lost contact") and "Timed out" in reason, message
    assert 15 < waited < 90


class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, index):
        time.sleep(0.05)
        return index


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_data_loader_worker_stopped_by_a_signal_is_a_lost_process_not_a_traceback(signum, monkeypatch):
    """torchrun stops a failed run by signalling process groups, so a survivor's loader worker can be the first
    to receive SIGTERM (seen in a full test run): the survivor must still end with the one line."""
    batches = iter(torch.utils.data.DataLoader(_Slow(), num_workers=1))
    next(batches)
    os.kill(batches._workers[0].pid, signum)
    with pytest.raises(RuntimeError) as raised:
        for _ in batches:
            pass
    what = _lost_a_process(raised.value)
    # torch reports a worker's death by its signal (SIGCHLD handler) or, if its queue noticed first, without it
    assert what.startswith("stopped by SIGTERM (" if signum == signal.SIGTERM else "a data loader worker died (") \
        or what.startswith("a data loader worker died (DataLoader worker (pid(s) "), what
    assert STOPPED.fullmatch(_stopped(what, Progress(7, "/run/checkpoints/step00000006"))).group(3, 4) == \
        ("7", "step00000006")
    assert _lost_a_process(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
