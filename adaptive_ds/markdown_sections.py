"""Generated sections of a Markdown file: the text between ``<!-- KEY -->`` and ``<!-- /KEY -->``, rewritten by the
command that generates it (the settings table of docs/training.md, BENCHMARKS.md's measured and projected sections)."""

from __future__ import annotations

import os
import re


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
