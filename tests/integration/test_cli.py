"""The installed `adaptive-ds` console script (setup.cfg's entry point) lists the commands, and runs one."""

import sys
from pathlib import Path

from adaptive_ds.cli import COMMANDS


def test_the_console_script_lists_the_commands_and_runs_one(run_command):
    script = str(Path(sys.executable).parent / "adaptive-ds")  # installed beside this interpreter
    listed = run_command([script, "--help"])
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.startswith("usage: adaptive-ds ")
    assert all(f"\n  {name} " in listed.stdout for name in COMMANDS)
    planned = run_command([script, "plan", "--preset", "debug", "--gpu", "t4", "--ds_config", "debug_cpu.json"])
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert planned.stdout.startswith("debug dense on 1 x t4")
    unknown = run_command([script, "trian"])
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines()[-1].startswith(
        "adaptive-ds: unknown command 'trian'; choose one of train, plan,")
