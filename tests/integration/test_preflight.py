"""A mistake in the training command answers before torch, transformers or DeepSpeed is imported (their imports
take ten seconds and more): a misspelt or abbreviated flag, a missing or broken ds_config, an unknown arch, a
`--model` field of another architecture, each in one line and a non-zero exit, from every entry point of the training
command (under torchrun's restarts, each retry of such a command costs that second again, not the imports)."""

from __future__ import annotations

import sys

import pytest

HEAVY = ("torch", "transformers", "deepspeed")
ENTRY_POINTS = {"launcher": ["launchers/train.py"], "module": ["-m", "adaptive_ds.training"],
                "cli": ["-m", "adaptive_ds.cli", "train"]}


def _imported(stderr: str) -> set[str]:
    """The top-level packages `python -X importtime` reports importing."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("argv", "status", "line"), [
    pytest.param(["--ds_config", "debug_cpu.json", "--max_step", "10"], 2,
                 "error: unrecognized arguments: --max_step 10; did you mean --max_steps? (--help lists every flag)",
                 id="abbreviated-flag"),
    pytest.param(["--ds_config", "no/such/ds.json"], 1,
                 "error: ds_config 'no/such/ds.json' does not exist; pass a JSON file, or the name of a shipped "
                 "config: b1_a100.json, ", id="missing-ds-config"),
    pytest.param(["--ds_config", "debug_cpu.json", "--arch", "bogus"], 1,
                 "error: unknown arch 'bogus'; valid choices: dense, moe, mod, hybrid", id="unknown-arch"),
    pytest.param(["--ds_config", "debug_cpu.json", "--model", '{"mod_capacity": 2}'], 1,
                 "error: model field(s) mod_capacity apply to arch mod and hybrid (MoD routing), not to arch dense",
                 id="model-field-of-another-arch"),
])
def test_a_bad_command_answers_in_one_line_without_importing_torch(run_command, entry, argv, status, line):
    result = run_command([sys.executable, "-X", "importtime", *ENTRY_POINTS[entry], *argv], timeout=120)
    imported = _imported(result.stderr)
    said = [text for text in result.stderr.splitlines() if not text.startswith("import time:")]
    assert result.returncode == status and len(said) == 1 and said[0].startswith(line), result.stderr[-2000:]
    assert "adaptive_ds" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert result.stdout == ""


def test_a_broken_ds_config_and_its_block_are_refused_the_same_way(run_command, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_micro_batch_size_per_gpu": 4,')
    block = tmp_path / "block.json"
    block.write_text('{"adaptive_ds": {"max_step": 10}, "train_micro_batch_size_per_gpu": 4}')
    for path, start in ((broken, f"error: ds_config {str(broken)!r} is not valid JSON"),
                        (block, "error: unknown key(s) max_step in the 'adaptive_ds' block")):
        result = run_command([sys.executable, "-X", "importtime", "launchers/train.py", "--ds_config", str(path)])
        said = [text for text in result.stderr.splitlines() if not text.startswith("import time:")]
        assert result.returncode == 1 and len(said) == 1 and said[0].startswith(start), result.stderr[-2000:]
        assert not _imported(result.stderr) & set(HEAVY)
