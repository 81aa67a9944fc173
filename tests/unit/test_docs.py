"""The docs cannot rot: every command README.md and docs/ show is run by a test (fenced blocks tagged `bash run`,
tests/integration/test_docs_commands.py, which checks the effect each page claims for them) or checked here, and
these first too: each command through the parser that reads it (a launcher's, the training run's, a tool's) and then
through what that program checks before it does any work (the training run's settings and ds_config checks; a tool's
own `check(args)`: the ds_config reader, the grid's variant parser, the folders and files it reads must exist).

Paths: a page's commands are checked in order in an empty directory that stands for the repository's root. What an
earlier command writes (a run's final/ and checkpoints/, an export, a prepare) is made there as an empty stand-in,
and so is what the reader brings, named per page in `PRIOR` of tests/helpers/doc_commands.py (README's
`runs/my-run`: a run of your own); any other path does not exist, so a command reading what nothing made is refused.
Stand-ins are checked for existence only; what is in them is the `bash run` blocks' to show. A Hub id is checked for
its form, not looked up. What a page writes, no other page names (following two pages never mixes two runs).

Also: `json check` blocks through the ds_config reader, `python check` blocks compile and import what exists; the
commands BENCHMARKS.md's sections record are checked the same way; every flag the pages, BENCHMARKS.md,
examples/README.md, the example scripts' usage lines and CHANGELOG.md name is one some parser defines (CHANGELOG.md
may name an old flag or module path in an entry that says it was renamed or removed); every relative link resolves,
to the heading its anchor names; every BENCHMARKS.md section a page or a code comment cites by key exists; and the
README stays a landing page."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import importlib
import importlib.util
import io
import itertools
import json
import re
import shlex
import tokenize
from pathlib import Path

import pytest
from helpers.common import DEBUG_CPU, ROOT
from helpers.doc_commands import PRIOR, check, checking, shared_directories, stand_in, top_directory

from adaptive_ds.presets import PRESETS
from adaptive_ds.training import arguments
from adaptive_ds.training.arguments import parse

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "CHANGELOG.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "examples").glob("*.md"))]
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()
SECTIONS = set(re.findall(r"^<!-- ([\w:.+-]+) -->$", BENCHMARKS, flags=re.M)) - {"settings"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", flags=re.S | re.M)
LANGUAGES = {"bash": ("run", "check"), "json": ("check",), "python": ("check",), "text": ()}


def _blocks(path: Path) -> list[tuple[str, str, str, int]]:
    """(language, tag, body, line) of each fenced block of a Markdown file."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        words = match.group(1).split()
        found.append((words[0] if words else "", words[1] if len(words) > 1 else "", match.group(2),
                      text.count("\n", 0, match.start()) + 1))
    return found


def _commands(body: str) -> list[list[str]]:
    """The commands of a shell block, one per logical line (continuations joined, comments dropped)."""
    return [words for line in body.replace("\\\n", " ").splitlines()
            if (words := shlex.split(line, comments=True))]


def _tagged(tag: str, language: str = "bash") -> list:
    """The blocks of that language and tag in README.md and docs/, each a pytest param named by its place."""
    return [pytest.param(body, id=f"{p.relative_to(ROOT)}:{line}") for p in PAGES for lang, t, body, line in _blocks(p)
            if lang == language and t == tag]


def test_every_block_is_tagged_to_run_or_check():
    untagged = [f"{p.relative_to(ROOT)}:{line}: ```{lang} {tag}" for p in PAGES for lang, tag, _, line in _blocks(p)
                if lang not in LANGUAGES or (tag not in LANGUAGES[lang] if LANGUAGES[lang] else tag)]
    assert untagged == [], "tag each block `bash run`, `bash check`, `json check`, `python check`, or `text` (output)"
    runnable = _tagged("run")
    assert 1 <= len(runnable) <= 5, runnable


