"""Every shipped ds_config trains as configured (tests/helpers/shipped.py): its precision, loss scaling, ZeRO stage,
offload and optimizer as its file writes them, at the debug preset on the embedded corpus, on one process. The two
half-precision configs that tests/integration/test_half_precision.py trains for every architecture are left to it;
every other shipped config is trained here. A shipped ZeRO-3 config asked for an MoE architecture is refused in one
line, as DeepSpeed MoE does not run under ZeRO-3."""

import json
import math

import pytest
from helpers.shipped import HALF_PRECISION, EngineFacts, as_configured, expected_facts, needs, shipped

from adaptive_ds import ds_config as reader
from adaptive_ds.training import train
from adaptive_ds.training.__main__ import main

OTHERS = [name for name in reader.shipped() if name not in HALF_PRECISION.values()]


def test_the_half_precision_configs_are_shipped_and_the_rest_are_trained_here():
    assert set(HALF_PRECISION.values()) < set(reader.shipped()) and len(OTHERS) >= 6
    assert {reader.precision(shipped(name)) for name in OTHERS} == {"fp32", "fp16", "bf16"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs(reader.precision(shipped(n)))) for n in OTHERS])
def test_each_shipped_config_trains_as_configured(name, tmp_path):
    facts, out = EngineFacts(), tmp_path / "run"
    summary = train(["--ds_config", as_configured(name, tmp_path, max_steps=3), "--output_dir", str(out)],
                    hooks=facts)
    assert facts.facts == expected_facts(name)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    assert summary["arch"] == shipped(name)["adaptive_ds"]["arch"]


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_a_zero_3_config_with_an_moe_architecture_is_refused_in_one_line(arch, tmp_path, monkeypatch, capsys):
    """As a user would start it: the shipped name on the 8 processes it is written for, another architecture asked
    for; nothing is written."""
    assert shipped("b7_8gpu.json")["zero_optimization"]["stage"] == 3
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit) as exit:
        main(["--ds_config", "b7_8gpu.json", "--arch", arch, "--output_dir", str(tmp_path / "run")])
    assert exit.value.code == 1 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: arch {arch}: DeepSpeed MoE does not run under ZeRO-3; use zero_optimization stage 1 or 2 (with "
        "expert parallelism)")
