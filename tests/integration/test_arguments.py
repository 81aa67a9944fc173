"""Bad settings stop the training command (and its launcher) with one line, before the process group exists and
without touching earlier outputs."""

import sys

import pytest
from helpers.common import DEBUG_CPU, debug_cpu_config


def test_bad_model_overrides_stop_training_before_the_process_group_and_the_output(tmp_path, run_command):
    # A fresh interpreter: in this one an earlier test's run may have left a process group behind.
    out = tmp_path / "run"
    path = debug_cpu_config(tmp_path, block={"arch": "mod", "model": {"mod_capacity": 2}})
    code = ("import sys, torch.distributed as dist; from adaptive_ds.training import train; "
            "from adaptive_ds.training.arguments import ConfigError\n"
            f"try: train(['--ds_config', {path!r}, '--output_dir', {str(out)!r}])\n"
            "except ConfigError as e: print('refused:', e); sys.exit(3 if dist.is_initialized() else 0)\n"
            "sys.exit(4)")
    result = run_command([sys.executable, "-c", code])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "mod_capacity must be in" in result.stdout and not out.exists()


@pytest.mark.slow
def test_launcher_exits_with_one_line_and_leaves_outputs_alone(tmp_path, run_command):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("earlier run")
    for extra in (["--preset", "b3"], []):  # a bad preset; then a good config into a used directory
        result = run_command(["python", "launchers/train.py", "--ds_config", DEBUG_CPU, "--output_dir", str(out),
                              *extra], timeout=300)
        assert result.returncode != 0
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and ("valid choices" in last or "but no checkpoint; pass a new" in last)
        assert "Traceback" not in result.stderr
        assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
        assert (out / "summary.json").read_text() == "earlier run"
