"""Generated sections of BENCHMARKS.md, and the provenance every figure carries (machine, commit)."""

from __future__ import annotations

import os
import platform
import re
import subprocess

import torch


def commit() -> str:
    """The checkout's short commit hash, with "+changes" when the tree differs from it; "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if dirty else head


def machine() -> str:
    """The device figures were measured on, in words."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} GPU)"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, no GPU"


def replace_section(path: str, key: str, text: str, heading: str) -> None:
    """Put `text` between ``<!-- KEY -->`` and ``<!-- /KEY -->`` in the Markdown file at `path`, replacing what
    was there; a file without the markers gets them appended under `heading`, a missing file is created. Nothing
    else is touched."""
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    content = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            content = f.read()
    block = f"{start}\n{text}\n{end}"
    if start in content:
        content = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, content, flags=re.S)
    else:
        content = content.rstrip("\n") + f"\n\n## {heading}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(content)
