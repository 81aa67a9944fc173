"""BENCHMARKS.md publishes no tokens/s above what its hardware's peak allows for the model's FLOPs, and every
generated section says where it came from."""

import re

import pytest
from conftest import ROOT

from adaptive_ds.benchmark import CASES
from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.flops import training_flops_per_token
from adaptive_ds.hardware import DEVICES
from adaptive_ds.presets import PRESETS, model_config

# A generous bound for the 2-core CPU figures: 2 cores x 4 GHz x 2 FMA units x 16 fp32 lanes x 2 FLOPs.
CPU_PEAK_TFLOPS = 2 * 4e9 * 2 * 16 * 2 / 1e12
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()


def _section(key: str) -> str:
    match = re.search(f"<!-- {re.escape(key)} -->(.*?)<!-- /{re.escape(key)} -->", BENCHMARKS, flags=re.S)
    assert match, f"BENCHMARKS.md has no {key} section"
    return match.group(1)


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, body rows) of every Markdown table in `text`."""
    tables = []
    for block in re.findall(r"(?:^\|.*\|\n?)+", text, flags=re.M):
        lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()]
        tables.append((lines[0], [row for row in lines[2:]]))
    return tables


def _number(text: str) -> float:
    return float(re.sub(r"[^0-9.]", "", text))


def _cpu_tflops(tokens_per_s: float, arch: str, **overrides) -> float:
    config = model_config("debug", arch, len(embedded_tokenizer()), **overrides)
    return tokens_per_s * training_flops_per_token(config, PRESETS["debug"].seq_len) / 1e12


def test_measured_cpu_throughput_stays_under_the_cpu_peak():
    section = _section("throughput:debug:cpu")
    assert "Measured" in section and "commit" in section and "`python -m adaptive_ds.benchmark" in section
    (header, rows), _ = _tables(section)
    assert header[:2] == ["case", "tokens/s"] and len(rows) == len(CASES)
    for case, tokens_per_s, _ in rows:
        name = re.search(r"`(\w+)`", case).group(1)
        assert _cpu_tflops(_number(tokens_per_s), **CASES[name].model) < CPU_PEAK_TFLOPS, case


def test_the_measured_grid_stays_under_the_cpu_peak():
    section = _section("grid:debug:embedded-hard")
    assert "Measured" in section and "no GPU" in section and "`python -m adaptive_ds.grid" in section
    speed = next((header, rows) for header, rows in _tables(section) if "tokens/s" in header)
    header, rows = speed
    column = header.index("tokens/s")
    variants = [row[0] for row in rows]
    assert {"dense", "moe", "mod", "hybrid"} <= set(variants)
    for row in rows:
        arch = re.match(r"(\w+)", row[0]).group(1)  # a variant's architecture: dense+{...} -> dense
        tokens_per_s = _number(row[column].split("±")[0])  # the mean over the seeds
        assert _cpu_tflops(tokens_per_s, arch) < CPU_PEAK_TFLOPS, row[0]


def test_projections_are_labelled_and_stay_under_the_gpu_peak():
    section = _section("plan:projections")
    assert "not measurements" in section
    presets = re.findall(r"\*\*(\w+)\*\*", section)
    tables = _tables(section)
    assert presets == ["debug_200m", "b1", "b7"] and len(tables) == len(presets)
    for preset, (header, rows) in zip(presets, tables, strict=True):
        bound, projected = header.index("tokens/s bound"), header.index("projected tokens/s")
        for row in rows:
            gpus, gpu = re.match(r"(\d+) x (\w+),", row[header.index("hardware, config")]).groups()
            config = model_config(preset, row[0], 32000)
            flops = training_flops_per_token(config, PRESETS[preset].seq_len)
            peak = DEVICES[gpu].peak_tflops
            limit = int(gpus) * peak * 1e12 / flops
            assert _number(row[projected]) <= _number(row[bound]) <= limit * 1.001, (preset, row[0], gpu)


@pytest.mark.parametrize("key", ["throughput:debug:cpu", "grid:debug:embedded-hard", "grid:debug:text-prepared",
                                 "plan:validation", "plan:projections"])
def test_every_generated_section_is_filled(key):
    assert _section(key).count("\n|") >= 3
