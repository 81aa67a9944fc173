"""The commands the docs show do what they say: each `make` target a page shows is valid (`make -n`), and each
fenced block tagged `bash run` in README.md and docs/ runs verbatim, in a directory of its own (the blocks of one
page in order, sharing it), and exits 0. tests/unit/test_docs.py parses every command first."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers.common import ROOT, output_within, script_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+) ?(\w*)\n(.*?)^```$", flags=re.S | re.M)


def _blocks(tag: str) -> dict[str, list[str]]:
    return {p.relative_to(ROOT).as_posix(): [body for lang, t, body in FENCE.findall(p.read_text())
                                            if lang == "bash" and t == tag] for p in PAGES}


def _make_targets() -> list[str]:
    targets = set()
    for bodies in _blocks("check").values():
        for body in bodies:
            for line in body.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:1] == ["make"]:
                    targets.update(w for w in words[1:] if not w.startswith("-") and "=" not in w)
    return sorted(targets)


@pytest.mark.parametrize("target", _make_targets())
def test_each_make_target_the_docs_show_is_valid(target):
    outer = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")  # under `make test`, a make of its own, not a sub-make
    env = {k: v for k, v in os.environ.items() if k not in outer}
    done = subprocess.run(["make", "-n", *shlex.split(target)], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), f"make -n {target} runs nothing"


def test_the_make_targets_are_found():
    assert {"train", "test"} <= set(_make_targets())


def test_make_train_passes_ARGS_to_the_training_command():
    """`make train ARGS="..."` (README's quick start): the flags follow the shipped config, so they override its
    block, and a stopped run's line ("rerun the same command with --output_dir ...") is a make command too."""
    outer = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    done = subprocess.run(["make", "-n", "train", "ARGS=--max_steps 3 --output_dir runs/x"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    (command,) = [line for line in done.stdout.splitlines() if "launchers/train.py" in line]
    assert command.endswith("deepspeed launchers/train.py --ds_config ds_configs/debug_cpu.json --max_steps 3 "
                            "--output_dir runs/x"), command


def _run_block(body: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """`body` as a bash script in `cwd`, with the test's Python first on PATH; the whole process group is killed if
    it outlives `timeout`."""
    process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", body], cwd=cwd, env=script_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output = output_within(process, timeout)
    return subprocess.CompletedProcess(body, process.returncode, output)


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page, bodies in _blocks("run").items() if bodies])
def test_the_runnable_blocks_of_a_page_run(page, tmp_path):
    """As a user runs them from the repository's root: launchers/ and ds_configs/ beside, runs/ and data/ new."""
    for name in ("launchers", "ds_configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    for body in _blocks("run")[page]:
        done = _run_block(body, tmp_path, timeout=600)
        assert done.returncode == 0, f"{page}:\n{body}\n{done.stdout[-3000:]}"
