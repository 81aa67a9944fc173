"""The quick start's two commands timed as a newcomer runs them: `make train` and then `make test`, each from a fresh
clone of this checkout's commit (its own virtualenv installed by the command itself, nothing reused).

    python -m adaptive_ds.tools.quickstart [--out benchmarks --benchmarks_md BENCHMARKS.md]

The report records each command's wall time, exit status and last lines of output, with the commit and the machine
(CPU model, cores, memory); the section `quickstart` of BENCHMARKS.md is rendered from it. A command that fails is
reported as failed, with its status, and the tool exits non-zero after writing the report. The times depend on the
machine and on what else runs on it (the report records the load average as each command starts): measure on an idle
machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil

from ..markdown_sections import replace_section
from .report import add_publish_arguments, check_markdown_path, machine, write_report

KEY = "quickstart"
COMMANDS = ("make train", "make test")
TAIL_LINES = 3
# What the commands must not inherit from whoever runs this tool: a make above it (its flags and level: a nested make
# prints its directories), the virtualenv, JIT build cache and disk cache of this checkout, a launcher's variables.
NOT_INHERITED = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR",
                 "ADAPTIVE_DS_CACHE", "PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT")


def cpu_model() -> str:
    """The CPU's model name as Linux reports it; "unknown" elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def last_lines(output: str, count: int = TAIL_LINES) -> list[str]:
    """The last `count` non-empty lines a command printed, each as a terminal leaves it (a progress bar's last
    state: the text after its last carriage return)."""
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in output.split("\n")]
    return [line for line in lines if line.strip()][-count:]


def run_command(command: str, cwd: str, timeout_s: float) -> dict:
    """Run `command` in `cwd` in a process group of its own; its wall time, exit status and last lines."""
    started = time.perf_counter()
    env = {name: value for name, value in os.environ.items() if name not in NOT_INHERITED}
    proc = subprocess.Popen(command.split(), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        status = proc.returncode
    except BaseException as error:  # out of time, or the tool itself stopped (Ctrl-C does not reach the group)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        status = None
    return {"command": command, "wall_s": round(time.perf_counter() - started, 1), "exit_status": status,
            "last_lines": last_lines(output)}


def measure(repository: str, work: str, timeout_s: float) -> dict:
    """Clone `repository`'s HEAD into `work`/clone and run the quick start's commands there, one after the other:
    the commit measured is the clone's (changes not committed are not part of it)."""
    clone = os.path.join(work, "clone")
    subprocess.run(["git", "clone", "--quiet", repository, clone], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True,
                          check=True).stdout.strip()
    results = []
    for command in COMMANDS:
        load = os.getloadavg()[0]  # what else the machine was running: 0 on an idle one
        results.append({**run_command(command, clone, timeout_s), "load_average_at_start": round(load, 2)})
        if results[-1]["exit_status"] != 0:
            break  # the test command sets up the same virtualenv: after a failed setup its time means nothing
    return {"commit": head, "results": results}


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a report: provenance and one row per command."""
    lines = [f"Measured {report['date']} on {report['machine']} ({report['cpu']}, {report['memory_gib']} GiB), "
             f"commit {report['commit']}: `{report['command']}`. Each command from a fresh clone, one after the "
             "other, as the README's quick start runs them: `make train` creates the virtualenv and installs torch "
             "and the package before training; `make test` then finds them installed. The load average (1 minute) "
             "shows what else ran on the machine: near 0 on an idle machine; the times grow with it.", "",
             "| command | wall time | exit status | load average at its start | last lines of output |",
             "|---|---|---|---|---|"]
    for result in report["results"]:
        status = "timed out" if result["exit_status"] is None else str(result["exit_status"])
        tail = "<br>".join(f"`{line.replace('|', '/').replace('`', '')}`" for line in result["last_lines"])
        lines.append(f"| `{result['command']}` | {result['wall_s'] / 60:.1f} minutes | {status} | "
                     f"{result['load_average_at_start']:.2f} | {tail} |")
    return "\n".join(lines)


def check(args: argparse.Namespace) -> None:
    """What main checks before it clones: ValueError in one line for a bad value; SystemExit with its line for a
    --repository that is no git checkout."""
    if args.timeout_minutes <= 0:
        raise ValueError(f"--timeout_minutes must be positive, got {args.timeout_minutes}")
    check_markdown_path(args.benchmarks_md)
    if not os.path.isdir(os.path.join(args.repository, ".git")):
        raise SystemExit(f"error: --repository {args.repository!r} is not a git checkout (the quick start runs "
                         "from a clone of one)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m adaptive_ds.tools.quickstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", default=".", help="the git checkout whose HEAD is cloned (default: this one)")
    p.add_argument("--work", default="runs/quickstart", help="folder for the clone (emptied first)")
    p.add_argument("--timeout_minutes", type=float, default=90.0, help="each command's limit")
    add_publish_arguments(p, "quickstart.json")
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as error:
        p.error(str(error))
    if os.path.exists(os.path.join(args.work, "clone")):
        shutil.rmtree(os.path.join(args.work, "clone"))
    os.makedirs(args.work, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "cpu": cpu_model(),
              "memory_gib": round(psutil.virtual_memory().total / 2**30),
              "command": " ".join(["python -m adaptive_ds.tools.quickstart",
                                   *(argv if argv is not None else sys.argv[1:])]),
              **measure(os.path.abspath(args.repository), args.work, args.timeout_minutes * 60)}
    text = markdown(report)
    print(text)
    print(f"report: {write_report(args.out if args.out is not None else args.work, KEY, report)}")
    if args.benchmarks_md:
        replace_section(args.benchmarks_md, KEY, text, "The quick start's two commands (measured)")
    if any(result["exit_status"] != 0 for result in report["results"]):
        raise SystemExit("error: a quick-start command failed: " + "; ".join(
            f"{r['command']} exit status {r['exit_status']}" for r in report["results"]))


if __name__ == "__main__":
    main()
