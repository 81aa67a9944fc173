"""`adaptive-ds COMMAND`: every command's own --help through the one entry point, the command list in its help,
and an unknown command refused in one line naming the valid ones."""

import importlib
import sys

import pytest

from adaptive_ds import cli
from adaptive_ds.training import startup

# An argument only that command has: its help is the command's own parser, reached through the entry point.
OWN_ARGUMENT = {"train": "--ep_size", "plan": "--gpus", "grid": "--variants", "export": "--to",
                "generate": "--max_new_tokens", "bench": "--rounds", "acceptance": "--stages"}


def test_the_commands_are_the_documented_seven():
    assert list(cli.COMMANDS) == ["train", "plan", "grid", "export", "generate", "bench", "acceptance"]
    assert set(OWN_ARGUMENT) == set(cli.COMMANDS)


@pytest.mark.parametrize("name", list(OWN_ARGUMENT))
def test_each_command_answers_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([name, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: adaptive-ds {name} ") and OWN_ARGUMENT[name] in out
    # the module behind the command is the one whose main the entry point runs
    assert callable(importlib.import_module(cli.COMMANDS[name].module).main)


def test_the_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: adaptive-ds ")
    listed = [line.split()[0] for line in out.split("commands:\n", 1)[1].splitlines() if line.startswith("  ")]
    assert listed == list(cli.COMMANDS)


def test_an_unknown_command_is_refused_in_one_line_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["trian", "--ds_config", "debug_cpu.json"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        "adaptive-ds: unknown command 'trian'; choose one of train, plan, grid, export, generate, bench, acceptance"]


def test_a_command_gets_the_arguments_after_its_name_and_runs_as_adaptive_ds_command(monkeypatch):
    """While it runs, sys.argv is the command's (what a training run records as the command that made it), and it
    is given back afterwards."""
    seen = []
    module = importlib.import_module(cli.COMMANDS["train"].module)
    monkeypatch.setattr(module, "main", lambda argv: seen.append((argv, list(sys.argv), startup.command())))
    before = list(sys.argv)
    cli.main(["train", "--ds_config", "debug_cpu.json", "--max_steps", "3"])
    arguments = ["--ds_config", "debug_cpu.json", "--max_steps", "3"]
    assert seen == [(arguments, ["adaptive-ds train", *arguments],
                     "adaptive-ds train --ds_config debug_cpu.json --max_steps 3")]
    assert sys.argv == before
