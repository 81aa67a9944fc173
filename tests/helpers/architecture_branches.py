"""The detector of architecture and family branches: the places a module tells architectures (dense, moe, ...) or
model families (llama, mixtral, ...) apart by name or by kind, which a new architecture or family would have to be
added to. tests/unit/test_architecture_branches.py (every module outside models/ and presets.py) and
tests/unit/test_families.py (pretrained.py and export/) hold that there are none.

A branch is:

- a comparison (`==`, `!=`, `in`, `not in`, `is`) one side of which is the name of an architecture or family, as a
  string literal or a literal tuple, list or set of them, whatever the other side (`x == "moe"`,
  `settings.arch in ("moe", "hybrid")`); a same-spelt literal about something else (a benchmark case named "dense")
  is allowed by the test's explicit allow-list, with its reason;
- a `match` statement with a case that names one;
- a dict keyed by such names, subscripted or `.get` by an expression (inline: `{"llama": "dense"}.get(kind)`), or
  bound to a name that is subscripted or `.get` by an expression about an architecture or family
  (`DEFAULTS[config.arch]`);
- `.startswith` / `.endswith` on an expression about an architecture or family (`config.arch.startswith("mo")`);
- a spec's kind asked outside models/: `.moe`, `.mod` or `.plain` of a spec (`config.arch_spec.moe`,
  `ARCH_SPECS[name].mod`, `architecture_spec(x).moe`);
- any mention of `uses_moe`, `uses_mod`, `MOE_ARCHITECTURES` or `MOD_ARCHITECTURES` (a name, an attribute, an
  import, or a string such as `getattr(config, "uses_moe")`), the properties and tables that split the
  architectures into kinds.

Not a branch: comparing two values the user gave (`variant.arch != settings.arch`, a consistency check that holds for
any architecture); an architecture's name passed as a value (`model_config(preset, "dense", vocab)`, `{"arch": "mod"}`).
"""

from __future__ import annotations

import ast

from adaptive_ds.models.families import FAMILIES
from adaptive_ds.presets import ARCHITECTURES

NAMES = frozenset({*ARCHITECTURES, *FAMILIES})  # the architectures' names and the families' model types
KIND_NAMES = frozenset({"uses_moe", "uses_mod", "MOE_ARCHITECTURES", "MOD_ARCHITECTURES"})
SPEC_KINDS = frozenset({"moe", "mod", "plain"})  # what a spec says an architecture is made of
_ABOUT = ("arch", "model_type", "family")  # how an expression about an architecture or family is spelt


def names_in(node: ast.AST) -> set[str]:
    """The architecture and family names a literal spells: "moe", or ("moe", "hybrid")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(names_in, node.elts)) if node.elts else set()
    return set()


def _spelt(node: ast.AST, words) -> bool:
    """Whether a name, attribute or call in `node` is spelt with one of `words` (or `node` holds the key "arch")."""
    for part in ast.walk(node):
        spelt = part.id if isinstance(part, ast.Name) else part.attr if isinstance(part, ast.Attribute) else None
        if spelt is not None and any(word in spelt.lower() for word in words):
            return True
        if isinstance(part, ast.Constant) and part.value == "arch":
            return True
    return False


def about_an_architecture(node: ast.AST) -> bool:
    """An expression spelt with "arch", "model_type" or "family": `config.arch`, `case.model["arch"]`."""
    return _spelt(node, _ABOUT)


def _keyed_by_names(node: ast.AST) -> bool:
    return isinstance(node, ast.Dict) and any(key is not None and names_in(key) for key in node.keys)


def _looked_up(node: ast.AST) -> tuple[ast.AST, ast.AST] | None:
    """(the mapping, the key) of `m[key]` or `m.get(key, ...)`."""
    if isinstance(node, ast.Subscript):
        return node.value, node.slice
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return node.func.value, node.args[0]
    return None


def _keyed_tables(tree: ast.AST) -> set[str]:
    """The names (and attribute names) bound to a dict keyed by architecture or family names."""
    tables = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _keyed_by_names(node.value):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, (ast.Name, ast.Attribute)):
                    tables.add(target.id if isinstance(target, ast.Name) else target.attr)
    return tables


def _table_name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _case_names(pattern: ast.AST) -> set[str]:
    return set().union(*(names_in(part.value) for part in ast.walk(pattern) if isinstance(part, ast.MatchValue)))


def _branch(node: ast.AST, tables: set[str]) -> str | None:
    """What makes `node` a branch (the module docstring's kinds), or None."""
    if isinstance(node, ast.Compare):
        named = set().union(*map(names_in, [node.left, *node.comparators]))
        return f"compares with {', '.join(sorted(named))}" if named else None
    if isinstance(node, ast.Match):
        named = set().union(*(_case_names(case.pattern) for case in node.cases))
        return f"matches {', '.join(sorted(named))}" if named else None
    looked_up = _looked_up(node)
    if looked_up is not None:
        table, key = looked_up
        if _keyed_by_names(table) and not isinstance(key, ast.Constant):
            return "looks up a table keyed by names"
        if _table_name(table) in tables and about_an_architecture(key):
            return f"looks up {_table_name(table)}, keyed by names"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("startswith", "endswith") and about_an_architecture(node.func.value):
        return node.func.attr
    if isinstance(node, ast.Attribute) and node.attr in SPEC_KINDS and _spelt(node.value, ("spec",)):
        return f"asks a spec's {node.attr}"
    if isinstance(node, ast.Name) and node.id in KIND_NAMES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in KIND_NAMES:
        return node.attr
    if isinstance(node, ast.Constant) and node.value in KIND_NAMES:
        return f"names {node.value}"
    if isinstance(node, (ast.ImportFrom, ast.Import)):
        imported = [a.name for a in node.names if a.name in KIND_NAMES]
        return f"imports {', '.join(imported)}" if imported else None
    return None


def architecture_branches(source: str) -> list[tuple[int, str, str]]:
    """(line, what, the source of the branch) of each architecture or family branch in `source`."""
    tree = ast.parse(source)
    tables = _keyed_tables(tree)
    found = []
    for node in ast.walk(tree):
        what = _branch(node, tables)
        if what is not None:
            segment = ast.unparse(node) if not isinstance(node, ast.Match) else f"match {ast.unparse(node.subject)}"
            found.append((node.lineno, what, segment))
    return sorted(found)
