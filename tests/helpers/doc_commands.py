"""The commands the docs show, checked without running them (tests/unit/test_docs.py): each is read by the parser
that would read it (a launcher's, the training run's, a tool's), then checked by what that program checks before it
does any work: the training run's settings and ds_config checks (`arguments.parse`), a tool's own `check(args)` (the
ds_config reader, the grid's variant parser, the folders it reads, ...).

The commands of a page are checked in order, in an empty directory that stands for the repository's root
(`REPOSITORY` linked in, `.git` a stand-in folder). Paths stand in for what exists when a user gets to a command:
- what an earlier command of the page writes (`_made`: a training run's OUTPUT_DIR/final and checkpoints/ with its
  two scripts, an export's folder, a prepare's --out, the grid's run folders, ...), made as empty folders or files;
- what the reader brings, named for each page in `PRIOR` (README's `runs/my-run`: "a run of your own"), made the
  same way before the page's first command.
Any other path a command reads does not exist, so `generate runs/nowhere/final` is refused as it would be. A stand-in
is checked for existence only: what is in a run's folder is the run's to check when it loads it, and the `bash run`
blocks run for real (tests/integration/test_docs_commands.py). Two things are not looked up: a Hub model id
(`--init_from TinyLlama/TinyLlama_v1.1`: its form is checked, `pretrained.check_name`) and what is in --data (it must
exist: `data.source_problems` is asked only of a path that does not). A path outside the directory (`/shared/...`) is
never made.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from helpers.common import ROOT

from adaptive_ds import data, pretrained
from adaptive_ds.cli import COMMANDS
from adaptive_ds.training import arguments
from adaptive_ds.training.arguments import parse

# The shell's own words a page may use beside the commands it shows (`mkdir` makes its folders here).
SHELL = {"mkdir", "export", "cd"}
# What the checks read from the repository's root, as a user's commands do.
REPOSITORY = ("launchers", "ds_configs", "BENCHMARKS.md", "benchmarks", "Makefile")
# Tools whose arguments argparse alone checks (no file, config or name to look up).
PARSER_ONLY = {"adaptive_ds.presets"}

_RUN = "a training run's OUTPUT_DIR"
# What a page's commands read that the reader's own runs or downloads make, page by page.
PRIOR: dict[str, dict[str, str]] = {
    "README.md": {"runs/my-run": f"{_RUN} of your own"},
    "docs/benchmarking.md": {
        "runs/grid/dense-run/final": "a dense run of the page's first grid (the grid names it "
                                     "debug-embedded-dense-seed1-<digest>)",
        "runs/grid/moe-run/final": "an MoE run of the same grid",
        "data/text_prepared": "the docstring text, prepared as docs/data.md says"},
    "docs/checkpoints.md": {"runs/my-run": f"{_RUN} of your own", "runs/dense-run": f"{_RUN} of a dense run",
                            "runs/moe-run": f"{_RUN} of an MoE run",
                            "runs/qwen-run": f"{_RUN} of a run --init_from a Qwen2 folder"},
    "docs/data.md": {"data/c4/en/c4-train.00000-of-01024.json.gz": "a C4 file, downloaded as the page says"},
    "BENCHMARKS.md": {
        "data/text_prepared": "the docstring text, prepared as docs/data.md says",
        "data/text_pinned": "the 32 MB docstring text, prepared as the text-budget section says",
        "b1_t4_stage.json": "a copy of ds_configs/b1_t4.json, as the GPU acceptance's b1_t4 stage writes it with fewer "
                            "steps and the embedded corpus (its report holds it)",
        **{f"runs/base/debug-{data}-dense-seed{seed}-0/final": "a base run of docs/benchmarking.md's base grid"
           for data in ("embedded-hard", "text-prepared", "text-pinned") for seed in (11, 12, 13)},
        **{f"runs/qwen-base/debug-embedded-hard-dense-tie-word-embeddings-true-attention-seed{seed}-0/final":
           "a base run of the Qwen-like base grid (docs/benchmarking.md)" for seed in range(11, 16)}},
}


_PARSE_ARGS = argparse.ArgumentParser.parse_args


class _Parsed(Exception):
    """Raised instead of running a command, once its parser has accepted the arguments."""


@contextlib.contextmanager
def checking(directory: Path, page: str | None = None):
    """Inside: every argparse parser stops after parsing, in `directory` made the repository's stand-in with the
    page's PRIOR paths; --data and --init_from are looked up as the module docstring says."""
    problems = data.source_problems

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(_PARSE_ARGS(self, args, namespace))

    def existing_data(source: str) -> list[str]:
        return [] if os.path.exists(source) or glob.glob(source) else problems(source)

    def init_from_named(settings, preset_named):
        try:
            pretrained.check_name(settings.init_from)
        except ValueError as error:
            return None, [str(error)]
        return None, []

    for name in REPOSITORY:
        (directory / name).symlink_to(ROOT / name)
    (directory / ".git").mkdir()  # the checkout a quick start clones
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        patch.setattr(data, "source_problems", existing_data)
        patch.setattr(arguments, "init_from_check", init_from_named)
        patch.chdir(directory)
        patch.setattr(sys, "argv", ["check"])
        for path, what in PRIOR.get(page, {}).items():  # a run's folder as the run leaves it
            copied = re.match(r"a copy of (\S+),", what)
            if copied:  # a file the tool reads: a valid one, not an empty stand-in
                shutil.copyfile(ROOT / copied.group(1), path)
                continue
            for made in _run_writes(path) if what.startswith(_RUN) else [path]:
                stand_in(made)
        yield


