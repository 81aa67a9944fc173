"""Checkpoints: exact resume after a kill, atomic `latest`, pruning, manifests, a corrupt newest checkpoint set
aside for the previous one, a disk that fills during a save, and clear errors for bad checkpoints."""

import binascii
import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import deepspeed
import pytest
import torch
from helpers.common import ROOT, logged_losses, tiny_config, write_ds_config

from adaptive_ds import distributed
from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.distributed import DISTRIBUTED_VARIABLES
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.training import ConfigError, checkpoint, train
from adaptive_ds.training.checkpoint import CheckpointError, CheckpointSaveError, latest_tag, resume_candidate


def _config(tmp_path, **block):
    return write_ds_config(tmp_path, 2, 2, **{"max_steps": 20, "warmup_steps": 3, "save_steps": 5, **block})


def _digest(directory):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


@pytest.mark.slow
def test_a_killed_run_started_again_logs_the_same_losses(tmp_path):
    config = _config(tmp_path)
    command = [sys.executable, "launchers/train.py", "--ds_config", config, "--output_dir"]
    reference = tmp_path / "reference"
    train(["--ds_config", config, "--output_dir", str(reference)])  # in this process: the same computation

    killed = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    proc = subprocess.Popen([*command, str(killed)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while (latest_tag(str(killed)) or "") < "step00000010" and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tag = latest_tag(str(killed))
    assert tag in ("step00000010", "step00000015"), tag  # killed mid-run, after step 10's checkpoint

    summary = train(["--ds_config", config, "--output_dir", str(killed)])  # the same command, in this process
    assert summary["resumed_from_step"] == int(tag[4:])
    ref, resumed = logged_losses(reference), logged_losses(killed)
    assert sorted(resumed) == list(range(1, 21))
    # Equal up to float32 rounding in the loss reduction (memory alignment after a restart can change the
    # summation order of a reduction); the weights follow the same trajectory.
    assert [resumed[s] for s in range(11, 21)] == pytest.approx([ref[s] for s in range(11, 21)], rel=1e-6, abs=0)
    assert [resumed[s] for s in range(1, 11)] == [ref[s] for s in range(1, 11)]


def test_checkpoints_are_pruned_and_latest_is_complete(tmp_path):
    out = tmp_path / "run"
    train(["--ds_config", _config(tmp_path, max_steps=12, save_steps=3, log_steps=4), "--output_dir", str(out),
           "--keep_last", "2"])
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))
    assert tags == ["step00000009", "step00000012"]
    assert latest_tag(str(out)) == "step00000012"
    where = out / "checkpoints" / "step00000012"
    run = json.loads((where / "run.json").read_text())
    assert run["step"] == 12 and run["data_steps"] == 12 and run["controller"]["knobs"]["micro_batch"] == 2
    # the manifest names every other file of the checkpoint with its size and CRC-32
    manifest = json.loads((where / "manifest.json").read_text())["files"]
    on_disk = {str(p.relative_to(where)): p.read_bytes() for p in where.rglob("*") if p.is_file()}
    assert set(manifest) == set(on_disk) - {"manifest.json", "run.json"}
    assert "tokenizer/tokenizer.json" in manifest and "rng_rank0.pt" in manifest
    assert all(manifest[p] == {"size": len(on_disk[p]), "crc32": binascii.crc32(on_disk[p])} for p in manifest)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4: copy it (`_copy`) before changing it."""
    base = tmp_path_factory.mktemp("finished")
    out = base / "run"
    train(["--ds_config", _finished_config(base), "--output_dir", str(out)])
    return out


def _finished_config(directory, **block):
    return _config(directory, **{"max_steps": 4, "save_steps": 2, "log_steps": 2, **block})


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _set_aside(out, tag):
    """The directories checkpoint `tag` was moved to."""
    return [p for p in (out / "checkpoints").iterdir() if p.name.startswith(f"{tag}.corrupt-")]


def _capture_logs():
    distributed.setup_logging()  # its handler writes to the stderr the test captures


def test_an_incompatible_checkpoint_is_refused_and_left_alone(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path)
    before = _digest(out)
    with pytest.raises(CheckpointError, match="does not match this run: arch 'dense' .this run: 'moe'"):
        train(["--ds_config", _config(tmp_path, max_steps=8), "--output_dir", str(out), "--arch", "moe"])
    assert _digest(out) == before


def test_a_truncated_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(finished_run, tmp_path, capfd):
    out = _copy(finished_run, tmp_path)
    original = logged_losses(out)
    states = out / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt"
    truncated = states.read_bytes()[:1000]
    states.write_bytes(truncated)
    summary = train(["--ds_config", _finished_config(tmp_path), "--output_dir", str(out), "--keep_last", "1"])
    err = capfd.readouterr().err
    assert re.search(r"WARNING .*step00000004 cannot be resumed \(mp_rank_00_model_states.pt has 1000 bytes, its "
                     r"manifest says \d+\); moved aside to step00000004\.corrupt-", err), err[-3000:]
    assert summary["resumed_from_step"] == 2
    # steps 3 and 4 were trained again from step 2's checkpoint: the same losses as the first time
    resumed = logged_losses(out)
    assert sorted(resumed) == [2, 4] and resumed[2] == original[2]
    assert resumed[4] == pytest.approx(original[4], rel=1e-6, abs=0)
    # the evidence survives the new save of step 4 and its prune to one checkpoint
    (aside,) = _set_aside(out, "step00000004")
    assert (aside / "mp_rank_00_model_states.pt").read_bytes() == truncated
    assert latest_tag(str(out)) == "step00000004"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step00000004", aside.name]


def test_flipped_bytes_fail_the_checksum_and_the_previous_checkpoint_is_chosen(finished_run, tmp_path, capfd):
    out = _copy(finished_run, tmp_path)
    shard = out / "checkpoints" / "step00000004" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(data)
    _capture_logs()
    assert resume_candidate(str(out)) == "step00000002"
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt fails its CRC-32 check" in capfd.readouterr().err
    assert latest_tag(str(out)) == "step00000002"
    (aside,) = _set_aside(out, "step00000004")
    assert (aside / shard.name).read_bytes() == data


def test_a_partial_checkpoint_is_never_loaded(finished_run, tmp_path, capfd):
    out = _copy(finished_run, tmp_path)
    root = out / "checkpoints"
    partial = root / "step00000006"  # a save cut off before its run.json: every other file is there
    shutil.copytree(root / "step00000004", partial)
    (partial / "run.json").unlink()
    assert resume_candidate(str(out)) == "step00000004"
    assert partial.is_dir()
    (root / "latest").write_text("step00000006")  # even when `latest` names it
    _capture_logs()
    assert resume_candidate(str(out)) == "step00000004"
    assert "step00000006 cannot be resumed (no run.json: its save did not finish)" in capfd.readouterr().err
    assert latest_tag(str(out)) == "step00000004" and not partial.exists() and _set_aside(out, "step00000006")


def test_with_every_checkpoint_corrupt_the_error_is_one_line_and_nothing_is_deleted(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path)
    for tag in ("step00000002", "step00000004"):
        states = out / "checkpoints" / tag / "mp_rank_00_model_states.pt"
        states.write_bytes(states.read_bytes()[:1000])
    before = {p.name: _digest(p) for p in (out / "checkpoints").iterdir() if p.is_dir()}
    with pytest.raises(CheckpointError, match=r"^no complete checkpoint left in .*step00000004: .*has 1000 bytes.*; "
                                              r"step00000002: .*has 1000 bytes.*start a new --output_dir$"):
        resume_candidate(str(out))
    after = {p.name.split(".corrupt-")[0]: _digest(p) for p in (out / "checkpoints").iterdir() if p.is_dir()}
    assert after == before


def test_a_checkpoint_without_a_manifest_loads_and_one_deepspeed_cannot_load_falls_back(finished_run, tmp_path,
                                                                                          capfd):
    """Checkpoints written before manifests existed: run.json alone admits them; a load failure still falls back."""
    out = _copy(finished_run, tmp_path)
    original = logged_losses(out)
    for tag in ("step00000002", "step00000004"):
        (out / "checkpoints" / tag / "manifest.json").unlink()
    states = out / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:1000])
    assert resume_candidate(str(out)) == "step00000004"  # nothing to check its sizes against
    summary = train(["--ds_config", _finished_config(tmp_path), "--output_dir", str(out)])
    assert re.search(r"WARNING .*step00000004 cannot be resumed \(checkpoint .* cannot be loaded \(.*\)\); moved "
                     r"aside to step00000004\.corrupt-", capfd.readouterr().err)
    assert summary["resumed_from_step"] == 2  # step 2's checkpoint, without a manifest, loaded
    assert logged_losses(out)[4] == pytest.approx(original[4], rel=1e-6, abs=0)
    assert len(_set_aside(out, "step00000004")) == 1


def test_a_finished_run_with_a_larger_budget_continues(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path)
    summary = train(["--ds_config", _config(tmp_path, max_steps=6, save_steps=2, log_steps=2),
                     "--output_dir", str(out)])
    assert summary["resumed_from_step"] == 4 and sorted(logged_losses(out)) == [2, 4, 6]
    with pytest.raises(ValueError, match="pass --resume auto"):
        train(["--ds_config", _config(tmp_path, max_steps=8), "--output_dir", str(out), "--resume", "never"])


def _tiny_engine(directory):
    distributed.init_distributed()
    config = json.loads(Path(write_ds_config(directory)).read_text())
    del config["adaptive_ds"]
    model = AdaptiveDSForCausalLM(tiny_config("dense"))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train_step(engine):
    ids = torch.randint(0, 64, (2, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def _disk_bytes(directory):
    """What the files under `directory` take on a filesystem of 4 KiB blocks."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in Path(directory).rglob("*") if p.is_file())