# A line that opens or closes a fenced block, as a Markdown renderer reads it (indented, of tildes, or longer).
FENCE_LINE = re.compile(r"^ {0,3}(?:`{3,}|~{3,})", flags=re.M)
# A line of a `text` block that reads as a command a user would copy.
COMMAND_LINE = re.compile(r"^\s*(?:\$ |python|\.venv/|deepspeed |torchrun |accelerate |adaptive-ds |make |bash |hf )")
# Pages whose blocks the checks do not read: they show none.
UNCHECKED = [ROOT / "CHANGELOG.md", *sorted((ROOT / "examples").glob("*.md"))]


def _escaping(path: Path, checked: bool = True) -> list[str]:
    """The blocks of a page that no check would read: fences the block reader does not pair (indented, of tildes or
    four backticks, left open), commands in a `text` block, and any block on a page the checks do not read."""
    where, text = path.name, path.read_text()
    fences = len(FENCE_LINE.findall(text))
    if not checked:
        return [f"{where}: a fenced block on a page the docs checks do not read"] if fences else []
    blocks = _blocks(path)
    found = [f"{where}: {fences} fence lines for {len(blocks)} blocks"] if fences != 2 * len(blocks) else []
    # the runner (tests/integration/test_docs_commands.py) reads `lang` or `lang tag`, one space, nothing more
    found += [f"{where}:{text.count(chr(10), 0, m.start()) + 1}: the info string {m.group(1)!r}"
              for m in FENCE.finditer(text) if not re.fullmatch(r"\w+(?: \w+)?", m.group(1))]
    return found + [f"{where}:{line}: a command in a text block" for lang, _, body, line in blocks
                    if lang == "text" and any(COMMAND_LINE.match(row) for row in body.splitlines())]


def test_no_block_escapes_the_checks():
    escaped = [problem for p in PAGES for problem in _escaping(p)]
    escaped += [problem for p in UNCHECKED for problem in _escaping(p, checked=False)]
    assert escaped == []