def stand_in(path: str) -> None:
    """An empty file for a path with a file's ending, else an empty folder; nothing outside the directory."""
    if os.path.isabs(path) or path.startswith(".."):
        return
    if re.search(r"\.(py|gz|json|jsonl|parquet|txt)$", path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        Path(path).touch()
    else:
        os.makedirs(path, exist_ok=True)


def _run_writes(output_dir: str | None) -> list[str]:
    if output_dir is None:  # runs/<preset>-<arch>-<time>: a new folder each start
        return []
    checkpoints = os.path.join(output_dir, "checkpoints")
    return [os.path.join(output_dir, "final"), os.path.join(checkpoints, "zero_to_fp32.py"),
            os.path.join(checkpoints, "zero_to_torch.py")]


def _grid_writes(args, specs) -> list[str]:
    """The run folders a grid names (its own names: a later --init_from glob must find them), for grids from
    scratch; a continuation's names hash its base weights, which a stand-in does not hold."""
    return [args.runs] + [os.path.join(spec.run_dir(args.runs, variant, seed), "final") for spec in specs
                          if spec.init_from is None for variant in spec.variants for seed in spec.seeds]


# What a tool writes that a later command may read, from its checked arguments (and what its check returned).
WRITES = {
    "adaptive_ds.export.convert": lambda args, _: [args.dst],
    "adaptive_ds.data.prepare": lambda args, _: [args.out],
    "adaptive_ds.data.docstrings": lambda args, _: [args.out],
    "adaptive_ds.tools.data_benchmark": lambda args, _: [os.path.join(args.work, "c4"),
                                                         os.path.join(args.work, "prepared", "tokenizer")],
    "adaptive_ds.tools.grid": _grid_writes,
    "adaptive_ds.training.checkpoint.consolidate": lambda args, _: [args.output_dir],
}


def _train(argv: list[str], world_size: int) -> list[str]:
    """A training command's arguments through the run's own parse and validation (ds_config included); what the run
    writes."""
    with pytest.raises(_Parsed) as parsed:  # the run's own parser accepts the flags
        parse(argv, world_size)
    namespace = parsed.value.args[0]
    with pytest.MonkeyPatch.context() as patch:  # then the run's checks, on what it parsed
        patch.setattr(arguments, "build_parser", lambda: _Replay(namespace))
        settings, _ = parse(argv, world_size)
    return _run_writes(settings.output_dir)


class _Replay:
    """A parser that returns what the real one parsed (so that `parse` validates it without parsing again)."""

    def __init__(self, namespace):
        self.namespace = namespace

    def parse_args(self, argv):
        return self.namespace


def tool(module: str, argv: list[str], **kwargs) -> list[str]:
    """A tool's command: its parser, then its own `check`; what it writes."""
    tool_module = importlib.import_module(module)
    with pytest.raises(_Parsed) as parsed:
        tool_module.main(argv, **kwargs)
    args = parsed.value.args[0]
    if module in PARSER_ONLY:
        return []
    assert hasattr(tool_module, "check"), f"{module} has no check(args): what it checks before it works"
    with pytest.MonkeyPatch.context() as patch:  # a check may parse a command of its own: a grid's training runs
        patch.setattr(argparse.ArgumentParser, "parse_args", _PARSE_ARGS)
        checked = tool_module.check(args)
    return WRITES.get(module, lambda *_: [])(args, checked)


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
    known, _ = options.parse_known_args(words[1:at])  # parse_args itself stops at the parse in `checking`
    return words[at + 1:], known.nodes * known.gpus_per_node


def _make(rest: list[str]) -> list[str]:
    targets = [w for w in rest if "=" not in w and not w.startswith("-")]
    defined = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert targets and set(targets) <= defined, f"make {targets}: the Makefile defines {sorted(defined)}"
    passed = [w.removeprefix("ARGS=") for w in rest if w.startswith("ARGS=")]
    if not passed:
        return []  # what the target runs: `make -n`, tests/integration/test_docs_commands.py
    # flags for `make train`'s training command, after the ds_config its recipe names
    assert targets == ["train"], targets
    recipe = re.search(r"launchers/train\.py (.*) \$\(ARGS\)", (ROOT / "Makefile").read_text()).group(1)
    return _train([*shlex.split(recipe), *shlex.split(passed[0])], 1)


def _python_module(module: str, argv: list[str]) -> list[str]:
    if module == "pytest":
        for word in argv:
            if not word.startswith("-") and "/" in word:
                assert (ROOT / word.split("::")[0]).exists(), word
        marks = " ".join(argv[argv.index("-m") + 1:argv.index("-m") + 2]) if "-m" in argv else ""
        for mark in set(re.findall(r"\w+", marks)) - {"not", "and", "or"}:
            assert mark in ("slow", "gpu"), mark
        return []
    if module == "adaptive_ds.training":
        return _train(argv, 1)
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    if spec.submodule_search_locations:
        module = f"{module}.__main__"
    source = Path(importlib.util.find_spec(module).origin).read_text()
    if "def main(" not in source:  # an alias module (or a package's __main__): it runs another module's main
        target = re.search(r"from ([\w.]+) import main", source).group(1)
        module = importlib.util.resolve_name(target, module.rpartition(".")[0])
    return tool(module, argv)


def _python_script(script: str, argv: list[str]) -> list[str]:
    if script == "launchers/train.py":
        return _train(argv, 1)
    assert os.path.isfile(script), f"no script {script} (nothing before the command made it)"
    if script.endswith("/checkpoints/zero_to_fp32.py"):
        return tool("adaptive_ds.training.checkpoint.consolidate", argv)
    if script.endswith("/checkpoints/zero_to_torch.py"):
        return tool("adaptive_ds.training.checkpoint.consolidate", argv, dtype_option=True)
    raise AssertionError(f"no check for the script {script}")


def check(words: list[str]) -> list[str]:
    """One command, through the parsers and checks that would read it; the paths it writes (made here as stand-ins
    for the commands after it)."""
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before a command
        words = words[1:]
    head, rest = Path(words[0]).name, words[1:]
    if head == "make":
        made = _make(rest)
    elif head in SHELL:
        made = [w for w in rest if not w.startswith("-")] if head == "mkdir" else []
    elif head == "hf":
        assert (Path(sys.executable).parent / "hf").exists(), "the Hugging Face CLI `hf` is not installed"
        assert rest[:2] == ["auth", "login"], rest
        made = []
    elif head in ("deepspeed", "torchrun", "accelerate"):
        script_argv, world = _launched(words)
        assert script_argv[0] == "launchers/train.py" and (ROOT / script_argv[0]).exists(), script_argv
        made = _train(script_argv[1:], world)
    elif head == "sbatch":
        made = _train(*_submitted(words))
    elif head == "adaptive-ds":
        made = _train(rest[1:], 1) if rest[0] == "train" else tool(COMMANDS[rest[0]].module, rest[1:])
    else:
        assert head.startswith("python"), f"no check for the command {words}"
        if rest[0] == "-c":
            compile(rest[1], "<command>", "exec")
            made = []
        elif rest[0] == "-m":
            made = _python_module(rest[1], rest[2:])
        else:
            made = _python_script(rest[0], rest[1:])
    for path in made:
        stand_in(path)
    return made


def top_directory(path: str) -> str:
    """The folder a path belongs to, as pages name theirs: runs/NAME, data/NAME, or its first part."""
    parts = Path(path).parts
    return "/".join(parts[:2]) if parts[0] in ("runs", "data") and len(parts) > 1 else parts[0]


def shared_directories(written: dict[str, list[str]], read: dict[str, list[str]]) -> list[str]:
    """`page: folder (also PAGE)` for each folder a page's commands write that another page's commands write or
    read: following both pages would mix two runs in one folder."""
    named = {page: {top_directory(p) for p in [*written.get(page, []), *read.get(page, [])]}
             for page in {*written, *read}}
    return sorted(f"{page}: {folder} (also {other})" for page, paths in written.items()
                  for folder in {top_directory(p) for p in paths if not os.path.isabs(p)}
                  for other in named if other != page and folder in named[other])