def _fill_disk_at(monkeypatch, disk: Path, size: int) -> list[str]:
    """Where no tmpfs can be mounted: torch.save under `disk` (DeepSpeed's checkpoint engine writes its states with
    it, and we the RNG states) writes onto a disk of `size` bytes, and a file that does not fit is written as far as
    it fits and then fails with ENOSPC, as on a full filesystem. Returns the files that failed."""
    real_save, used, failed = torch.save, [0], []

    def save(obj, f, *args, **kwargs):
        if not str(f).startswith(str(disk)):
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data, room = buffer.getvalue(), size - used[0]
        with open(f, "wb") as out:
            out.write(data[:room])
        used[0] += min(len(data), room)
        if len(data) > room:
            failed.append(str(f))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    monkeypatch.setattr(torch, "save", save)
    return failed


def test_a_save_that_fills_the_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    engine, tokenizer = _tiny_engine(tmp_path), embedded_tokenizer()
    _train_step(engine)
    probe = tmp_path / "probe"  # measures a checkpoint, to size a disk that holds one and a half
    checkpoint.save(engine, str(probe), 1, {"step": 1}, 2, tokenizer)
    disk = tmp_path / "disk"
    disk.mkdir()
    size = _disk_bytes(probe) + _disk_bytes(probe / "checkpoints" / "step00000001") // 2
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(disk)],
                             capture_output=True, text=True).returncode == 0
    if mounted:
        failed, free = None, r"[\d.]+ (B|KiB)"  # what is left of the full tmpfs
    else:  # a tmpfs needs root: the tensor files, what most of a checkpoint is, fill one and a half checkpoints' room
        tensors = sum(p.stat().st_size for p in (probe / "checkpoints" / "step00000001").rglob("*.pt"))
        failed, free = _fill_disk_at(monkeypatch, disk, tensors * 3 // 2), r"[\d.]+ (B|KiB|MiB|GiB)"
    try:
        out = str(disk / "run")
        checkpoint.save(engine, out, 1, {"step": 1}, 2, tokenizer)
        saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
        _train_step(engine)
        with pytest.raises(CheckpointSaveError, match=r"^checkpoint step00000002 could not be saved in .* \(.*\); "
                           + free + r" free there when it failed; the partial step00000002 was removed and "
                           r"`latest` still names step00000001$"):
            checkpoint.save(engine, out, 2, {"step": 2}, 2, tokenizer)
        if failed is not None:  # the save really ran out of room part-way, in a file of step 2
            assert len(failed) == 1 and "/step00000002/" in failed[0], failed
        assert sorted(os.listdir(disk / "run" / "checkpoints")) == ["latest", "step00000001", "zero_to_fp32.py",
                                                                    "zero_to_torch.py"]
        assert resume_candidate(out) == "step00000001"
        assert not torch.equal(engine.module.state_dict()["lm_head.weight"], saved["lm_head.weight"])
        assert checkpoint.load(engine, out, "step00000001") == {"step": 1}
        for name, value in engine.module.state_dict().items():
            assert torch.equal(value, saved[name]), name
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_a_first_save_that_cannot_create_the_checkpoint_directory_fails_in_one_line(tmp_path, monkeypatch):
    """No permission (or a file system gone read-only) before the first checkpoint: checkpoints/ is never made."""
    engine, tokenizer = _tiny_engine(tmp_path), embedded_tokenizer()
    _train_step(engine)

    def refuse(path, exist_ok=False):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(engine.checkpoint_engine, "makedirs", refuse)
    out = tmp_path / "run"
    with pytest.raises(CheckpointSaveError, match=r"^checkpoint step00000001 could not be saved in .* \("
                       r"PermissionError: \[Errno 13\] Permission denied: .*\); [\d.]+ (B|KiB|MiB|GiB) free there when "
                       r"it failed; the partial step00000001 was removed and `latest` still names no checkpoint$"):
        checkpoint.save(engine, str(out), 1, {"step": 1}, 2, tokenizer)
    assert not (out / "checkpoints").exists()


def test_a_checkpoint_from_before_a_new_model_option_resumes_at_its_default(finished_run, tmp_path):
    out = _copy(finished_run, tmp_path)
    for state in (out / "checkpoints").glob(f"*/{checkpoint.RUN_STATE}"):  # as an older adaptive_ds wrote them
        saved = json.loads(state.read_text())
        del saved["identity"]["model"]["moe_expert_granularity"], saved["identity"]["model"]["moe_balancing"]
        state.write_text(json.dumps(saved))
    before = _digest(out)
    # the option set away from its default: on this dense run a MoE option, which the settings refuse before the
    # checkpoint is read (on an architecture that reads it, a different model: tests/unit/test_checkpoint.py);
    # nothing touched
    with pytest.raises(ConfigError, match=r"model field\(s\) moe_expert_granularity apply to arch moe and hybrid"):
        train(["--ds_config", _config(tmp_path, max_steps=6), "--output_dir", str(out),
               "--model", '{"moe_expert_granularity": 2}'])
    assert _digest(out) == before
    summary = train(["--ds_config", _config(tmp_path, max_steps=6), "--output_dir", str(out)])
    assert summary["tokens_seen"] == 6 * 2 * 2 * 256  # resumed at step 4 and trained on to 6
