"""The package as a wheel: it holds the shipped ds_configs, and installed from it alone (no repository beside it),
the planner, the acceptance run and the `adaptive-ds` console script read a shipped config by its name from any
working directory."""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from helpers.common import ROOT

from adaptive_ds.distributed import DISTRIBUTED_VARIABLES

# Run in the installed copy, from a folder with no ds_configs/ in it.
INSTALLED_CHECK = """
import json, adaptive_ds
from adaptive_ds import ds_config
from adaptive_ds.tools import acceptance, plan
stage = acceptance._ds_config("b1_t4.json", dry=True)["zero_optimization"]["stage"]
print(json.dumps({"package": adaptive_ds.__file__, "b1_t4": ds_config.resolve("b1_t4.json"), "zero_stage": stage}))
plan.main(["--preset", "b1", "--gpu", "t4", "--ds_config", "b1_t4.json"])
"""


def _build_wheel(tmp_path) -> str:
    """A wheel built from a copy of the package's sources (the checkout is left as it was)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "adaptive_ds", source / "adaptive_ds", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("adaptive_ds-*.whl")
    return str(wheel)


@pytest.mark.slow
def test_the_wheel_ships_the_configs_and_the_installed_package_reads_them_by_name(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as contents:
        shipped = {name.rsplit("/", 1)[1]: contents.read(name) for name in contents.namelist()
                   if name.startswith("adaptive_ds/ds_configs/")}
    assert "b1_t4.json" in shipped
    assert shipped == {p.name: p.read_bytes() for p in (ROOT / "adaptive_ds" / "ds_configs").glob("*.json")}

    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(site), wheel], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {**{k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", INSTALLED_CHECK], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert facts["package"].startswith(str(site))  # the installed copy, not the checkout
    assert facts["b1_t4"] == str(site / "adaptive_ds" / "ds_configs" / "b1_t4.json")
    assert facts["zero_stage"] == 2
    assert "b1 dense on 1 x t4" in done.stdout
    # the wheel's console script, the same plan through the one entry point
    done = subprocess.run([str(site / "bin" / "adaptive-ds"), "plan", "--preset", "b1", "--gpu", "t4", "--ds_config",
                           "b1_t4.json"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("b1 dense on 1 x t4")
