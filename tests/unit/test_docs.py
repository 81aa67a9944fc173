"""The docs cannot rot: every command README.md and docs/ show is run by a test (fenced blocks tagged `bash run`,
tests/integration/test_docs_commands.py) or checked here through the real argument parsers (`bash check`: each
launcher's own parser, then the training run's settings and ds_config checks; each tool's parser; `json check`: the
ds_config reader; `python check`: it compiles and its imports exist); the commands BENCHMARKS.md's sections record
parse the same way; every relative link resolves, to the heading its anchor names; every BENCHMARKS.md section a page
or a code comment cites by key exists; and the README stays a landing page."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import io
import json
import re
import shlex
import sys
import tokenize
from pathlib import Path

import pytest
import yaml
from helpers.common import DEBUG_CPU, ROOT

from adaptive_ds import data
from adaptive_ds.cli import COMMANDS
from adaptive_ds.presets import PRESETS
from adaptive_ds.training import arguments
from adaptive_ds.training.arguments import ConfigError, parse

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "CHANGELOG.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "examples").glob("*.md"))]
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()
SECTIONS = set(re.findall(r"^<!-- ([\w:.+-]+) -->$", BENCHMARKS, flags=re.M)) - {"settings"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", flags=re.S | re.M)
LANGUAGES = {"bash": ("run", "check"), "json": ("check",), "python": ("check",), "text": ()}
# The shell's own words a page may use beside the commands it shows.
SHELL = {"mkdir", "export", "cd"}


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


class _Parsed(Exception):
    """Raised instead of running a command, once its parser has accepted the arguments."""


@pytest.fixture
def parse_only(monkeypatch, tmp_path):
    """Every argparse parser stops after parsing (a tool's main then runs nothing), in an empty directory (so that a
    command which did run could not touch the checkout); data named by a command is not required to exist."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(data, "source_problems", lambda source: [])  # imported by arguments.validate when it runs
    monkeypatch.setattr(arguments, "init_from_check", lambda settings, preset_named: (None, []))  # nor --init_from's
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["check"])


def _train(argv: list[str], world_size: int) -> None:
    """A training command's arguments through the run's own parse and validation (ds_config included)."""
    with pytest.raises(_Parsed) as parsed:  # the run's own parser accepts the flags
        parse(argv, world_size)
    namespace = parsed.value.args[0]
    with pytest.MonkeyPatch.context() as patch:  # then the run's checks, on what it parsed
        patch.setattr(arguments, "build_parser", lambda: _Replay(namespace))
        parse(argv, world_size)


class _Replay:
    """A parser that returns what the real one parsed (so that `parse` validates it without parsing again)."""

    def __init__(self, namespace):
        self.namespace = namespace

    def parse_args(self, argv):
        return self.namespace


def _tool(module: str, argv: list[str], **kwargs) -> None:
    with pytest.raises(_Parsed):
        importlib.import_module(module).main(argv, **kwargs)


def _launched(launcher: list[str]) -> tuple[list[str], int]:
    """The training arguments and world size of a launcher command, its own options read by its own parser."""
    name = Path(launcher[0]).name
    if name == "torchrun":
        from torch.distributed.run import get_args_parser

        with pytest.raises(_Parsed) as parsed:
            get_args_parser().parse_args(launcher[1:])
        args = parsed.value.args[0]
        nodes = int(str(args.nnodes).split(":")[-1])
        return [args.training_script, *args.training_script_args], nodes * int(args.nproc_per_node)
    if name == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        with pytest.raises(_Parsed) as parsed:
            parse_args(launcher[1:])
        args = parsed.value.args[0]
        # the hostfile the docs describe: two nodes of 4 slots
        world = 8 if "--hostfile" in launcher else max(args.num_gpus, 1)
        return [args.user_script, *args.user_args], world
    if name == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        assert launcher[1] == "launch", launcher
        with pytest.raises(_Parsed) as parsed:
            launch_command_parser().parse_args(launcher[2:])
        args = parsed.value.args[0]
        script_args = list(args.training_script_args)
        world = args.num_processes
        if args.config_file:
            config = yaml.safe_load((ROOT / args.config_file).read_text())
            world = world or config["num_processes"]
            if "--ds_config" not in script_args:  # train.py takes it from the plugin's config file
                script_args = ["--ds_config", config["deepspeed_config"]["deepspeed_config_file"], *script_args]
        return [args.training_script, *script_args], world or 1
    raise AssertionError(f"not a launcher: {launcher}")


def _submitted(words: list[str]) -> tuple[list[str], int]:
    """The training arguments and world size (nodes x GPUs per node) of `sbatch OPTIONS SCRIPT ARGS`."""
    at = next(i for i, word in enumerate(words) if word.endswith(".sbatch"))
    assert words[at] == "launchers/slurm/train.sbatch", words[at]
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--nodes", "-N", type=int, default=1)
    options.add_argument("--gpus-per-node", type=int, default=1)
    known, _ = options.parse_known_args(words[1:at])  # parse_args itself stops at the parse in parse_only
    return words[at + 1:], known.nodes * known.gpus_per_node


