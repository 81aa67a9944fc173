"""Checkpoint saves that fail, on the real engine (tests/helpers/faults.py installs each fault in the saving run):
a full disk at chosen saves (the run goes on and the next save point tries again; max_failed_saves failures in a row
stop it with one line), a write of the manifest, run.json or `latest` that raises or is cut off by a kill, and a
checksum mismatch in the newest checkpoint that only rank 1 of 2 finds. Each leaves the previous checkpoint usable:
the same command resumes from it, and the losses after the resume equal an uninterrupted run's."""

import json
import re
import signal
import sys

import pytest
from helpers.common import ROOT, logged_losses, write_ds_config
from helpers.faults import Faults

from adaptive_ds.training import train
from adaptive_ds.training.checkpoint import SavesFailedError, latest_tag

FAULTS_SCRIPT = str(ROOT / "tests" / "helpers" / "train_with_faults.py")
STEPS = 8
NO_SPACE = r"OSError: \[Errno 28\] No space left on device: '[^']+'"


def _config(directory) -> str:
    return write_ds_config(directory, 2, 1, max_steps=STEPS, save_steps=2, log_steps=1, warmup_steps=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The per-step losses of the uninterrupted run, trained in this process."""
    directory = tmp_path_factory.mktemp("reference")
    train(["--ds_config", _config(directory), "--output_dir", str(directory / "run")])
    return logged_losses(directory / "run")


def _with_faults(faults: dict, config: str, out, *args) -> list[str]:
    return [sys.executable, FAULTS_SCRIPT, json.dumps(faults), "--ds_config", config, "--output_dir", str(out), *args]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _resume_and_compare(config: str, out, reference: dict, tag: str, *args) -> None:
    """The same command, the fault gone: it resumes from checkpoint `tag`, and its losses equal the reference's."""
    summary = train(["--ds_config", config, "--output_dir", str(out), *args])
    resumed_at = int(tag[4:])
    assert summary["resumed_from_step"] == resumed_at and summary["steps"] == STEPS
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert [losses[s] for s in range(1, resumed_at + 1)] == [reference[s] for s in range(1, resumed_at + 1)]
    after = range(resumed_at + 1, STEPS + 1)
    assert [losses[s] for s in after] == pytest.approx([reference[s] for s in after], rel=1e-6, abs=0)
    assert latest_tag(str(out)) == f"step{STEPS:08d}"


@pytest.mark.slow
def test_a_failed_save_is_counted_and_the_next_save_point_saves(reference, tmp_path, run_command):
    config, out = _config(tmp_path), tmp_path / "run"
    # step 2's save meets a full disk, step 4's succeeds; the process is killed before step 6
    killed = run_command(_with_faults({"full_disk_at_saves": [2], "kill_before_step": 6}, config, out))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert re.search(r"WARNING .*checkpoint step00000002 could not be saved in .* \(" + NO_SPACE + r"\); .* free "
                     r"there when it failed; the partial step00000002 was removed and `latest` still names no "
                     r"checkpoint; training goes on and the next save point tries again \(1 of max_failed_saves 3 "
                     r"failed in a row\)", killed.stderr), killed.stderr[-3000:]
    assert latest_tag(str(out)) == "step00000004" and not (out / "checkpoints" / "step00000002").exists()
    # each record counts the saves that failed before it: in a row (reset by step 4's save), and in all
    records = _records(out)
    assert [(r["step"], r["failed_saves"], r["failed_saves_total"]) for r in records] == [
        (1, 0, 0), (2, 0, 0), (3, 1, 1), (4, 1, 1), (5, 0, 1)]
    assert [r["loss"] for r in records] == [reference[s] for s in range(1, 6)]  # the failure changed no step
    _resume_and_compare(config, out, reference, "step00000004")


@pytest.mark.slow
def test_max_failed_saves_in_a_row_stop_the_run_with_one_line_and_the_same_command_resumes(reference, tmp_path,
                                                                                           run_command):
    config, out = _config(tmp_path), tmp_path / "run"
    stopped = run_command(_with_faults({"full_disk_at_saves": [4, 6]}, config, out, "--max_failed_saves", "2"))
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    line = stopped.stderr.splitlines()[-1]
    assert re.fullmatch(r"error: 2 checkpoint saves in a row failed \(max_failed_saves 2\), the last at step 6 \("
                        + NO_SPACE + r"\); the last good checkpoint is \S+/checkpoints/step00000002; rerun the same "
                        r"command to resume from it once that is fixed", line), stopped.stderr[-3000:]
    assert "step00000006/mp_rank_00_model_states.pt" in line
    assert latest_tag(str(out)) == "step00000002" and not (out / "summary.json").exists()
    # the failure that stopped the run is counted in its step's record: the run ends there, no record comes after
    assert [(r["step"], r["failed_saves"]) for r in _records(out)] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 2)]
    _resume_and_compare(config, out, reference, "step00000002", "--max_failed_saves", "2")