def test_the_escape_check_finds_what_the_block_reader_misses(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash check\nmake test\n```\n\n- a step:\n\n  ```bash\n  make train\n  ```\n\n"
                    "~~~\npython launchers/train.py --steps_max 5\n~~~\n\n```text\n$ make train\n```\n")
    assert _escaping(page) == ["page.md: 8 fence lines for 2 blocks", "page.md:15: a command in a text block"]
    assert _escaping(page, checked=False) == ["page.md: a fenced block on a page the docs checks do not read"]
    page.write_text("```bash check\nmake test\n```\n\n```text\nHH:MM:SS INFO saved\n```\n")
    assert _escaping(page) == []
    page.write_text("```bash run  \nmake test\n```\n\n```bash check extra\nmake test\n```\n")
    assert _escaping(page) == ["page.md:1: the info string 'bash run  '",
                               "page.md:5: the info string 'bash check extra'"]


def _page_commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line of its block, words) of each command of the page's `bash check` and `bash run` blocks, in order."""
    return [(line, words) for lang, tag, body, line in _blocks(page) if lang == "bash" and tag in ("check", "run")
            for words in _commands(body)]


def _check_page(page: str, commands: list[tuple[int, list[str]]], directory: Path) -> tuple[list[str], str | None]:
    """What the page's commands write, and the first that a check refuses (None: none)."""
    written = []
    with checking(directory, page):
        for line, words in commands:
            try:
                written += check(words)
            except (Exception, SystemExit, pytest.fail.Exception) as error:
                return written, f"{page}:{line}: {shlex.join(words)[:200]}: {type(error).__name__}: {error}"
    return written, None


@pytest.fixture(scope="module")
def checked_pages(tmp_path_factory) -> dict[str, tuple[list[str], str | None]]:
    """Each page's commands checked once, in order, in a directory of its own (tests/helpers/doc_commands.py)."""
    return {page.relative_to(ROOT).as_posix(): _check_page(page.relative_to(ROOT).as_posix(), _page_commands(page),
                                                          tmp_path_factory.mktemp("page"))
            for page in PAGES}


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES if _page_commands(p)])
def test_each_pages_commands_pass_the_tools_own_checks(page, checked_pages):
    """The `bash check` and `bash run` blocks (what the integration test runs is checked here first, cheaply)."""
    written, refused = checked_pages[page]
    assert refused is None


def test_each_page_writes_folders_no_other_page_names(checked_pages):
    """Following two pages never puts two runs in one folder: what a page's commands write, no other page's commands
    write or read."""
    written = {page: paths for page, (paths, _) in checked_pages.items()}
    # BENCHMARKS.md's commands read what docs/benchmarking.md's grids write: the record of how its sections were made
    read = {page: list(paths) for page, paths in PRIOR.items() if page != "BENCHMARKS.md"}
    assert shared_directories(written, read) == []
    assert {"runs/first", "runs/tinyllama-moe", "runs/grid"} <= {top_directory(p) for ps in written.values()
                                                                    for p in ps}


def test_the_shared_folder_check_on_a_hand_worked_case():
    written = {"a.md": ["runs/demo/final", "runs/demo/checkpoints/x.py", "/shared/runs/b"],
               "b.md": ["runs/demo/final", "data/p"], "c.md": ["runs/c-out"]}
    read = {"c.md": ["data/p/x.json.gz"], "a.md": ["runs/my-run"], "b.md": ["runs/my-run"]}
    assert shared_directories(written, read) == ["a.md: runs/demo (also b.md)", "b.md: data/p (also c.md)",
                                                 "b.md: runs/demo (also a.md)"]


def test_every_prior_path_is_one_its_page_reads():
    """A stand-in that no command of its page reads any more is dropped, not kept as a way round the check."""
    for page, paths in PRIOR.items():
        named = {word.replace("{seed}", "*") for word in re.findall(r"[\w./{}*?-]+", (ROOT / page).read_text())}
        for path in paths:  # named as it is, a folder in it, or by a glob
            assert any(fnmatch.fnmatch(path, word) or word.startswith(f"{path}/") for word in named), (page, path)


@pytest.mark.parametrize("body", _tagged("check", "json"))
def test_each_ds_config_block_is_read_by_the_run(body, tmp_path):
    block = json.loads("{" + body + "}")
    config = json.loads(Path(DEBUG_CPU).read_text())
    config.update(block)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    settings, ds_config = parse(["--ds_config", str(path)], 1)
    assert "adaptive_ds" not in ds_config and settings.preset == block["adaptive_ds"]["preset"]


@pytest.mark.parametrize("body", _tagged("check", "python"))
def test_each_python_block_compiles_and_imports_what_exists(body):
    tree = ast.parse(body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module]
            module = importlib.import_module(node.module)
            assert all(hasattr(module, alias.name) for alias in node.names), node.module
        else:
            continue
        assert all(importlib.util.find_spec(name) is not None for name in names), names


def _benchmarks_commands() -> list[str]:
    """Every command a generated section of BENCHMARKS.md records (its provenance line, a table's source column)."""
    sections = re.findall(r"^<!-- ([\w:.+-]+) -->\n(.*?)\n<!-- /\1 -->$", BENCHMARKS, flags=re.S | re.M)
    return sorted({command for _, text in sections
                   for command in re.findall(r"`(python -m adaptive_ds\.[^`]*)`", text)})


@pytest.mark.parametrize("command", _benchmarks_commands())
def test_the_commands_benchmarks_sections_record_pass_the_tools_own_checks(command, tmp_path):
    with checking(tmp_path, "BENCHMARKS.md"):
        check(shlex.split(command))


def test_the_recorded_commands_are_found():
    commands = _benchmarks_commands()
    assert len(commands) >= 15 and any("adaptive_ds.grid" in c for c in commands)
    assert any("adaptive_ds.benchmark --memory" in c for c in commands)


# Each refused by the check, and the same command with that one thing right accepted (so the refusal is that thing's).
BROKEN = [
    ("python -m adaptive_ds.plan --preset b1 --gpu t4 --gpus_total 8", "--gpus_total", "--gpus"),
    ("python launchers/train.py --ds_config ds_configs/debug_cpu.json --arch sparse", "sparse", "moe"),
    ("deepspeed launchers/train.py --ds_config ds_configs/debug_cpu.json --steps_max 5", "--steps_max", "--max_steps"),
    ("python launchers/train_old.py --ds_config ds_configs/debug_cpu.json", "train_old", "train"),
    ("torchrun --nproc_per_node 3 launchers/train.py --ds_config ds_configs/b7_8gpu.json", "3", "8"),
    ("sbatch --nodes 3 --gpus-per-node 4 launchers/slurm/train.sbatch --ds_config ds_configs/b7_8gpu.json", "3", "2"),
    # past argparse: the grid's variant parser, the ds_config reader, a folder nothing made
    ("python -m adaptive_ds.tools.grid --preset debug --tokens 100000 --variants dense moe:bogus", "bogus", "top1"),
    ("python -m adaptive_ds.tools.plan --preset b1 --gpu t4 --ds_config ds_configs/b1_t5.json", "t5", "t4"),
    ("python -m adaptive_ds.tools.grid --ds_config nowhere.json --seeds 1", "nowhere", "debug_cpu"),
    ("python -m adaptive_ds.generate runs/nowhere/final hello", "nowhere", "my-run"),
    ("python -m adaptive_ds.export runs/nowhere runs/my-run-hf", "nowhere", "my-run"),
    ("python -m adaptive_ds.tools.loss_breakdown --models dense=runs/nowhere/final --seed 1", "nowhere", "my-run"),
    ("python runs/nowhere/checkpoints/zero_to_fp32.py runs/nowhere/checkpoints out", "nowhere", "my-run"),
    ("python -m adaptive_ds.tools.plan --init_from runs/nowhere/final --gpu t4", "nowhere", "my-run"),
    ("python launchers/train.py --ds_config debug_cpu.json --init_from runs/nowhere/final", "nowhere", "my-run"),
    ("python launchers/train.py --ds_config debug_cpu.json --data 'data/nowhere/*.json.gz'", "nowhere", "c4/en"),
    ("python -m adaptive_ds.data.prepare --data data/nowhere/*.json.gz --out data/p", "nowhere", "c4/en"),
    ("python -m adaptive_ds.tools.realsize --preset b1 --layers 2 4 --ds_config ds_configs/b1_t5.json", "t5", "t4"),
    ("python -m adaptive_ds.tools.grid --seeds 1 2 3 --extend benchmarks/grid_debug_nowhere.json", "nowhere",
     "embedded-hard"),
    ("python -m adaptive_ds.tools.benchmark --restate benchmarks/throughput_nowhere.json", "nowhere", "debug_cpu"),
]


@pytest.mark.parametrize("command, wrong, right", BROKEN, ids=[c for c, _, _ in BROKEN])
def test_a_wrong_flag_value_or_path_fails_the_check(command, wrong, right, tmp_path):
    """What the checks exist for: a renamed flag, an unknown choice, a moved script, a bad variant, a ds_config or a
    folder that does not exist each fail; the same command with that one word right passes."""
    with checking(tmp_path, "BENCHMARKS.md"):
        for path in ("runs/my-run/final", "runs/my-run/checkpoints/zero_to_fp32.py", "data/c4/en/c.json.gz"):
            stand_in(path)
        with pytest.raises((SystemExit, ValueError, AssertionError, pytest.fail.Exception)):
            check(shlex.split(command))
        check(shlex.split(command.replace(wrong, right)))


def _source_flags() -> set[str]:
    """Every option the project's parsers define: the `--...` string literals of the package, the launchers and the
    examples (the training flags among them come from RunSettings), with their `--no-` forms; and Slurm's options that
    the batch script sets or its usage lines pass."""
    flags = {f"--{f.name}" for f in dataclasses.fields(arguments.RunSettings)}
    flags |= {flag for path in (ROOT / "launchers").rglob("*.sbatch") for flag in _named_flags(path.read_text())}
    for path in [*(ROOT / "adaptive_ds").rglob("*.py"), *(ROOT / "launchers").rglob("*.py"),
                 *(ROOT / "examples").glob("*.py")]:
        flags |= {node.value for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and re.fullmatch(r"--[a-z][\w-]*", node.value)}
    return flags | {f"--no-{flag[2:]}" for flag in flags}


class _Parser(Exception):
    """Raised with the parser a launcher builds, instead of parsing."""


def _launcher_flags(monkeypatch) -> set[str]:
    """The options of torchrun's, DeepSpeed's and Accelerate's launchers, from their own parsers."""
    from accelerate.commands.launch import launch_command_parser
    from deepspeed.launcher.runner import parse_args
    from torch.distributed.run import get_args_parser

    def parser_of(self, args=None, namespace=None):
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parser_of)
    with pytest.raises(_Parser) as deepspeed:
        parse_args([])
    return {option for parser in (get_args_parser(), launch_command_parser(), deepspeed.value.args[0])
            for action in parser._actions for option in action.option_strings}


# Options of other tools the pages name (pip's, in the README's install).
OTHER_FLAGS = {"--index-url"}


def _named_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text))


