"""The package's layout: the library (models, data, training, export, ...) never imports a tool (adaptive_ds/tools);
every module path the docs and the committed reports cite still runs, the moved tools' old paths as aliases."""

import ast
import importlib.util
import json
import re

import pytest
from helpers.common import ROOT
from helpers.deprecated import TOOL_ALIASES

PACKAGE = ROOT / "adaptive_ds"
# The old module paths of the tools, each now an alias that runs the tool's main.
ALIASES = TOOL_ALIASES


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_statements(path):
    """(module, names) of each import statement of the file, relative imports resolved: `import a.b` gives
    ("a.b", []), `from .x import y` gives ("<package>.x", ["y"])."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base, [alias.name for alias in node.names]


def _imports(path) -> set[str]:
    """Every module an import statement of the file names, relative imports resolved (`from . import x` counts x)."""
    found = set()
    for base, names in _import_statements(path):
        found |= {base, *(f"{base}.{n}" for n in names)}
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
    assert {"adaptive_ds.tools.report", "adaptive_ds.tools.report.section_stem"} <= _imports(
        PACKAGE / "tools" / "grid.py")
    assert "adaptive_ds.markdown_sections.replace_section" in _imports(PACKAGE / "training" / "arguments.py")
    assert "adaptive_ds.export.hub" in _imports(PACKAGE / "training" / "loop.py")


@pytest.mark.parametrize(("alias", "tool"), ALIASES.items())
def test_an_old_tool_path_is_an_alias_that_runs_the_tools_main(alias, tool):
    """Nothing but its deprecation warning (tests/unit/test_deprecations.py) and the main guard: importing the alias
    imports no more than `warnings`."""
    path = ROOT / (alias.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    doc, imported, warning, guard = tree.body
    assert f"`{tool}`" in ast.get_docstring(tree) and isinstance(doc, ast.Expr)
    assert ast.unparse(imported) == "import warnings" and ast.unparse(warning).startswith("warnings.warn(")
    assert ast.unparse(guard) == f"if __name__ == '__main__':\n    from {tool} import main\n    main()"
    assert importlib.util.find_spec(tool) is not None


def _cited_modules() -> set[str]:
    texts = [(ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text(), (ROOT / "Makefile").read_text()]
    texts += [p.read_text() for p in sorted([*(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.*")])]
    texts += [json.dumps(json.loads(p.read_text())) for p in sorted((ROOT / "benchmarks").rglob("*.json"))]
    return {m for text in texts for m in re.findall(r"python -m (adaptive_ds[\w.]*)", text)}


def test_every_module_path_the_docs_and_reports_cite_runs():
    cited = _cited_modules()
    # the committed reports' commands cite two of the deprecated aliases; the docs cite the tools' own paths
    assert {"adaptive_ds.grid", "adaptive_ds.benchmark", "adaptive_ds.export", *ALIASES.values()} <= cited
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


# The layers of the library, lowest first: a module imports only from its own layer or below, and no two modules
# import each other, directly or around a loop. The entry points (the CLI, the tools' old module paths, the package's
# lazy facade) sit on top. The tools, above the library, are held to no cycle among themselves.
LAYERS = [
    {"adaptive_ds.markdown_sections", "adaptive_ds.hardware", "adaptive_ds.ds_config"},
    {"adaptive_ds.models"},
    {"adaptive_ds.presets", "adaptive_ds.flops"},
    {"adaptive_ds.data", "adaptive_ds.distributed", "adaptive_ds.pretrained", "adaptive_ds.ds_checkpoint"},
    {"adaptive_ds.export"},
    {"adaptive_ds.training"},
    {"adaptive_ds.generate"},
    {"adaptive_ds.tools"},
    {"adaptive_ds", "adaptive_ds.cli", "adaptive_ds.training.consolidate", *ALIASES},
]


def _layer(module: str) -> int:
    """The layer of the longest name in LAYERS that is `module` or a package above it."""
    best = max((name for layer in LAYERS for name in layer if module == name or module.startswith(name + ".")),
               key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from package import module` names the module, not the
    package; function-level imports count: a lazy import is a dependency too)."""
    modules = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        found = set()
        for base, names in _import_statements(path):
            found |= {f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names} if names else {base}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_and_the_layers_on_hand_worked_cases():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _layer("adaptive_ds.training.checkpoint.manager") == _layer("adaptive_ds.training")
    assert _layer("adaptive_ds.training.consolidate") == len(LAYERS) - 1  # an alias, above training
    assert "adaptive_ds.training.checkpoint.universal" in _import_graph()["adaptive_ds.training.checkpoint.consolidate"]


def test_the_library_imports_only_downward():
    graph = _import_graph()
    upward = sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported if _layer(b) > _layer(a))
    assert upward == []
    assert len(graph) > 60 and sum(map(len, graph.values())) > 150  # the scan sees the package


def test_no_modules_import_each_other():
    assert _cycles(_import_graph()) == []


def test_export_and_generate_import_neither_the_training_code_nor_deepspeed():
    """A final/ folder is exported and sampled where adaptive_ds's training code (and DeepSpeed) need not load;
    a raw DeepSpeed checkpoint is read by adaptive_ds.ds_checkpoint, which imports DeepSpeed only inside the
    function that reassembles ZeRO-3's partitions."""
    graph = _import_graph()
    roots = ["adaptive_ds.generate", *(m for m in graph if m.startswith("adaptive_ds.export"))]
    reached, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert not any(m.startswith("adaptive_ds.training") for m in reached), sorted(reached)
    assert not [m for m in reached if "deepspeed" in _top_level_imports(m)]
    # not even inside a function, but in the one module that reads a raw DeepSpeed checkpoint (ZeRO-3's partitions)
    lazily = [m for m in reached if any(name.split(".")[0] == "deepspeed" for name in _imports(_path(m)))]
    assert lazily == ["adaptive_ds.ds_checkpoint"]


def _path(module: str):
    path = ROOT / (module.replace(".", "/") + ".py")
    return path if path.exists() else ROOT / module.replace(".", "/") / "__init__.py"


def _top_level_imports(module: str) -> set[str]:
    """The modules a module's own body imports (not its functions)."""
    found = set()
    for node in ast.parse(_path(module).read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


# STYLE.md: a file past ~600 lines or a function past ~60 is asking to be split by concern.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 60


def _long_functions(path) -> list[str]:
    """`name:lines` of each function (method, nested function) of the file past MAX_FUNCTION_LINES, counted from
    its `def` line to its last line, docstring included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{node.name}:{length}")
    return found


def test_no_file_past_600_lines_and_no_function_past_60():
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        problems = ([f"{lines} lines"] if lines > MAX_FILE_LINES else []) + _long_functions(path)
        if problems:
            over[path.relative_to(ROOT).as_posix()] = problems
    assert over == {}


def test_the_length_check_on_a_hand_worked_case(tmp_path):
    body = [f"x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1)]  # with its def line: just within the limit
    fits = "\n".join(["def fits():", *(f"    {line}" for line in body)])
    over = "\n".join(["class C:", "    def over(self):", *(f"        {line}" for line in [*body, "y = 1"])])
    path = tmp_path / "m.py"
    path.write_text(f"{fits}\n\n\n{over}\n")
    assert _long_functions(path) == [f"over:{MAX_FUNCTION_LINES + 1}"]
