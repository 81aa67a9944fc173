"""The package's layout: the library (models, data, training, export, ...) never imports a tool (adaptive_ds/tools);
every module path the docs and the committed reports cite still runs, the moved tools' old paths as aliases."""

import ast
import importlib.util
import json
import re

import pytest
from helpers.common import ROOT

PACKAGE = ROOT / "adaptive_ds"
# The old module paths of the tools, each now an alias that runs the tool's main.
ALIASES = {
    "adaptive_ds.acceptance": "adaptive_ds.tools.acceptance",
    "adaptive_ds.benchmark": "adaptive_ds.tools.benchmark",
    "adaptive_ds.grid": "adaptive_ds.tools.grid",
    "adaptive_ds.loss_breakdown": "adaptive_ds.tools.loss_breakdown",
    "adaptive_ds.plan": "adaptive_ds.tools.plan",
    "adaptive_ds.data.benchmark": "adaptive_ds.tools.data_benchmark",
}


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path) -> set[str]:
    """Every module an import statement of the file names, relative imports resolved (`from . import x` counts x)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _library_files():
    """The package's modules but the tools, the aliases and the entry point that dispatches to both."""
    skip = {f"{name}" for name in ALIASES} | {"adaptive_ds.cli"}
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "tools" not in p.relative_to(PACKAGE).parts
            and _module_name(p) not in skip]


def test_the_library_never_imports_a_tool():
    offending = {}
    for path in _library_files():
        tools = sorted(m for m in _imports(path) if m.startswith("adaptive_ds.tools") or m in ALIASES)
        if tools:
            offending[_module_name(path)] = tools
    assert offending == {}
    assert len(_library_files()) > 40  # the scan sees the library


def test_the_import_resolver_on_hand_worked_cases(tmp_path):
    assert {"adaptive_ds.tools.report", "adaptive_ds.tools.report.commit"} <= _imports(
        PACKAGE / "tools" / "grid.py")
    assert "adaptive_ds.markdown_sections.replace_section" in _imports(PACKAGE / "training" / "arguments.py")
    assert "adaptive_ds.export.final" in _imports(PACKAGE / "training" / "loop.py")


@pytest.mark.parametrize(("alias", "tool"), ALIASES.items())
def test_an_old_tool_path_is_an_alias_that_runs_the_tools_main(alias, tool):
    path = ROOT / (alias.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    doc, guard = tree.body[0], tree.body[1:]
    assert f"`{tool}`" in ast.get_docstring(tree) and isinstance(doc, ast.Expr)
    (block,) = guard  # nothing but the main guard: importing the alias imports nothing
    assert ast.unparse(block) == f"if __name__ == '__main__':\n    from {tool} import main\n    main()"
    assert importlib.util.find_spec(tool) is not None


def _cited_modules() -> set[str]:
    texts = [(ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text(), (ROOT / "Makefile").read_text()]
    texts += [p.read_text() for p in sorted([*(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.*")])]
    texts += [json.dumps(json.loads(p.read_text())) for p in sorted((ROOT / "benchmarks").rglob("*.json"))]
    return {m for text in texts for m in re.findall(r"python -m (adaptive_ds[\w.]*)", text)}


def test_every_module_path_the_docs_and_reports_cite_runs():
    cited = _cited_modules()
    assert {"adaptive_ds.grid", "adaptive_ds.plan", "adaptive_ds.benchmark", "adaptive_ds.acceptance",
            "adaptive_ds.loss_breakdown", "adaptive_ds.data.benchmark", "adaptive_ds.export"} <= cited
    for module in sorted(cited):
        spec = importlib.util.find_spec(module)
        assert spec is not None, module
        if spec.submodule_search_locations:  # a package runs its __main__
            spec = importlib.util.find_spec(f"{module}.__main__")
            assert spec is not None, f"{module} has no __main__"
        source = open(spec.origin).read()
        assert re.search(r'^if __name__ == "__main__":\n', source, flags=re.M), f"{module} runs nothing"


def test_tests_take_shared_fixtures_from_conftest_and_helpers_as_modules():
    """Shared set-up is a fixture of tests/conftest.py (or a plain helper in tests/helpers/): no test imports
    conftest, and every test file is under tests/unit or tests/integration."""
    tests = ROOT / "tests"
    importing = [p.relative_to(ROOT).as_posix() for p in sorted(tests.rglob("*.py"))
                 if re.search(r"^\s*(from conftest import|import conftest)", p.read_text(), flags=re.M)]
    assert importing == []
    assert {p.relative_to(tests).parts[0] for p in tests.rglob("test_*.py")} == {"unit", "integration"}


def test_a_unit_test_starts_no_process_and_builds_no_engine():
    """tests/unit/conftest.py refuses both at the call, so a test that needs them fails until it moves to
    tests/integration."""
    import multiprocessing
    import subprocess

    import deepspeed

    for call in (lambda: subprocess.run(["true"]), lambda: multiprocessing.Process(target=print).start(),
                 lambda: deepspeed.initialize(model=None)):
        with pytest.raises(AssertionError, match="it belongs in tests/integration"):
            call()