# Every text a user reads flags in: the pages, BENCHMARKS.md, the examples' README and their scripts' usage lines.
FLAG_TEXTS = [*PAGES, ROOT / "BENCHMARKS.md", ROOT / "examples" / "README.md"]
# What a CHANGELOG.md entry says when it names a flag or a module path that no longer is.
HISTORICAL = re.compile(r"\b(instead of|renamed|removed|moved|was|were|gone|replacing|no longer|refus\w*|"
                        r"abbreviat\w*)\b")


def _usage_lines(path: Path) -> str:
    """The opening comment block of an example script, or its docstring: where its usage lines are."""
    text = path.read_text()
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(text)) or ""
    return "\n".join(itertools.takewhile(lambda line: line.startswith("#"), text.splitlines()))


def _module_exists(name: str) -> bool:
    """A module, or a name a module holds (`adaptive_ds.AdaptiveDSConfig`)."""
    try:
        if importlib.util.find_spec(name) is not None:
            return True
    except ModuleNotFoundError:  # a package above it that is not there
        return False
    parent, _, attribute = name.rpartition(".")
    return _module_exists(parent) and hasattr(importlib.import_module(parent), attribute)


def _changelog_slips(text: str, known: set[str]) -> list[str]:
    """Each CHANGELOG.md entry's flags that no parser defines and module paths that do not import, unless the
    entry says they were renamed, moved or removed (an old module path that still runs, an alias, imports)."""
    slips = []
    for entry in re.split(r"\n(?=- |#)", text):
        modules = set(re.findall(r"`(adaptive_ds(?:\.\w+)+)`|python -m (adaptive_ds[\w.]*)", entry))
        gone = sorted(_named_flags(entry) - known) + sorted(
            {name for pair in modules for name in pair if name and not _module_exists(name)})
        if gone and not HISTORICAL.search(entry):
            slips.append(f"{', '.join(gone)}: {entry.strip()[:80]}")
    return slips


