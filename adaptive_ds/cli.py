"""`adaptive-ds COMMAND [ARGUMENTS]`: the package's commands behind one entry point, each its module's `main(argv)`.

    adaptive-ds train --ds_config debug_cpu.json --max_steps 200    # one process
    adaptive-ds plan --preset b1 --arch moe --gpu t4 --ds_config b1_t4.json
    adaptive-ds grid --preset debug --tokens 1000000 --seeds 1 2 3
    adaptive-ds export runs/my-run runs/my-run-hf
    adaptive-ds generate runs/my-run/final "[arith] 7 * 8 =" --max_new_tokens 8
    adaptive-ds bench --preset debug --steps 20 --rounds 3
    adaptive-ds acceptance --dry_run

`adaptive-ds COMMAND --help` lists a command's arguments. Training on several processes goes through a launcher, as
before: `deepspeed launchers/train.py --ds_config ...` (or torchrun, accelerate launch).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # whose main(argv) runs the command
    about: str


COMMANDS = {
    "train": Command("adaptive_ds.training.__main__", "one training run in this process (several processes: "
                                                      "deepspeed launchers/train.py, torchrun or accelerate launch)"),
    "plan": Command("adaptive_ds.tools.plan", "memory, throughput and cost of a preset on a GPU, and what fits"),
    "grid": Command("adaptive_ds.tools.grid", "variants x seeds trained side by side, their tables and plots"),
    "export": Command("adaptive_ds.export.convert", "a checkpoint as a Hugging Face folder, or a stock class"),
    "generate": Command("adaptive_ds.generate", "sample text from a trained model"),
    "bench": Command("adaptive_ds.tools.benchmark", "side-by-side throughput, peak memory or generation speed"),
    "acceptance": Command("adaptive_ds.tools.acceptance", "the GPU acceptance run (a dry run without CUDA)"),
}


def _parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {command.about}" for name, command in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="adaptive-ds", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Train, plan, compare, export and sample adaptive_ds models.",
        epilog=f"commands:\n{listing}\n\n`adaptive-ds COMMAND --help` lists a command's arguments.")
    p.add_argument("command", metavar="COMMAND", help=f"one of {', '.join(COMMANDS)}")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="the command's own arguments")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command not in COMMANDS:
        print(f"adaptive-ds: unknown command {args.command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        raise SystemExit(2)
    command = importlib.import_module(COMMANDS[args.command].module).main
    # While it runs, the command's argv is its own: its parser names the program after sys.argv[0] (usage:
    # adaptive-ds plan ...), and a training run records sys.argv as the command that made it.
    saved, sys.argv = sys.argv, [f"adaptive-ds {args.command}", *args.arguments]
    try:
        command(args.arguments)
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
