"""BENCHMARKS.md publishes no tokens/s above what the hardware's peak allows for the model's FLOPs."""

import re

from conftest import ROOT

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.flops import training_flops_per_token
from adaptive_ds.hardware import PEAK_TFLOPS
from adaptive_ds.plan import plan
from adaptive_ds.presets import PRESETS, model_config

# A generous bound for the 2-core CPU figures: 2 cores x 4 GHz x 2 FMA units x 16 fp32 lanes x 2 FLOPs.
CPU_PEAK_TFLOPS = 2 * 4e9 * 2 * 16 * 2 / 1e12
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()


def _rows(heading: str) -> list[list[str]]:
    """The body rows of the first table under `heading`."""
    section = BENCHMARKS.split(heading, 1)[1].split("\n## ", 1)[0]
    table = section[section.index("\n|"):].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()
            if not line.startswith("|---")][1:]


def _number(text: str) -> float:
    return float(re.sub(r"[^0-9.]", "", text))


def test_cpu_throughput_stays_under_the_cpu_peak():
    vocab = len(embedded_tokenizer())
    rows = _rows("## Training throughput side by side, debug preset, CPU")
    assert len(rows) == 7
    for case, tokens_per_s, *_ in rows:
        name = case.split()[0]
        arch = {"moe_deepspeed": "moe", "hf_mixtral": "moe", "hf_llama": "dense"}.get(name, name)
        flops = training_flops_per_token(model_config("debug", arch, vocab), PRESETS["debug"].seq_len)
        assert _number(tokens_per_s) * flops / 1e12 < CPU_PEAK_TFLOPS, case


def test_projected_tokens_per_s_stay_under_the_gpu_peak():
    rows = _rows("## Projections (planner, not measurements)")
    assert rows
    for preset_arch, hardware, _, bound, projected, *_ in rows:
        preset, arch = preset_arch.split()
        gpus = int(hardware.split(" x ")[0])
        gpu = hardware.split(" x ")[1].split(",")[0].split()[0].lower()
        flops = plan(preset, arch, "h100" if gpu == "h100" else "a100" if gpu == "a100" else "t4",
                     {"train_micro_batch_size_per_gpu": 1}).flops_per_token
        assert _number(projected) <= _number(bound) <= gpus * PEAK_TFLOPS[gpu] * 1e12 / flops * 1.001, preset_arch