def test_every_flag_a_page_names_exists(monkeypatch):
    """A flag named in prose or in a table (not only in a checked block), in the examples' usage lines, and in
    CHANGELOG.md outside an entry that says it was renamed or removed, is one some parser defines, so that a renamed
    flag cannot live on in a sentence."""
    known = _source_flags() | _launcher_flags(monkeypatch) | OTHER_FLAGS
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in FLAG_TEXTS}
    texts |= {p.relative_to(ROOT).as_posix(): _usage_lines(p) for p in sorted((ROOT / "examples").glob("*.[ps][yh]"))}
    unknown = {page: sorted(_named_flags(text) - known) for page, text in texts.items()}
    assert {page: flags for page, flags in unknown.items() if flags} == {}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert _changelog_slips(changelog, known) == []
    assert {"--section", "--max_step"} <= _named_flags(changelog) - known  # historical, in entries that say so
    assert {"--init_from", "--stages", "--report_only", "--nnodes", "--num_gpus"} <= known
    assert _named_flags("pass `--stages_all` or --max_steps, not a-b--c") - known == {"--stages_all"}
    assert "--tokens" in _named_flags(texts["examples/compare_architectures.sh"])
    assert "--max_new_tokens" in _named_flags(_usage_lines(ROOT / "adaptive_ds" / "generate.py"))


