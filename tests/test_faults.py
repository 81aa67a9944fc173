"""Faults that really happen to the process: an allocation the operating system refuses, a SIGKILL before the
first checkpoint, a SIGKILL while the controller is acting. Each run is a separate process
(tests/helpers/train_with_faults.py installs the fault)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import DISTRIBUTED_VARIABLES, ROOT, run_command, write_ds_config

from adaptive_ds.training.checkpoint import latest_tag

FAULTS_SCRIPT = str(ROOT / "tests" / "helpers" / "train_with_faults.py")


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _with_faults(faults: dict, config: str, out) -> list[str]:
    return [sys.executable, FAULTS_SCRIPT, json.dumps(faults), "--ds_config", config, "--output_dir", str(out)]


def _small_buckets(path: str) -> str:
    """ZeRO's gradient buckets at 1M elements: with its default (5e8) each step allocates a 2 GB bucket."""
    config = json.loads(open(path).read())
    config["zero_optimization"].update(reduce_bucket_size=10**6, allgather_bucket_size=10**6)
    with open(path, "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.slow
def test_a_real_allocation_failure_is_recovered_in_place_with_the_same_result(tmp_path):
    # From step 2 the tensors of the process may hold at most 60 MB at once (tests/helpers/capped_allocator.py):
    # a step of 16 rows in one micro-batch really fails to allocate in torch's allocator, the controller halves
    # the micro-batch until it fits, and the run's losses equal those of a run that split the step from the
    # start (the step's loss is normalised over the whole step, so the split does not matter).
    block = dict(max_steps=4, log_steps=1, warmup_steps=1, save_steps=0)
    reference = tmp_path / "reference"
    done = run_command([sys.executable, "launchers/train.py", "--ds_config",
                        _small_buckets(write_ds_config(tmp_path, 2, 8, **block)), "--output_dir", str(reference)])
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "run"
    config = _small_buckets(write_ds_config(tmp_path, 16, 1, **block))
    done = run_command(_with_faults({"memory_cap_mb": 60}, config, out))
    assert done.returncode == 0, done.stderr[-3000:]
    decisions = _jsonl(out / "decisions.jsonl")
    assert decisions and all("CappedAllocator: can't allocate memory" in d["trigger"]["error"] for d in decisions)
    assert all(d["trigger"]["phase"] in ("forward", "backward") for d in decisions)  # retried in place
    assert decisions[0]["step"] == 2 and decisions[0]["trigger"]["micro_batch"] == 16
    final_micro = decisions[-1]["knobs"]["micro_batch"]
    assert final_micro < 16 and decisions[-1]["knobs"]["accumulation"] * final_micro == 16
    got = [m["loss"] for m in _jsonl(out / "metrics.jsonl")]
    want = [m["loss"] for m in _jsonl(reference / "metrics.jsonl")]
    assert got == pytest.approx(want, rel=2e-5)


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_restarts_with_the_same_command(tmp_path):
    config = write_ds_config(tmp_path, 4, 1, max_steps=5, save_steps=3)
    out = tmp_path / "run"
    killed = run_command(_with_faults({"kill_before_step": 3}, config, out))
    assert killed.returncode == -signal.SIGKILL
    assert [m["step"] for m in _jsonl(out / "metrics.jsonl")] == [1, 2] and latest_tag(str(out)) is None
    again = run_command([sys.executable, "launchers/train.py", "--ds_config", config, "--output_dir", str(out)])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "stopped before its first checkpoint; starting over" in again.stderr
    assert [m["step"] for m in _jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert [m["step"] for m in _jsonl(out / "abandoned_metrics.jsonl")] == [1, 2]
    # a directory with anything else in it is still refused, in one line, and left as it was
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused = run_command([sys.executable, "launchers/train.py", "--ds_config", config, "--output_dir", str(other)])
    assert refused.returncode != 0 and "holds files of something else (notes.txt)" in refused.stderr
    assert sorted(os.listdir(other)) == ["notes.txt"]
    # and so is this run's directory under another seed (another run's files)
    stale = tmp_path / "stale"
    run_command(_with_faults({"kill_before_step": 2}, config, stale))
    refused = run_command([sys.executable, "launchers/train.py", "--ds_config", config, "--output_dir", str(stale),
                           "--seed", "7"])
    assert refused.returncode != 0 and "another run's files" in refused.stderr.splitlines()[-1]


@pytest.mark.slow
def test_a_kill_while_the_controller_acts_leaves_a_resumable_run(tmp_path):
    faults = {"oom_micro_batch_above": 2, "oom_from_step": 2, "spike_at_step": 7}
    config = write_ds_config(tmp_path, 8, 1, max_steps=12, save_steps=2,
                             controller={"spike_window": 3, "spike_sigma": 3.0})
    command = _with_faults(faults, config, tmp_path / "run")
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
