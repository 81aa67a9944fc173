"""A measured section whose code changed after its commit is labelled "stale since <commit>", in BENCHMARKS.md and
in each Conclusions row that cites it, as real git answers: on repositories made here, commit by commit, and on this
repository's BENCHMARKS.md, whose labels are there exactly when the rule says stale (being stale fails nothing)."""

import json
import re
import subprocess

import pytest
from helpers.common import ROOT

from adaptive_ds.tools import benchmark, staleness
from adaptive_ds.tools.staleness import MEASURED_CODE, section_staleness, unlabelled

THROUGHPUT = MEASURED_CODE["throughput"]
KEY = "throughput:debug:cpu"


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com",
                           "-c", "commit.gpgsign=false", *args], capture_output=True, text=True, check=True).stdout


def _commit(repo, path: str, text: str) -> str:
    """Write `text` to `path` in `repo`, commit it, and return the commit's short hash as git writes it."""
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", path)
    _git(repo, "commit", "-q", "-m", f"change {path}")
    return _git(repo, "rev-parse", "--short=7", "HEAD").strip()


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    return repo


def test_a_change_of_the_measured_code_after_the_sections_commit_makes_it_stale_since_the_first(repo):
    measured = _commit(repo, "adaptive_ds/models/model.py", "v1\n")
    _commit(repo, "README.md", "docs\n")
    _commit(repo, "adaptive_ds/tools/grid.py", "another tool\n")
    assert staleness.staleness(measured, THROUGHPUT, repo).label is None  # nothing it measures changed
    first = _commit(repo, "adaptive_ds/models/model.py", "v2\n")
    _commit(repo, "adaptive_ds/training/engine.py", "wiring\n")
    for commit in (measured, f"{measured}+changes"):
        state = staleness.staleness(commit, THROUGHPUT, repo)
        assert (state.measured, state.since, state.unknown) == (measured, first, None)
        assert state.label.startswith(f"**stale since {first}**: ") and f"after commit {measured} " in state.label
    # the engine wiring alone makes it stale too; a section measured at the last change is not
    assert staleness.staleness(first, THROUGHPUT, repo).since != first
    assert staleness.staleness(_commit(repo, "adaptive_ds/flops.py", "x\n"), THROUGHPUT, repo).since is None
    assert section_staleness("grid:debug:embedded-hard", measured, repo) is None  # a kind that measures no code


def test_a_change_undone_since_leaves_the_section_fresh(repo):
    """What the figures measured is what HEAD holds again (a change reverted): not stale; changed again, stale since
    the first change after the measured commit."""
    measured = _commit(repo, "adaptive_ds/models/model.py", "v1\n")
    changed = _commit(repo, "adaptive_ds/tools/benchmark.py", "a field more\n")
    _git(repo, "rm", "-q", "adaptive_ds/tools/benchmark.py")
    _git(repo, "commit", "-q", "-m", "undo")
    assert staleness.staleness(measured, THROUGHPUT, repo).since is None
    _commit(repo, "adaptive_ds/models/model.py", "v2\n")
    assert staleness.staleness(measured, THROUGHPUT, repo).since == changed


def test_a_commit_git_cannot_place_is_said_so_not_a_crash(repo, tmp_path):
    measured = _commit(repo, "adaptive_ds/models/model.py", "v1\n")
    _git(repo, "checkout", "-q", "-b", "other")
    elsewhere = _commit(repo, "adaptive_ds/models/model.py", "another branch\n")
    _git(repo, "checkout", "-q", "main")
    _commit(repo, "adaptive_ds/models/model.py", "v2\n")
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    cases = {(repo, "1234567"): "commit 1234567 is not in this history",
             (repo, elsewhere): f"commit {elsewhere} is not in this checkout's history",
             (shallow, measured): f"commit {measured} is not in this history",
             (plain, measured): f"commit {measured} is not in a git history here",
             (repo, "unknown"): "commit 'unknown' is not a commit hash"}
    for (where, commit), why in cases.items():
        state = staleness.staleness(commit, THROUGHPUT, where)
        assert (state.since, state.unknown) == (None, why)
        assert state.label.startswith(f"**staleness unknown**: {why}, so whether")


def test_rendering_labels_a_stale_section_and_the_conclusions_rows_that_cite_it(repo, monkeypatch):
    """The benchmark's own publishing (write_section), on a report of commit `measured` in a repository where the
    model code changed after it; rendered again once measured at the change, the labels go."""
    measured = _commit(repo, "adaptive_ds/models/model.py", "v1\n")
    first = _commit(repo, "adaptive_ds/models/model.py", "v2\n")
    monkeypatch.setattr(staleness, "REPOSITORY", repo)
    report = json.loads((ROOT / "tests" / "fixtures" / "throughput_debug_cpu_20b32a5.json").read_text())
    md = repo / "BENCHMARKS.md"
    rows = [f"| {name} | x | [`{key}`](#{key.replace(':', '')}) |" for name, key in
            (("ours", KEY), ("another section's", "grid:debug:embedded-hard"))]
    md.write_text("# Benchmarks\n\n## Conclusions\n\n| q | r | section |\n|---|---|---|\n" + "\n".join(rows) +
                  f"\n\n## Throughput\n\n<!-- {KEY} -->\nold\n<!-- /{KEY} -->\n")
    report = {**report, "commit": measured}
    benchmark.write_section(str(md), report)
    text = md.read_text()
    section = re.search(f"<!-- {KEY} -->\n(.*)\n<!-- /{KEY} -->", text, flags=re.S).group(1)
    assert section.startswith(f"**stale since {first}**: ") and unlabelled(section) == benchmark.markdown(report)
    assert f"{rows[0][:-2]}, **stale since {first}** |" in text and rows[1] in text
    benchmark.write_section(str(md), {**report, "commit": first})
    assert "stale since" not in md.read_text() and rows[0] in md.read_text()


def _real_sections() -> dict[str, str]:
    text = (ROOT / "BENCHMARKS.md").read_text()
    return {key: section for key, section in re.findall(r"^<!-- ([\w:.-]+) -->\n(.*?)\n<!-- /\1 -->$", text,
                                                        flags=re.S | re.M) if key.split(":")[0] in MEASURED_CODE}


@pytest.mark.parametrize("key", sorted(_real_sections()))
def test_each_section_of_benchmarks_md_is_labelled_exactly_when_its_code_changed_since(key):
    section = _real_sections()[key]
    commit = re.search(r", commit ([\w+]+): `", unlabelled(section)).group(1)
    state = section_staleness(key, commit, ROOT)
    if state.unknown:
        pytest.skip(state.label)
    label = section.split("\n\n", 1)[0] if unlabelled(section) != section else None
    assert label == state.label, (f"{key}: render it again (python -m adaptive_ds.tools.benchmark --restate "
                                  "REPORT --benchmarks_md BENCHMARKS.md)")


def test_a_copy_of_the_tree_without_git_takes_its_commit_from_the_environment(repo, tmp_path, monkeypatch):
    """A report's provenance from a tree copied without its .git (a container image) is the commit its copier
    names; inside a checkout git's own answer wins, and without either it is 'unknown'."""
    from adaptive_ds.tools.report import commit

    head = _commit(repo, "adaptive_ds/models/model.py", "v1\n")
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.chdir(plain)
    monkeypatch.delenv("ADAPTIVE_DS_COMMIT", raising=False)
    assert commit() == "unknown"
    monkeypatch.setenv("ADAPTIVE_DS_COMMIT", "abc1234")
    assert commit() == "abc1234"
    monkeypatch.chdir(repo)
    assert commit() == head