def test_the_changelog_check_on_hand_worked_entries():
    known = {"--name", "--max_steps"}
    text = ("## 0.2\n\n- `--name` instead of `--section` for the key.\n- `--max_step 10` trained as `--max_steps 10`: "
            "refused now.\n- New `--sections` flag,\n  and `adaptive_ds.hub` to push.\n- `python -m adaptive_ds.grid` "
            "still runs; `adaptive_ds.tools.grid`.\n- `export.hub` (was `adaptive_ds.hub`).\n")
    assert _changelog_slips(text, known) == ["--sections, adaptive_ds.hub: - New `--sections` flag,\n  and "
                                             "`adaptive_ds.hub` to push."]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", LINKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path):
    broken = []
    for link in _links(path):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(link)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(link)
    assert broken == []


def test_the_link_check_finds_a_broken_link_and_a_wrong_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `b.c` title\n\n## Which architecture for which budget\n\n[ok](#a-bc-title) "
                    "[ok](page.md#which-architecture-for-which-budget) [bad](#nowhere) [gone](missing.md)\n")
    links = _links(page)
    assert links == ["#a-bc-title", "page.md#which-architecture-for-which-budget", "#nowhere", "missing.md"]
    assert _anchors(page) == {"a-bc-title", "which-architecture-for-which-budget"}


# A key as the sections name them: KIND:part[:part...], lower case (templates such as grid:PRESET:DATA, or
# grid:<preset>:<data>, are descriptions of a command's sections, not citations).
KEY = re.compile(r"(?<![\w<:/-])((?:grid|throughput|generate|plan|data|loss-breakdown|acceptance|text-budget)"
                 r":[a-z0-9_-]+(?::[a-z0-9_-]+)*)(?![\w:<>])")


def _doc_citations() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in [*PAGES, ROOT / "CHANGELOG.md", *sorted((ROOT / "examples").rglob("*"))]:
        if path.is_file() and path.suffix in (".md", ".py", ".sh"):
            text = path.read_text()
            keys = set(KEY.findall(text)) | ({"quickstart"} & set(re.findall(r"`(quickstart)`", text)))
            found[path.relative_to(ROOT).as_posix()] = keys
    return found


def _comments_and_docstrings(path: Path) -> str:
    source = path.read_text()
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            parts.append(ast.get_docstring(node) or "")
    return "\n".join(parts)


def _code_citations() -> dict[str, set[str]]:
    """Keys the package's comments and docstrings cite: a key in a sentence that names BENCHMARKS.md or a
    section (a marker written as ``<!-- key -->`` describes what a command writes, not a citation)."""
    found = {}
    for path in sorted([*(ROOT / "adaptive_ds").rglob("*.py"), *(ROOT / "launchers").rglob("*.py")]):
        text = re.sub(r"<!--.*?-->", "", _comments_and_docstrings(path))
        keys = {key for sentence in re.split(r"(?<=\.)\s", text) if re.search(r"BENCHMARKS|\bsections?\b", sentence)
                for key in KEY.findall(sentence)}
        if keys:
            found[path.relative_to(ROOT).as_posix()] = keys
    return found


def test_every_cited_benchmarks_key_exists():
    cited = {**_doc_citations(), **_code_citations()}
    missing = {where: sorted(keys - SECTIONS) for where, keys in cited.items() if keys - SECTIONS}
    assert missing == {}, "cite a section BENCHMARKS.md holds, by its <!-- key -->"
    assert len(set().union(*cited.values())) >= 8  # the scan sees the citations
    assert "adaptive_ds/presets.py" in cited


