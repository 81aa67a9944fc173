"""Faults that really happen to the process: an allocation the operating system refuses, a SIGKILL before the
first checkpoint, a SIGKILL while the controller is acting. Each fault happens in a separate process
(tests/helpers/train_with_faults.py installs it); references, restarts and refusals that follow a kill run in the
test's process."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers.common import ROOT, snapshot

from adaptive_ds.distributed import DISTRIBUTED_VARIABLES
from adaptive_ds.ds_config import ConfigError
from adaptive_ds.training import train
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
def test_a_real_allocation_failure_is_recovered_in_place_with_the_same_result(tmp_path, run_command, tiny_ds_config):
    # From step 2 the tensors of the process may hold at most 60 MB at once (tests/helpers/capped_allocator.py):
    # a step of 16 rows in one micro-batch really fails to allocate in torch's allocator, the controller halves
    # the micro-batch until it fits, and the run's losses equal those of a run that split the step from the
    # start (the step's loss is normalised over the whole step, so the split does not matter).
    block = dict(max_steps=4, log_steps=1, warmup_steps=1, save_steps=0)
    reference = tmp_path / "reference"  # in this process; the capped one in its own
    train(["--ds_config", _small_buckets(tiny_ds_config(2, 8, **block)), "--output_dir", str(reference)])
    out = tmp_path / "run"
    config = _small_buckets(tiny_ds_config(16, 1, **block))
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
def test_a_run_killed_before_its_first_checkpoint_restarts_with_the_same_command(tmp_path, run_command, tiny_ds_config,
                                                                                capfd):
    """The kill is real (a separate process); what runs after it runs in this process, as the same command would."""
    config = tiny_ds_config(4, 1, max_steps=5, save_steps=3)
    out = tmp_path / "run"
    killed = run_command(_with_faults({"kill_before_step": 3}, config, out))
    assert killed.returncode == -signal.SIGKILL
    assert [m["step"] for m in _jsonl(out / "metrics.jsonl")] == [1, 2] and latest_tag(str(out)) is None
    stale = tmp_path / "stale"
    shutil.copytree(out, stale)  # the killed run's files, for the refusal under another seed below
    capfd.readouterr()
    train(["--ds_config", config, "--output_dir", str(out)])
    assert "stopped before its first checkpoint; starting over" in capfd.readouterr().err
    assert [m["step"] for m in _jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert [m["step"] for m in _jsonl(out / "abandoned_metrics.jsonl")] == [1, 2]
    # a directory with anything else in it is still refused, in one line, and left as it was
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files of something else \(notes.txt\)"):
        train(["--ds_config", config, "--output_dir", str(other)])
    assert sorted(os.listdir(other)) == ["notes.txt"]
    # and so is this run's directory under another seed (another run's files)
    before = snapshot(stale)
    with pytest.raises(ConfigError, match="another run's files"):
        train(["--ds_config", config, "--output_dir", str(stale), "--seed", "7"])
    assert snapshot(stale) == before


def _whole_lines(path) -> list[dict]:
    """The records of a JSON-lines file a killed process was writing: a torn last line is not one."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


@pytest.mark.slow
def test_a_kill_while_the_controller_acts_leaves_a_resumable_run(tmp_path, run_command, tiny_ds_config):
    faults = {"oom_micro_batch_above": 2, "oom_from_step": 2, "spike_at_step": 7}
    config = tiny_ds_config(8, 1, max_steps=12, save_steps=2,
                            controller={"spike_window": 3, "spike_sigma": 3.0})
    out = tmp_path / "run"
    command = _with_faults(faults, config, out)
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while (latest_tag(str(out)) or "") < "step00000006" and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the kill landed mid-run: the process died of it, before its end (no summary, no final model)
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    assert not (out / "summary.json").exists() and not (out / "final").exists()
    tag = latest_tag(str(out))
    checkpoint_step = int(tag[4:])
    assert 6 <= checkpoint_step < 12, tag
    killed_metrics = _whole_lines(out / "metrics.jsonl")
    abandoned_before = _whole_lines(out / "abandoned_metrics.jsonl")
    assert [m["step"] for m in killed_metrics][:checkpoint_step] == list(range(1, checkpoint_step + 1))

    again = run_command(command)
    assert again.returncode == 0, again.stderr[-2000:]
    # the same command resumed from that checkpoint, not from the start
    assert re.search(rf"resumed from \S*{tag} at step {checkpoint_step}\b", again.stderr), again.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == checkpoint_step and summary["steps"] == 12
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    # the killed run's records up to the checkpoint stand as it wrote them; its later ones were abandoned by the
    # resume, which logged its first step after the checkpoint
    assert metrics[:checkpoint_step] == killed_metrics[:checkpoint_step]
    new = _jsonl(out / "abandoned_metrics.jsonl")[len(abandoned_before):]
    by_resume = [m for m in new if m["abandoned_because"] == f"resumed from the checkpoint at step {checkpoint_step}"]
    assert [m["step"] for m in by_resume] == [m["step"] for m in killed_metrics if m["step"] > checkpoint_step]
    assert all(m["abandoned_because"].startswith(("resumed from", "rolled back")) for m in new), new
    assert metrics[-1]["micro_batch"] == 2  # the OOM decision survived the kill through the checkpoint
    assert (out / "final" / "model.safetensors").exists()
