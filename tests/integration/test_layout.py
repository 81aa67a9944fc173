"""The layout in a fresh interpreter: every module of the package imports first (no import cycle depends on which
loads first), and every moved tool's old module path runs the tool, as `python -m` runs it."""

import json
import subprocess
import sys

from helpers.common import ROOT
from unit.test_layout import ALIASES, _module_name

# One interpreter for all of them: each module imported after every adaptive_ds module is dropped from sys.modules
# (torch, transformers and deepspeed stay loaded: they are what costs seconds).
IMPORT_EACH_FIRST = """
import importlib, json, sys
failed = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "adaptive_ds" or m.startswith("adaptive_ds.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed[name] = f"{type(error).__name__}: {error}"
print(json.dumps(failed))
"""

# runpy.run_module(alter_sys=True) is what `python -m MODULE ARGS` does with the module.
RUN_EACH_WITH_HELP = """
import contextlib, io, json, runpy, sys
usage = {}
for name in json.loads(sys.argv[1]):
    sys.argv = [name, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
            code = None
        except SystemExit as exited:
            code = exited.code
    usage[name] = [code, out.getvalue()]
print(json.dumps(usage))
"""


def test_every_module_imports_first_in_a_fresh_interpreter(run_command):
    modules = sorted({_module_name(p) for p in (ROOT / "adaptive_ds").rglob("*.py")} - {"adaptive_ds"})
    assert {"adaptive_ds.export.final", "adaptive_ds.export.convert", "adaptive_ds.training.loop",
            "adaptive_ds.tools.plan", "adaptive_ds.cli"} <= set(modules)
    done = run_command([sys.executable, "-c", IMPORT_EACH_FIRST, json.dumps(modules)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_each_old_tool_path_runs_the_tool_and_the_export_package_runs_as_a_module(run_command):
    modules = [*ALIASES, *ALIASES.values(), "adaptive_ds.export"]  # a package: `python -m` runs its __main__
    done = run_command([sys.executable, "-c", RUN_EACH_WITH_HELP, json.dumps(modules)])
    assert done.returncode == 0, done.stderr[-3000:]
    usage = json.loads(done.stdout.strip().splitlines()[-1])
    helps = {name: text[text.index("usage: "):] for name, (code, text) in usage.items() if code == 0}
    for alias, tool in ALIASES.items():
        assert alias in helps and "--help" in helps[alias], usage[alias]
        # the alias prints the tool's own help: after the usage lines (wrapped to the program's name), the same text
        assert helps[alias].split("\n\n", 1)[1] == helps[tool].split("\n\n", 1)[1], alias
    assert "adaptive_ds.export" in helps, usage["adaptive_ds.export"]
    assert "--to {adaptive_ds,llama," in " ".join(helps["adaptive_ds.export"].split()), usage["adaptive_ds.export"]


def test_exporting_and_sampling_load_neither_the_training_code_nor_deepspeed():
    """As imported for real (the static check is tests/unit/test_layout.py): `python -m adaptive_ds.export` and
    `python -m adaptive_ds.generate` leave DeepSpeed and adaptive_ds.training unloaded."""
    probe = ("import sys, adaptive_ds.generate, adaptive_ds.export.__main__, adaptive_ds.export.hub\n"
             "loaded = [m for m in sys.modules\n"
             "          if m.split('.')[0] == 'deepspeed' or m.startswith('adaptive_ds.training')]\n"
             "print(loaded)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
