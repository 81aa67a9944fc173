"""The product speaks only of itself: its code, tests, docs and committed results name no absolute path of a machine
that built or measured them, and say nothing about how the project is developed (who worked on it, in which
sittings, on which borrowed machine, under which ticket)."""

import ast
import re
from pathlib import Path

import pytest
from helpers.common import ROOT

# What ships, or is published with it: the package, its entry points and configs, the tests, the build, the docs and
# the committed results (examples/, docs/ and a CHANGELOG once they exist).
SCOPE = ("adaptive_ds", "launchers", "ds_configs", "tests", "examples", "docs", "benchmarks", "Makefile", "setup.cfg",
         "pyproject.toml", "README.md", "BENCHMARKS.md", "CHANGELOG.md")
BINARY = (".png", ".jpg", ".gz", ".bin", ".safetensors", ".pt", ".pyc")

# An absolute path under a place where a machine keeps its users' and jobs' files. Paths a user may own on any
# machine (`/data/...` in an example) and system paths an error message names (`/dev/shm`, `/proc/...`) are not
# machine-specific, so they are not matched.
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|tmp|root|home|Users|mnt|scratch|private/var|var/folders)/")

# Words about how the project is made rather than what it does.
DEVELOPMENT = re.compile("|".join([
    r"\bsessions?\b",  # the sittings the project was built in
    r"\blent\b", r"\bnot drawn\b",  # borrowed machines
    r"\.\./shared\b", r"(?<![\w/])shared/(?:anchors|gpu|notes)\b",  # the development workspace beside the checkout
    r"\bissue ?#\d+", r"(?<![a-z])(?:the|this|scale)[ _]issue",  # tickets the work was asked in
    r"\bhelper agents?\b", r"\bthe brief\b", r"\bproject's brief\b", r"\bbrief that defines\b",
    r"\bwheels\.sh\b", r"\.whl/", r"\boffline wheels?\b", r"\bdevice tool\b",  # installing on the borrowed machine
    r"\bthis project's [\w-]+ machines?\b",  # the machines it was developed on
    r"\bpreamble\.md\b", r"\bnotes/task",
    # the reference runs the project was checked against, by their development name (in the product: "an external
    # reference"); not a regex's anchors or an HTML anchor
    r"\banchor(?:'s|s')", r"\bthe anchors\b",
    r"\banchors? (?:models?|runs?|scripts?|figures?|measurements?|llamas?|machines?|references?)\b",
]), flags=re.I)
# Test docstrings also say what holds, not how the test came to be written.
TEST_HISTORY = re.compile(r"\bbefore (?:the|this) fix\b|\bafter (?:the|this) fix\b|\breviewers?\b|\bthe task\b", re.I)

# What must legitimately appear, each with why. (file, text of the line that holds it)
ALLOWED = {
    # pytest's session: the test run, whose one disk cache this comment describes
    ("tests/conftest.py", "# One disk cache of derived corpus figures for the whole session and its subprocesses"),
    # this file's own patterns and their comments
    *((("tests/unit/test_product_text.py", None),)),
}


def _files() -> list[Path]:
    found = []
    for name in SCOPE:
        path = ROOT / name
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += [p for p in sorted(path.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                      and p.suffix not in BINARY]
    return found


def _allowed(path: Path, line: str) -> bool:
    relative = path.relative_to(ROOT).as_posix()
    return (relative, None) in ALLOWED or any(relative == f and text in line for f, text in ALLOWED if text)


def _hits(pattern: re.Pattern) -> list[str]:
    hits = []
    for path in _files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            match = pattern.search(line)
            if match and not _allowed(path, line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return hits


def test_the_scope_is_read():
    names = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert {"README.md", "BENCHMARKS.md", "Makefile", "adaptive_ds/grid.py", "tests/conftest.py",
            "benchmarks/grid_debug_embedded-hard.json"} <= names


def test_no_absolute_path_of_a_machine():
    assert _hits(MACHINE_PATH) == []


def test_no_words_about_how_the_project_is_developed():
    assert _hits(DEVELOPMENT) == []


def test_test_docstrings_say_what_holds():
    hits = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                match = TEST_HISTORY.search(doc) or DEVELOPMENT.search(doc)
                if match and path.name != "test_product_text.py":
                    hits.append(f"{path.relative_to(ROOT)}: {getattr(node, 'name', 'module')}: {match.group(0)!r}")
    assert hits == []


@pytest.mark.parametrize(("text", "found"), [
    ("see /work/grid/runs/x", True), ("--work /tmp/dbench", True), ("/home/alice/data", True),
    ("runs/grid/x and data/text_prepared", False), ("/dev/shm is full", False), ("a/tmp/b", False),
])
def test_the_path_pattern(text, found):
    assert bool(MACHINE_PATH.search(text)) == found


@pytest.mark.parametrize(("text", "found"), [
    ("the sessions that built this project", True), ("the H200 lent to some", True), ("issue #12's", True),
    ("../shared/gpu/wheels.sh", True), ("the brief fixes moe", True), ("test_table_matches_the_issue", True),
    ("on this project's CPU machines", True), ("torchrun's agent sends SIGTERM", False),
    ("a ticketing system", False), ("shared memory", False), ("every issue is collected", False),
    ("the anchor's 1.10B Llama", True), ("The anchors' 1.10B Llama", True), ("checked on the anchor model", True),
    ("as the anchors write them", True), ("the regex anchors ^ and $", False), ("fullmatch anchors the pattern", False),
    ("an HTML anchor link", False), ("anchored at the first token", False),
])
def test_the_development_pattern(text, found):
    assert bool(DEVELOPMENT.search(text)) == found
