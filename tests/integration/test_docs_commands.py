"""The commands the docs show do what they say: each `make` target a page shows is valid (`make -n`), and each
fenced block tagged `bash run` in README.md and docs/ runs verbatim, in a directory of its own (the blocks of one
page in order, sharing it), exits 0, and has the effect its page claims for it (`EFFECTS`: the claim, quoted from
the page, and what shows it in the files and the output). tests/unit/test_docs.py checks every command first."""

from __future__ import annotations

import json
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


def _continued_and_exported(workdir: Path, output: str) -> None:
    """Saves at steps 2 and 4, the same command continued from step 4 to 6 (saving 6), and the export a stock
    LlamaForCausalLM folder, all its weights taken, with the run's logits."""
    import torch
    from transformers import LlamaForCausalLM

    from adaptive_ds.models import AdaptiveDSForCausalLM

    run = workdir / "runs" / "resume-demo"
    saved = re.findall(r"saved checkpoint runs/resume-demo/checkpoints/step0*(\d+)", output)
    assert saved == ["2", "4", "6"], saved
    assert "resumed from step00000004 at step 4" in output
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["resumed_from_step"]) == (6, 4)
    step_tokens = 16 * 256  # the debug config's 16 rows a step at the debug preset's 256 tokens
    assert summary["tokens_seen"] == 6 * step_tokens
    # the summary line's tokens and seconds over one span: this start's 2 steps in this start's seconds
    assert (f"after {6 * step_tokens:,} tokens, {2 * step_tokens:,} of them in this start's "
            f"{summary['wall_time_s']:.0f} s (resumed at step 4)") in output
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6, steps  # each step once: the run continued, not again
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000006"
    llama, info = LlamaForCausalLM.from_pretrained(workdir / "runs" / "resume-demo-llama", output_loading_info=True)
    assert type(llama) is LlamaForCausalLM and not info["missing_keys"] and not info["unexpected_keys"], info
    ours = AdaptiveDSForCausalLM.from_pretrained(run / "final").eval()
    ids = torch.arange(3, 35).reshape(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(llama.eval()(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


def _trained_and_sampled(workdir: Path, output: str) -> None:
    """Twenty steps on the embedded corpus, then the prompt and its continuation from final/."""
    summary = json.loads((workdir / "runs" / "first" / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["resumed_from_step"] == 0
    assert json.loads((workdir / "runs" / "first" / "run_identity.json").read_text())["data"] == "embedded"
    samples = [line for line in output.splitlines() if "[arith] 7 * 8 =" in line and "INFO" not in line]
    assert len(samples) == 1 and len(samples[0].split("[arith] 7 * 8 =", 1)[1].strip()) > 0, samples


def _planned(workdir: Path, output: str) -> None:
    """The plan's lines as the page lists them, its parameter counts the presets table's, its token budget 20 x
    the total parameters, at the stated MFU and the T4's memory."""
    total, active = re.search(r"^b1\s+moe\s+([\d,]+)\s+([\d,]+)", output, flags=re.M).groups()
    assert f"parameters: {total} total, {active} active" in output
    for line in ("model states per GPU: ", "in CPU RAM (offload): ", " without checkpointing, ", " with\n",
                 "predicted peak: ", " of 15 GiB", "what runs instead", "training FLOPs per token: ",
                 "tokens/s: at most ", "at 35% MFU", "/GPU-hour"):
        assert line in output, line
    budget = int(re.search(r"^  ([\d,]+) tokens: ", output, flags=re.M).group(1).replace(",", ""))
    assert budget == 20 * int(total.replace(",", ""))


# What each page with `bash run` blocks says they do (quoted from it), and the check that they did.
EFFECTS = {
    "docs/checkpoints.md": ("Save every 2 steps, continue the same run to 6 steps, and export it as a stock Llama "
                            "folder", _continued_and_exported),
    "docs/training.md": ("Twenty steps of the debug model on the embedded corpus, then a sample from the model it "
                         "saved", _trained_and_sampled),
    "docs/hardware.md": ("It prints total and active parameters, model-state memory per GPU and in CPU RAM",
                         _planned),
}


def test_each_page_that_runs_blocks_says_what_they_do_and_is_checked_for_it():
    """A page's claim, changed, fails here until its check is looked at again."""
    running = {page for page, bodies in _blocks("run").items() if bodies}
    assert running == set(EFFECTS)
    for page, (claim, _) in EFFECTS.items():
        assert claim in " ".join((ROOT / page).read_text().split()), (page, claim)


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page, bodies in _blocks("run").items() if bodies])
def test_the_runnable_blocks_of_a_page_run(page, tmp_path):
    """As a user runs them from the repository's root: launchers/ and ds_configs/ beside, runs/ and data/ new."""
    for name in ("launchers", "ds_configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    output = ""
    for body in _blocks("run")[page]:
        done = _run_block(body, tmp_path, timeout=600)
        assert done.returncode == 0, f"{page}:\n{body}\n{done.stdout[-3000:]}"
        output += done.stdout
    EFFECTS[page][1](tmp_path, output)
