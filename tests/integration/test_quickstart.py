"""The quick-start timing tool on a stand-in repository whose Makefile's train and test are tiny: it clones HEAD
(not the uncommitted tree), runs both commands in order, reports a failure as one, and writes BENCHMARKS.md only
when asked."""

import json
import subprocess
import sys

from helpers.common import ROOT

MAKEFILE = """train:
\t@echo setting up; echo "final loss 4.20"
test:
\t@cat status.txt; exit $$(cat status.txt)
"""


def _repository(tmp_path, status: int):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "Makefile").write_text(MAKEFILE)
    (repo / "status.txt").write_text(f"{status}\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "stand-in"], cwd=repo, check=True)
    return repo


def _tool(*args):
    return subprocess.run([sys.executable, "-m", "adaptive_ds.tools.quickstart", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_both_commands_are_timed_from_a_clone_of_head_and_the_section_written_only_when_asked(tmp_path):
    repo = _repository(tmp_path, 0)
    (repo / "status.txt").write_text("3\n")  # not committed: the clone runs HEAD, whose test passes
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n\nkept\n")
    done = _tool("--repository", repo, "--work", tmp_path / "work")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "work" / "quickstart.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert report["commit"] == head and [r["command"] for r in report["results"]] == ["make train", "make test"]
    assert report["results"][0]["last_lines"] == ["setting up", "final loss 4.20"]
    assert [r["exit_status"] for r in report["results"]] == [0, 0] and report["results"][1]["last_lines"] == ["0"]
    assert markdown.read_text() == "# Benchmarks\n\nkept\n"
    done = _tool("--repository", repo, "--work", tmp_path / "work", "--out", tmp_path / "pub",
                 "--benchmarks_md", markdown)
    assert done.returncode == 0, done.stderr[-2000:]
    text = markdown.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n") and "<!-- quickstart -->" in text and "`make test`" in text
    assert (tmp_path / "pub" / "quickstart.json").exists()


def test_a_failing_command_is_reported_and_the_tool_exits_non_zero(tmp_path):
    repo = _repository(tmp_path, 2)
    done = _tool("--repository", repo, "--work", tmp_path / "work")
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        "error: a quick-start command failed: make train exit status 0; make test exit status 2")
    report = json.loads((tmp_path / "work" / "quickstart.json").read_text())
    assert report["results"][1]["exit_status"] == 2


def test_a_folder_that_is_not_a_checkout_is_refused_in_one_line(tmp_path):
    done = _tool("--repository", tmp_path, "--work", tmp_path / "work")
    assert done.returncode == 1 and done.stderr.strip() == (
        f"error: --repository {str(tmp_path)!r} is not a git checkout (the quick start runs from a clone of one)")
    assert not (tmp_path / "work").exists()
