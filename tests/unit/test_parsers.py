"""Every command-line parser of the package, its launchers and its examples takes flags only as spelt: argparse's
prefix matching (on by default) would read `--max_step 10` as `--max_steps 10`, and a flag added later could make a
user's abbreviation mean another flag. Each parser is found in the source, so a new one cannot escape the check."""

from __future__ import annotations

import ast

import pytest
from helpers.common import ROOT

from adaptive_ds.training.arguments import build_parser

SOURCES = sorted([*(ROOT / "adaptive_ds").rglob("*.py"), *(ROOT / "launchers").rglob("*.py"),
                  *(ROOT / "examples").glob("*.py")])


def _name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _parser_calls(path) -> list[ast.Call]:
    """The calls that build a parser in a file: argparse.ArgumentParser(...), a subclass of it defined in the file,
    and a subparsers action's add_parser(...)."""
    tree = ast.parse(path.read_text())
    kinds = {"ArgumentParser", "add_parser"} | {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                                                and any(_name(base) == "ArgumentParser" for base in node.bases)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and _name(node.func) in kinds]


PARSERS = [pytest.param(path, call, id=f"{path.relative_to(ROOT)}:{call.lineno}")
           for path in SOURCES for call in _parser_calls(path)]


def test_the_scan_finds_the_parsers():
    found = {path.relative_to(ROOT).as_posix() for path, _ in (p.values for p in PARSERS)}
    assert {"adaptive_ds/training/arguments.py", "adaptive_ds/cli.py", "adaptive_ds/data/prepare.py",
            "adaptive_ds/tools/plan.py", "adaptive_ds/tools/grid.py", "adaptive_ds/export/convert.py",
            "adaptive_ds/generate.py", "examples/push_to_hub.py"} <= found
    assert len(PARSERS) >= 17


@pytest.mark.parametrize(("path", "call"), PARSERS)
def test_every_parser_refuses_abbreviated_flags(path, call):
    keywords = {k.arg: k.value for k in call.keywords}
    assert "allow_abbrev" in keywords and isinstance(keywords["allow_abbrev"], ast.Constant) \
        and keywords["allow_abbrev"].value is False, f"pass allow_abbrev=False: {ast.unparse(call)[:120]}"


def test_an_abbreviated_training_flag_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["--ds_config", "debug_cpu.json", "--max_step", "10"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unrecognized arguments: --max_step 10; ")
    assert "did you mean --max_steps?" in err