@pytest.mark.slow
@pytest.mark.parametrize("name, how", [("manifest.json", "raise"), ("run.json", "kill"), ("latest", "raise"),
                                       ("latest", "kill")])
def test_a_failed_write_of_the_manifest_run_json_or_latest_leaves_the_previous_checkpoint(reference, tmp_path,
                                                                                          run_command, name, how):
    """At the run's last save, where nothing saves after it: every file of the checkpoint is written, then the
    write of `name` raises (a full disk) or the process is killed while its temporary copy is half written."""
    config, out = _config(tmp_path), tmp_path / "run"
    if how == "kill":
        killed = run_command(_with_faults({"write_fault": [name, STEPS, how]}, config, out))
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    else:  # in this process: the error whose one line the command ends with (exit status 1, as tested above)
        with Faults(write_fault=[name, STEPS, how]) as faults, pytest.raises(
                SavesFailedError, match=r"^the checkpoint of the run's last step 8 could not be saved \(" + NO_SPACE
                + r"\); the last good checkpoint is \S+/checkpoints/step00000006; rerun the same command to resume "
                r"from it once that is fixed$"):
            train(["--ds_config", config, "--output_dir", str(out)], hooks=faults)
        assert not (out / "checkpoints" / "step00000008").exists()  # the partial checkpoint was removed
    assert latest_tag(str(out)) == "step00000006" and not (out / "summary.json").exists()
    _resume_and_compare(config, out, reference, "step00000006")
    # nothing the failure left behind remains, and nothing was set aside: the previous checkpoint was whole
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest", "step00000006", "step00000008", "zero_to_fp32.py", "zero_to_torch.py"]


@pytest.mark.slow
def test_a_checksum_mismatch_only_rank_1_finds_resumes_every_rank_from_the_previous_checkpoint(tmp_path,
                                                                                               run_command):
    config = write_ds_config(tmp_path, 2, 1, max_steps=4, save_steps=2, log_steps=1, warmup_steps=2)
    out = tmp_path / "run"
    command = ["torchrun", "--nproc_per_node", "2", "launchers/train.py", "--ds_config", config, "--output_dir",
               str(out)]
    first = run_command(command)
    assert first.returncode == 0, first.stderr[-3000:]
    original = logged_losses(out)
    # a resume verifies file i of the manifest on rank i % 2: a byte of rank 1's ZeRO shard, which only rank 1 reads
    where = out / "checkpoints" / "step00000004"
    files = list(json.loads((where / "manifest.json").read_text())["files"])
    (victim,) = [path for path in files[1::2] if path.startswith("zero_pp_rank_1_")]
    data = bytearray((where / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (where / victim).write_bytes(data)

    again = run_command(command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(rf"WARNING .*step00000004 cannot be resumed \({victim} fails its CRC-32 check", again.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 2
    losses = logged_losses(out)
    assert [losses[1], losses[2]] == [original[1], original[2]]
    assert [losses[3], losses[4]] == pytest.approx([original[3], original[4]], rel=1e-6, abs=0)
    (aside,) = [p for p in (out / "checkpoints").iterdir() if p.name.startswith("step00000004.corrupt-")]
    assert (aside / victim).read_bytes() == data
