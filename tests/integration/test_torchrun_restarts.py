"""torchrun's agent restarts a failed run (`--max_restarts`) and the run continues from its last checkpoint by
itself: a rank killed with SIGKILL, a rank that raises, a DataLoader worker killed. The per-step losses equal an
uninterrupted run's, and metrics.jsonl says which steps the restarted round trained.

Before the restart round had a store prefix of its own (distributed.restart_round_store), the new round read the
dead round's addresses from the agent's store and hung in gloo's rendezvous or in DeepSpeed's group creation.
"""

import json
import subprocess
from pathlib import Path

import pytest
from helpers.common import ROOT, free_port, logged_losses, output_within, script_env, write_ds_config

from adaptive_ds.training import train

MAX_STEPS, SAVE_STEPS, FAULT_STEP = 10, 3, 5  # the fault comes before step 5: the restart resumes from step 3
WITH_FAULT = str(ROOT / "tests" / "helpers" / "train_with_restart_faults.py")


def _ds_config(tmp_path: Path, processes: int = 2) -> str:
    """2 rows a micro-batch; on one process 2 micro-batches a step, the 2 processes' global batch."""
    return write_ds_config(tmp_path, 2, 2 // processes, max_steps=MAX_STEPS, warmup_steps=2, save_steps=SAVE_STEPS,
                           log_steps=1, collective_timeout_s=60)


def _torchrun(args: list[str], cwd: Path, rendezvous: list[str], timeout: int = 420) -> str:
    command = ["torchrun", "--nproc_per_node", "2", "--max_restarts", "2", "--monitor_interval", "0.2",
               *rendezvous, *args]
    process = subprocess.Popen(command, cwd=cwd, env=script_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = output_within(process, timeout)
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The same run never disturbed, in this process: one process with the same global batch (the embedded corpus
    serves global samples by index, so it trains the same rows), equal to the 2 processes' to float32 summation
    order."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    train(["--ds_config", _ds_config(tmp, processes=1), "--output_dir", str(tmp / "out")])
    return logged_losses(tmp / "out")


@pytest.mark.slow
@pytest.mark.parametrize("fault, rank, rendezvous", [
    ("kill", 1, "c10d"),  # the c10d rendezvous with an id of the user's: the run directory is named after it
    # rank 0: the writer of metrics.jsonl, the one that answers the round's handshake and picks the directory
    ("raise", 0, "static"),  # torchrun's default rendezvous, --output_dir given
    ("data_worker", 1, "static-none"),  # the default rendezvous id "none": the agent's store keeps the directory
])
def test_a_restarted_run_continues_from_its_checkpoint(fault, rank, rendezvous, tmp_path, uninterrupted):
    args = [WITH_FAULT, fault, str(FAULT_STEP), str(rank), "--ds_config", _ds_config(tmp_path)]
    if rendezvous == "c10d":
        launch = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "job42"]
        out = tmp_path / "runs" / "debug-dense-job42"
    else:
        launch = ["--master_port", str(free_port())]
        if rendezvous == "static":
            args += ["--output_dir", str(tmp_path / "out")]
    output = _torchrun(args, tmp_path, launch)

    if rendezvous == "static-none":
        runs = list((tmp_path / "runs").iterdir())
        assert len(runs) == 1, runs  # the restart found the first round's time-stamped directory
        out = runs[0]
    elif rendezvous == "static":
        out = tmp_path / "out"
    assert "resumed from step00000003 at step 3" in output, output[-4000:]
    assert output.count("summary: validation loss") == 1, output[-4000:]
    assert logged_losses(out) == pytest.approx(uninterrupted, rel=1e-5, abs=0)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # steps 1-3 are the first round's; 4 onward the restarted round's (its first try at step 4 was abandoned)
    assert {r["step"]: r["restarts"] for r in records} == {s: int(s > SAVE_STEPS) for s in range(1, MAX_STEPS + 1)}
    abandoned = [json.loads(line) for line in (out / "abandoned_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in abandoned] == [4] and abandoned[0]["restarts"] == 0
