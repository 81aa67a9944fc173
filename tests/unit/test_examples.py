"""The example scripts are not steered by whatever the caller's shell holds: each takes its settings from variables
of its own (ADAPTIVE_DS_...), named in its header and in examples/README.md, its rendezvous port is not torch's
default, and the tests run them in an environment made from scratch (tests/helpers/common.py: script_env)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers.common import ROOT, script_env

SCRIPTS = sorted((ROOT / "examples").glob("*.sh"))
# ${NAME...} or $NAME of an upper-case name: an environment variable (a script's own variables are lower case)
ENVIRONMENT_VARIABLE = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)")


def _variables(script: Path) -> set[str]:
    body = "\n".join(line for line in script.read_text().splitlines() if not line.startswith("#"))
    return set(ENVIRONMENT_VARIABLE.findall(body))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_reads_only_variables_of_its_own_and_names_them(script):
    variables = _variables(script)
    assert all(v.startswith("ADAPTIVE_DS_") for v in variables), sorted(variables)
    header = "\n".join(line for line in script.read_text().splitlines() if line.startswith("#"))
    readme = (ROOT / "examples" / "README.md").read_text()
    assert all(v in header and f"`{v}`" in readme for v in variables), sorted(variables)


def test_the_scan_sees_the_variables():
    found = set().union(*map(_variables, SCRIPTS))
    assert {"ADAPTIVE_DS_OUT", "ADAPTIVE_DS_DS_CONFIG", "ADAPTIVE_DS_MASTER_PORT", "ADAPTIVE_DS_NODE_RANK"} <= found
    assert _variables(ROOT / "examples" / "own_data.sh") >= {"ADAPTIVE_DS_OUT", "ADAPTIVE_DS_TOKENIZER"}


def test_the_two_node_example_rendezvouses_away_from_torchs_default_port():
    script = (ROOT / "examples" / "torchrun_two_nodes.sh").read_text()
    (default,) = re.findall(r"\$\{ADAPTIVE_DS_MASTER_PORT:-(\d+)\}", script)
    assert default != "29500" and f"default {default}" in script


def test_a_script_runs_in_an_environment_made_from_scratch(monkeypatch):
    """What the caller's shell holds (an OUT or DS_CONFIG of its own, an example's variable, a launcher's) stays out;
    what finds the programs and the caches comes in, the test's Python first on PATH."""
    for name, value in {"OUT": "/nonexistent", "DS_CONFIG": "bogus", "MASTER_PORT": "1", "RANK": "3",
                        "ADAPTIVE_DS_OUT": "/nonexistent", "ADAPTIVE_DS_MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/cache/ops")
    env = script_env(ADAPTIVE_DS_TOKENIZER="bpe:320")
    assert not {"OUT", "DS_CONFIG", "MASTER_PORT", "RANK", "ADAPTIVE_DS_OUT", "ADAPTIVE_DS_MASTER_PORT"} & set(env)
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert (env["TORCH_EXTENSIONS_DIR"], env["ADAPTIVE_DS_TOKENIZER"], env["PYTHONUNBUFFERED"]) == (
        "/cache/ops", "bpe:320", "1")