def _check(words: list[str]) -> None:
    """One command of a `bash check` block, through the parsers that would read it."""
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before a command
        words = words[1:]
    head, rest = Path(words[0]).name, words[1:]
    if head == "make":
        targets = [w for w in rest if "=" not in w and not w.startswith("-")]
        defined = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert targets and set(targets) <= defined, f"make {targets}: the Makefile defines {sorted(defined)}"
        passed = [w.removeprefix("ARGS=") for w in rest if w.startswith("ARGS=")]
        if passed:  # flags for `make train`'s training command, after the ds_config its recipe names
            assert targets == ["train"], targets
            recipe = re.search(r"launchers/train\.py (.*) \$\(ARGS\)", (ROOT / "Makefile").read_text()).group(1)
            _train([*shlex.split(recipe), *shlex.split(passed[0])], 1)
        return  # what the target runs: `make -n`, tests/integration/test_docs_commands.py
    if head in SHELL:
        return
    if head == "hf":
        assert (Path(sys.executable).parent / "hf").exists(), "the Hugging Face CLI `hf` is not installed"
        assert rest[:2] == ["auth", "login"], rest
        return
    if head in ("deepspeed", "torchrun", "accelerate"):
        script_argv, world = _launched(words)
        assert script_argv[0] == "launchers/train.py" and (ROOT / script_argv[0]).exists(), script_argv
        _train(script_argv[1:], world)
        return
    if head == "sbatch":
        _train(*_submitted(words))
        return
    if head == "adaptive-ds":
        if rest[0] == "train":
            _train(rest[1:], 1)
        else:
            _tool(COMMANDS[rest[0]].module, rest[1:])
        return
    assert head.startswith("python"), f"no check for the command {words}"
    if rest[0] == "-c":
        compile(rest[1], "<command>", "exec")
        return
    if rest[0] == "-m":
        module, argv = rest[1], rest[2:]
        if module == "pytest":
            for word in argv:
                if not word.startswith("-") and "/" in word:
                    assert (ROOT / word.split("::")[0]).exists(), word
            marks = " ".join(argv[argv.index("-m") + 1:argv.index("-m") + 2]) if "-m" in argv else ""
            for mark in set(re.findall(r"\w+", marks)) - {"not", "and", "or"}:
                assert mark in ("slow", "gpu"), mark
            return
        if module == "adaptive_ds.training":
            _train(argv, 1)
            return
        spec = importlib.util.find_spec(module)
        assert spec is not None, module
        if spec.submodule_search_locations:
            module = f"{module}.__main__"
        source = Path(importlib.util.find_spec(module).origin).read_text()
        if "def main(" not in source:  # an alias module (or a package's __main__): it runs another module's main
            target = re.search(r"from ([\w.]+) import main", source).group(1)
            module = importlib.util.resolve_name(target, module.rpartition(".")[0])
        _tool(module, argv)
        return
    script = rest[0]
    if script == "launchers/train.py":
        _train(rest[1:], 1)
    elif script.endswith("/checkpoints/zero_to_fp32.py"):
        _tool("adaptive_ds.training.checkpoint.consolidate", rest[1:])
    elif script.endswith("/checkpoints/zero_to_torch.py"):
        _tool("adaptive_ds.training.checkpoint.consolidate", rest[1:], dtype_option=True)
    else:
        raise AssertionError(f"no check for the script {script}")


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


@pytest.mark.parametrize("body", _tagged("check"))
def test_each_checked_command_parses(body, parse_only):
    for words in _commands(body):
        _check(words)


@pytest.mark.parametrize("body", _tagged("run"))
def test_each_runnable_command_parses_too(body, parse_only):
    """What the integration test runs is first checked here, cheaply."""
    for words in _commands(body):
        _check(words)


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
def test_the_commands_benchmarks_sections_record_parse(command, parse_only):
    _check(shlex.split(command))


def test_the_recorded_commands_are_found():
    commands = _benchmarks_commands()
    assert len(commands) >= 15 and any("adaptive_ds.grid" in c for c in commands)
    assert any("adaptive_ds.benchmark --memory" in c for c in commands)


def test_a_wrong_flag_or_a_moved_file_fails_the_check(parse_only):
    """What the checks exist for: a renamed flag, an unknown choice and a moved script each fail."""
    for broken in (["python", "-m", "adaptive_ds.plan", "--preset", "b1", "--gpus_total", "8"],
                   ["python", "launchers/train.py", "--ds_config", "ds_configs/debug_cpu.json", "--arch", "sparse"],
                   ["deepspeed", "launchers/train.py", "--ds_config", "ds_configs/debug_cpu.json", "--steps_max", "5"],
                   ["python", "launchers/train_old.py", "--ds_config", "ds_configs/debug_cpu.json"],
                   ["torchrun", "--nproc_per_node", "3", "launchers/train.py", "--ds_config",
                    "ds_configs/b7_8gpu.json"],
                   ["sbatch", "--nodes", "3", "--gpus-per-node", "4", "launchers/slurm/train.sbatch", "--ds_config",
                    "ds_configs/b7_8gpu.json"]):
        with pytest.raises((SystemExit, ConfigError, AssertionError)):
            _check(broken)


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


def test_every_flag_a_page_names_exists(monkeypatch):
    """A flag named in prose or in a table (not only in a checked block) is one some parser defines, so that a
    renamed flag cannot live on in a sentence."""
    known = _source_flags() | _launcher_flags(monkeypatch) | OTHER_FLAGS
    unknown = {p.relative_to(ROOT).as_posix(): sorted(_named_flags(p.read_text()) - known) for p in PAGES}
    assert {page: flags for page, flags in unknown.items() if flags} == {}
    assert {"--init_from", "--stages", "--report_only", "--nnodes", "--num_gpus"} <= known
    assert _named_flags("pass `--stages_all` or --max_steps, not a-b--c") - known == {"--stages_all"}


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
