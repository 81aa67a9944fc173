"""Generated sections of BENCHMARKS.md, the JSON reports behind them, and the provenance every figure carries
(machine, commit).

A measuring command writes its JSON report under the runs directory unless `--out` says otherwise, and a section of
a Markdown file only when `--benchmarks_md` names one: nothing a user runs writes into the repository's committed
results (`benchmarks/`, BENCHMARKS.md) unless asked. A section ``<!-- KEY -->`` is backed by the report
`<out>/<section_stem(KEY)>.json`, from which it is rendered, so the committed JSON holds every figure it shows.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess

import torch


def commit() -> str:
    """The checkout's short commit hash, with "+changes" when the tree differs from it; outside git (a copy of the
    tree without its .git, as in a container image) the value of ADAPTIVE_DS_COMMIT, which whoever copied the tree
    sets to its commit, else "unknown"."""
    given = os.environ.get("ADAPTIVE_DS_COMMIT", "").strip()
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return given or "unknown"
    return f"{head}+changes" if dirty else head


def machine() -> str:
    """The device figures were measured on, in words."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} GPU)"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, no GPU"


def device_kind(machine_text: str) -> str:
    """CPU or GPU for the hours a report's runs spent, as `machine` words the device; "device" where it cannot tell
    (a run whose machine was not recorded)."""
    if "no GPU" in machine_text:
        return "CPU"
    return "GPU" if re.search(r"\(\d+ GPU\)", machine_text) else "device"


NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]*")


def check_name(name: str | None) -> None:
    """A `--name` names a section key's last part and the report's files: refused in one line unless it is
    lower-case letters, digits and '-'."""
    if name is not None and not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"--name {name!r} must be lower-case letters, digits and '-' (it ends a BENCHMARKS.md "
                         "section key and names the report's files), e.g. 2m or moe-options")


def section_stem(key: str) -> str:
    """The file name, without extension, of the report behind section `key`, and of its figures:
    grid:debug:embedded-hard:2m -> grid_debug_embedded-hard_2m."""
    return key.replace(":", "_")


def add_publish_arguments(parser, report: str) -> None:
    """`--out` and `--benchmarks_md` of a measuring command whose report `report` defaults to its --work folder."""
    parser.add_argument("--out", help=f"folder of the JSON report {report} (default: --work; the repository's "
                                      "committed results: benchmarks)")
    parser.add_argument("--benchmarks_md", help="also write the table as a section of this Markdown file (the "
                                                "repository's: BENCHMARKS.md); by default no file is touched")


def check_markdown_path(path: str | None) -> None:
    """A `--benchmarks_md` whose folder does not exist is refused before anything is measured."""
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"--benchmarks_md {path!r}: its folder does not exist")


def write_report(out_dir: str, key: str, report: dict) -> str:
    """Write `report` as `out_dir/<section_stem(key)>.json` (the folder made if needed); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{section_stem(key)}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return path
