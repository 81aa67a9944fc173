"""Whether a measured section's figures are of the code as it is now.

A section of some kinds measures part of the package's code (`MEASURED_CODE`, by the kind its key starts with).
Its figures are stale when a commit after the one they were measured at (the report's `commit`) changed that code.
Rendering such a section into BENCHMARKS.md opens it with a "stale since <commit>" label naming the first such commit,
and adds the same label to each row of the file's Conclusions that links the section. A stale section fails nothing:
it says so until it is measured again. Git answers the question, in the repository this package is checked out in;
where the measured commit is not in the history at hand (a shallow clone, a commit of another branch, an installed
copy without git) the section says that instead, and its rows are left as they are.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple

from ..markdown_sections import replace_section

# How the benchmark builds each case's engine is how the trainer does (training.engine.build_engine): the MoE layer
# DeepSpeed trains (moe_adapter) and the weight-decay and MoE parameter groups (optim).
ENGINE_WIRING = ("adaptive_ds/training/engine.py", "adaptive_ds/training/moe_adapter.py",
                 "adaptive_ds/training/optim.py")
# The code each kind of section measures: the models and the engine they train in, the presets and variants that
# shape each case, the FLOPs count behind a throughput section's TFLOP/s and MFU, and the harness itself
# (tools/benchmark.py and benchmark_cases.py: its cases, their engine config and the timing). A change to the
# harness's wording alone marks its sections stale too: the label then asks for a measurement that may find the same
# figures, never the reverse.
MEASURED_CODE = {
    "throughput": ("adaptive_ds/models", *ENGINE_WIRING, "adaptive_ds/flops.py", "adaptive_ds/presets.py",
                   "adaptive_ds/tools/benchmark.py", "adaptive_ds/tools/benchmark_cases.py"),
    "generate": ("adaptive_ds/models", "adaptive_ds/presets.py", "adaptive_ds/tools/benchmark.py",
                 "adaptive_ds/tools/benchmark_cases.py"),
}
REPOSITORY = Path(__file__).resolve().parents[2]
LABEL = re.compile(r"\A\*\*(?:stale since [0-9a-f]+|staleness unknown)\*\*: [^\n]*\n\n")
ROW_LABEL = re.compile(r", \*\*stale since [0-9a-f]+\*\*")


class Staleness(NamedTuple):
    measured: str  # the commit the figures were measured at
    paths: tuple[str, ...]  # the code they measure
    since: str | None = None  # the first later commit that changed that code; None: none did, or unknown
    unknown: str | None = None  # why git could not tell; None when it could

    @property
    def label(self) -> str | None:
        """The line a section opens with: None when its figures are of the code as it is."""
        if self.unknown:
            return f"**staleness unknown**: {self.unknown}, so whether the code these figures measure has changed " \
                   "since cannot be told."
        if self.since:
            code = ", ".join(f"`{path}`" for path in self.paths)
            return (f"**stale since {self.since}**: the code these figures measure ({code}) changed at commit "
                    f"{self.since}, after commit {self.measured} where they were measured.")
        return None


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def staleness(commit: str, paths: tuple[str, ...], repo: Path = REPOSITORY) -> Staleness:
    """Whether a commit after `commit` (a short hash, "+changes" ignored) changed `paths` (relative to the
    repository's top), and the first that did, as git at `repo` answers; not where HEAD holds them as `commit` did
    (a change undone since)."""
    measured = commit.removesuffix("+changes")
    if not re.fullmatch(r"[0-9a-f]{4,40}", measured):
        return Staleness(measured, paths, unknown=f"commit {measured!r} is not a commit hash")
    if (found := _git(repo, "rev-parse", "--verify", "--quiet", f"{measured}^{{commit}}")) is None:
        return Staleness(measured, paths, unknown=f"commit {measured} cannot be looked up (no git here)")
    if found.returncode != 0:
        inside = _git(repo, "rev-parse", "--is-inside-work-tree")
        where = "this history" if inside and inside.returncode == 0 else "a git history here"
        return Staleness(measured, paths, unknown=f"commit {measured} is not in {where}")
    if _git(repo, "merge-base", "--is-ancestor", measured, "HEAD").returncode != 0:
        return Staleness(measured, paths, unknown=f"commit {measured} is not in this checkout's history")
    later = _git(repo, "rev-list", "--reverse", f"{measured}..HEAD", "--", *(f":(top){p}" for p in paths))
    if later.returncode != 0:
        return Staleness(measured, paths, unknown=f"git could not list the commits after {measured}")
    first = later.stdout.split()[:1]
    if not first:
        return Staleness(measured, paths)
    undone = _git(repo, "diff", "--quiet", measured, "HEAD", "--", *(f":(top){p}" for p in paths))
    if undone is not None and undone.returncode == 0:  # the commits since changed it and changed it back
        return Staleness(measured, paths)
    return Staleness(measured, paths, since=_git(repo, "rev-parse", "--short=7", first[0]).stdout.strip())


def section_staleness(key: str, commit: str, repo: Path = REPOSITORY) -> Staleness | None:
    """The staleness of section `key` measured at `commit`; None for a kind of section that measures no code."""
    paths = MEASURED_CODE.get(key.split(":")[0])
    return staleness(commit, paths, repo) if paths else None


def labelled(text: str, state: Staleness | None) -> str:
    """A section's text as rendered: its label first, where it has one."""
    label = state.label if state else None
    return f"{label}\n\n{text}" if label else text


def unlabelled(text: str) -> str:
    """A section's text without its label."""
    return LABEL.sub("", text, count=1)


def label_rows(content: str, key: str, state: Staleness | None) -> str:
    """The Markdown `content` with each row of its Conclusions that links section `key` labelled as `state` says:
    ", **stale since C**" after the link when stale, no label when not; left as it is when unknown."""
    if state is None or state.unknown or "\n## Conclusions\n" not in content:
        return content
    head, rest = content.split("\n## Conclusions\n", 1)
    conclusions, *after = rest.split("\n## ", 1)
    link = re.compile(r"(\[`" + re.escape(key) + r"`\]\(#[\w-]+\))(?:" + ROW_LABEL.pattern + ")?")
    suffix = f", **stale since {state.since}**" if state.since else ""
    rows = [link.sub(lambda m: m.group(1) + suffix, line) if line.startswith("| ") else line
            for line in conclusions.split("\n")]
    return "\n## ".join([head + "\n## Conclusions\n" + "\n".join(rows), *after])


def write_labelled_section(path: str, key: str, text: str, heading: str, commit: str,
                           repo: Path | None = None) -> None:
    """`replace_section` with the section's label, and its Conclusions rows labelled alike (`label_rows`); git is
    asked in `repo` (default: this package's repository)."""
    state = section_staleness(key, commit, repo or REPOSITORY)
    replace_section(path, key, labelled(text, state), heading)
    with open(path) as f:
        content = f.read()
    labelled_rows = label_rows(content, key, state)
    if labelled_rows != content:
        with open(path, "w") as f:
            f.write(labelled_rows)
