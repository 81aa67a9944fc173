"""No orphans: when the launcher the user started is gone, every worker stops as on a stop request (saves, then
exits) instead of training on unattended, holding the port, with nothing saved.

- SIGINT to the `deepspeed` runner's PID alone (not its process group): the runner dies of KeyboardInterrupt, and
  deepspeed.launcher.launch (the workers' parent) and the workers lived on;
- SIGKILL to torchrun's agent: its workers are left without a parent.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.common import ROOT, free_port, script_env, write_ds_config

from adaptive_ds.training.checkpoint import latest_tag
from adaptive_ds.training.launcher_watch import is_launcher, launcher_chain

# LauncherWatch asks for the stop within 1 s of the launcher's end; the ranks agree within two steps (a fraction of
# a second each here), save and exit: seconds. The bound leaves room for a loaded machine.
STOPPED_WITHIN_S = 90


def _logged_steps(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    """The training processes (they hold RANK; their DataLoader workers do too, as children of a worker)."""
    found = []
    for process in launcher.children(recursive=True):
        try:
            if "RANK" in process.environ() and not is_launcher(process.cmdline()) and \
                    "RANK" not in process.parent().environ():
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


SIGINT_DEFAULT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execvp(sys.argv[1], sys.argv[1:])"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_workers_save_and_exit_when_their_launcher_is_gone(launcher, tmp_path):
    out = tmp_path / "run"
    config = write_ds_config(tmp_path, 2, 1, max_steps=2000, warmup_steps=2, log_steps=1, collective_timeout_s=60)
    port = str(free_port())
    start = (["deepspeed", "--master_port", port, "--num_gpus", "2"] if launcher == "deepspeed" else
             ["torchrun", "--nproc_per_node", "2", "--master_port", port])
    # SIGINT's default action in the launcher, as a terminal's Ctrl-C finds it: a test run started in the background
    # of a shell without job control inherits SIGINT ignored, and the runner then outlives the signal it is sent
    start = [*SIGINT_DEFAULT, *start]
    log = tmp_path / "log"
    with open(log, "w") as sink:
        process = subprocess.Popen([*start, str(ROOT / "launchers" / "train.py"), "--ds_config", config,
                                    "--output_dir", str(out)], cwd=tmp_path, env=script_env(), stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    started = [psutil.Process(process.pid)]
    try:
        deadline = time.time() + 300
        while _logged_steps(out) < 2 and process.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        workers = _workers(psutil.Process(process.pid))
        started += workers
        assert len(workers) == 2 and process.poll() is None, log.read_text()[-3000:]
        assert [p.pid for p in launcher_chain(workers[0])][-1] == process.pid  # the chain reaches the user's process

        os.kill(process.pid, signal.SIGINT if launcher == "deepspeed" else signal.SIGKILL)  # that process alone
        # (DeepSpeed's runner waits on its launch.py, which a loaded 2-core machine took past 30 s to end, and past
        # 120 s with a training run beside the test suite)
        process.wait(timeout=300)
        gone, alive = psutil.wait_procs(workers, timeout=STOPPED_WITHIN_S)
        assert not alive, log.read_text()[-3000:]
    finally:
        for leftover in started:  # whatever is left of what this test started (psutil checks the start time: a
            try:                  # PID reused since is not killed)
                if leftover.is_running():
                    leftover.kill()
            except psutil.NoSuchProcess:
                pass
    text = log.read_text()
    tag = latest_tag(str(out))
    assert tag is not None, text[-3000:]
    step = int(tag.removeprefix("step"))
    assert 2 <= step < 2000
    # rank 0's line at least: once rank 0 has exited, deepspeed's launch.py may stop rank 1 before it writes its own
    assert f"stopped by SIGTERM at step {step}, saved" in text, text[-3000:]
    assert "the launcher (PID" in text
