"""Architectures live in models/ (and their variants in presets.py): no other module of adaptive_ds branches on one.

An architecture branch is what a new architecture would have to be added to:

- a comparison (`==`, `!=`, `in`, `not in`, `is`) between an architecture's name, as a string literal or a literal
  tuple, list or set of them, and an expression about an architecture (a name or attribute spelt with "arch", or a
  subscript by the key "arch"): `config.arch == "moe"`, `settings.arch in ("moe", "hybrid")`;
- any reference to `uses_moe`, `uses_mod`, `MOE_ARCHITECTURES` or `MOD_ARCHITECTURES`, the properties and tables
  that split the architectures into kinds.

Allowed, and not architecture knowledge: comparing two values the user gave, `variant.arch != settings.arch` (a
consistency check that holds for any architecture, a new one included); a literal of the same spelling about
something else (a benchmark case or grid variant named "dense"); an architecture's name passed as a value
(`model_config(preset, "dense", vocab)`). The modules ask the model, its configuration or its spec instead
(adaptive_ds/models/spec.py).
"""

import ast

from helpers.common import ROOT

from adaptive_ds.presets import ARCHITECTURES

PACKAGE = ROOT / "adaptive_ds"
KIND_NAMES = {"uses_moe", "uses_mod", "MOE_ARCHITECTURES", "MOD_ARCHITECTURES"}


def _names_in(node: ast.AST) -> set[str]:
    """The architecture names a literal operand spells: "moe", or ("moe", "hybrid")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(ARCHITECTURES)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_names_in, node.elts)) if node.elts else set()
    return set()


def _about_an_architecture(node: ast.AST) -> bool:
    """An expression spelt with "arch": `arch`, `config.arch`, `entry.arch`, `case.model["arch"]`."""
    for part in ast.walk(node):
        if isinstance(part, ast.Name) and "arch" in part.id.lower():
            return True
        if isinstance(part, ast.Attribute) and "arch" in part.attr.lower():
            return True
        if isinstance(part, ast.Constant) and part.value == "arch":
            return True
    return False


def architecture_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of each architecture branch in `source` (the module docstring says what one is)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = [op for op in operands if _names_in(op)]
            if named and any(_about_an_architecture(op) for op in operands if op not in named):
                found.append((node.lineno, f"compares with {', '.join(sorted(set().union(*map(_names_in, named))))}"))
        elif isinstance(node, ast.Name) and node.id in KIND_NAMES:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in KIND_NAMES:
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            found += [(node.lineno, f"imports {a.name}") for a in node.names if a.name in KIND_NAMES]
    return sorted(found)


def _checked_files():
    """Every module of the package but models/ and presets.py, and the temporary allow-list."""
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("models/") or relative == "presets.py":
            continue
        yield relative, path


def test_no_module_outside_models_and_presets_branches_on_an_architecture():
    checked = dict(_checked_files())
    # the trainer, its arguments, export and the planner are in the scope
    assert {"training/loop.py", "training/arguments.py", "export/final.py", "tools/plan.py"} <= set(checked)
    branches = [f"{name}:{line}: {what}" for name, path in checked.items()
                for line, what in architecture_branches(path.read_text())]
    assert not branches, "architecture branches outside models/ and presets.py (ask the model or its spec):\n" + \
        "\n".join(branches)


PLANTED = '''\
def f(config, settings, source, variant, name, case):
    if config.arch == "moe":
        pass
    if settings.arch in ("mod", "hybrid"):
        pass
    if "dense" != source.arch:
        pass
    if config.uses_mod:
        pass
    return arch not in ["hybrid"], case.model["arch"] == "dense"
from ..presets import MOE_ARCHITECTURES
'''

ALLOWED = '''\
def g(variant, settings, name, results, model_config):
    if variant.arch != settings.arch:  # two user values: a consistency check
        pass
    if name != "dense" and "dense" in results:  # a benchmark case of that name
        pass
    if settings.arch == "bogus":  # not an architecture
        pass
    return model_config("b1", "moe", 32000), {"arch": "mod"}
'''


def test_the_detector_finds_a_planted_branch_of_each_kind_and_nothing_else():
    assert architecture_branches(PLANTED) == [
        (2, "compares with moe"), (4, "compares with hybrid, mod"), (6, "compares with dense"), (8, "uses_mod"),
        (10, "compares with dense"), (10, "compares with hybrid"), (11, "imports MOE_ARCHITECTURES")]
    assert architecture_branches(ALLOWED) == []