def test_the_key_pattern():
    text = ("sections `grid:debug:embedded-hard` and grid:debug:embedded-hard:2m-vs-iso-dense, `plan:projections`; "
            "templates grid:PRESET:DATA, `grid:<preset>:<data>`, `loss-breakdown:SEQ_LEN:TIER`; data embedded:hard")
    assert KEY.findall(text) == ["grid:debug:embedded-hard", "grid:debug:embedded-hard:2m-vs-iso-dense",
                                 "plan:projections"]


def test_the_readme_is_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    budget = readme.split("## Which architecture for which budget")[1].split("\n## ")[0]
    rows = [line for line in budget.splitlines() if line.startswith("| ") and not line.startswith("| budget")]
    assert 1 <= len(rows) <= 6 and all(KEY.search(row) for row in rows), "each budget row cites its section"
    assert "docs/index.md" in readme


def test_the_presets_table_of_the_hardware_page_is_presets_py():
    page = (ROOT / "docs" / "hardware.md").read_text()
    rows = re.findall(r"^\| (debug|debug_200m|b1|b7) \| ([\d |]+)\|$", page, flags=re.M)
    assert {name: tuple(int(v) for v in values.split("|")) for name, values in rows} == {
        name: (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
               p.intermediate_size, p.seq_len, p.num_local_experts, p.num_experts_per_tok)
        for name, p in PRESETS.items()}


def _conclusion_rows() -> list[str]:
    conclusions = BENCHMARKS.split("\n## Conclusions\n")[1].split("\n## ")[0]
    return [line for line in conclusions.splitlines() if line.startswith("| ") and not line.startswith("| ---")
            and "](#" in line]


def test_each_conclusion_row_links_the_section_that_holds_its_figures():
    """A row of BENCHMARKS.md's conclusions states only figures of the section it links, as that section writes
    them (so a regenerated section cannot leave its conclusion behind)."""
    sections = dict(re.findall(r"^<!-- ([\w:.+-]+) -->\n(.*?)\n<!-- /\1 -->$", BENCHMARKS, flags=re.S | re.M))
    by_anchor = {_slug(key): key for key in sections}
    rows = _conclusion_rows()
    assert len(rows) >= 15
    for row in rows:
        keys = [by_anchor[anchor] for anchor in re.findall(r"\]\(#([\w-]+)\)", row)]
        assert keys, f"the row links no section: {row}"
        shown = re.sub(r"`[^`]*`|\[[^\]]*\]\([^)]*\)", "", row)
        figures = re.findall(r"[+-]?\d[\d,]*\.\d+", shown)
        assert figures, row
        for figure in figures:
            assert any(figure in sections[key] for key in keys), f"{figure} is not in {keys}: {row}"


def test_the_readmes_expected_output_is_what_make_train_prints():
    """The last lines README.md shows for `make train` are the run's own formats, and its token count the default
    run's (600 steps of the debug config's rows at the debug preset's sequence length)."""
    from adaptive_ds import ds_config
    from adaptive_ds.training import final
    from adaptive_ds.training.loop import _describe

    readme = (ROOT / "README.md").read_text()
    block = next(body for lang, _, body, _ in _blocks(ROOT / "README.md") if lang == "text" and "summary:" in body)
    saved, summary, launcher = block.strip().splitlines()
    assert "saved the final model and tokenizer to %s" in Path(final.__file__).read_text()
    assert saved.endswith("INFO adaptive_ds.training.final: saved the final model and tokenizer to "
                          "runs/debug-dense-.../final")
    settings, config = parse(["--ds_config", DEBUG_CPU], 1)
    tokens = settings.max_steps * ds_config.read(config).rows_per_rank_step * PRESETS[settings.preset].seq_len
    described = _describe({"validation_loss": 2.5, "final_perplexity": 12.18, "tokens_seen": tokens, "wall_time_s": 300,
                           "entropy_floor": 1.4, "unigram_entropy": 4.1, "captured": 0.5})
    expected = summary.split("summary: ", 1)[1]
    assert re.fullmatch(re.escape(expected).replace(re.escape("..."), r"[\d.]+"), described), (expected, described)
    assert "Process ... exits successfully." in launcher and "make train" in readme
