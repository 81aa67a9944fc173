"""A Slurm job without --output_dir that is requeued (the same SLURM_JOB_ID) resumes in the directory its first start
made, instead of starting another time-stamped run."""

import json
import signal
import subprocess
import sys

import pytest
from helpers.common import ROOT, script_env, write_ds_config

from adaptive_ds.training.checkpoint import latest_tag


def _run(args: list[str], cwd, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=script_env(**env), capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_a_requeued_job_resumes_in_its_own_directory(tmp_path):
    config = write_ds_config(tmp_path, 2, 1, max_steps=5, warmup_steps=1, save_steps=2, log_steps=1)
    faults = json.dumps({"kill_before_step": 4})
    killed = _run([str(ROOT / "tests/helpers/train_with_faults.py"), faults, "--ds_config", config], tmp_path,
                  SLURM_JOB_ID="8123", SLURM_RESTART_COUNT="0")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "runs" / "debug-dense-slurm-8123"
    assert latest_tag(str(out)) == "step00000002"

    requeued = _run([str(ROOT / "launchers/train.py"), "--ds_config", config], tmp_path, SLURM_JOB_ID="8123",
                    SLURM_RESTART_COUNT="1")
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert "resumed from step00000002 at step 2" in requeued.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["debug-dense-slurm-8123"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["requeues"]) for r in records] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
