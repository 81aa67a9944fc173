"""The side-by-side throughput benchmark runs every case through the DeepSpeed engine on CPU."""

import json
import re
import sys

import pytest
import torch

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.presets import VARIANTS, model_config
from adaptive_ds.tools.benchmark import CASES, RATIOS, measure_generation, run_benchmark, write_section


def test_benchmark_reports_every_case_and_ratio(tmp_path):
    # the compiled cases through dynamo's eager backend: their graphs, breaks and recompilations are counted as with
    # inductor, without its code generation (tests/integration/test_training.py trains with --compile, inductor)
    report = run_benchmark("debug", steps=1, rounds=2, warmup=1, micro_batch=2, precision="fp32", cases=list(CASES),
                           compile_backend="eager")
    assert set(report["results"]) == set(CASES)
    for result in report["results"].values():
        assert len(result["rounds"]) == 2 and result["tokens_per_s"] > 0 and result["mfu"] is None
        assert result["warmup_tokens_per_s"] > 0  # the warm-up round, recorded apart from the counted ones
    compiled = [name for name, r in report["results"].items() if r["compiled"]]
    assert compiled == ["dense_compile", "hf_llama_compile", "hf_llama_loss_compile"]
    assert set(report["ratios"]) == set(report["ratio_rounds"]) == {f"{a}/{b}" for a, b in RATIOS}
    for name, values in report["ratio_rounds"].items():  # each round's ratio, of that round's two figures
        a, b = (report["results"][case]["rounds"] for case in name.split("/"))
        assert values == [a[0] / b[0], a[1] / b[1]] and min(values) <= report["ratios"][name] <= max(values)
    # MoD's FLOPs per token count only the routed tokens; the mod case runs capacity 0.5 in every block
    assert CASES["mod"].model == {"arch": "mod", "mod_capacity": 0.5, "mod_layer_interval": 1}
    assert report["results"]["mod"]["flops_per_token"] < 0.6 * report["results"]["dense"]["flops_per_token"]
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    write_section(str(md), report)
    text = md.read_text()
    assert "<!-- throughput:debug:cpu -->" in text and "--micro_batch 2 --precision fp32" in text
    assert text.count("| ") > len(CASES) + len(RATIOS) and "| dense / hf_llama_compile |" in text


def test_generation_benchmark_measures_each_case_at_equal_length(tmp_path):
    tokenizer = embedded_tokenizer()
    trained = AdaptiveDSForCausalLM(model_config("debug", vocab_size=len(tokenizer), **CASES["mod"].model))
    for name, param in trained.named_parameters():
        if name.endswith("router.weight"):
            torch.nn.init.zeros_(param)  # a router that routes nothing: random ones route about half
    trained.save_pretrained(tmp_path / "mod")
    tokenizer.save_pretrained(tmp_path / "mod")
    # the hybrid at its defaults (MoD in every other block, top-1 dropless), its routers routing some tokens
    hybrid = AdaptiveDSForCausalLM(model_config("debug", "hybrid", len(tokenizer)))
    for name, param in hybrid.named_parameters():
        if name.endswith("router.weight"):
            torch.nn.init.normal_(param, std=1.0)
    hybrid.save_pretrained(tmp_path / "hybrid")
    tokenizer.save_pretrained(tmp_path / "hybrid")
    report = measure_generation("debug", ["dense", "mod", "hybrid"], batch=2, prompt_len=4, new_tokens=6, rounds=1,
                                trained={"mod": str(tmp_path / "mod"), "hybrid": str(tmp_path / "hybrid")})
    dense, mod, hyb = (report["results"][name] for name in ("dense", "mod", "hybrid"))
    assert dense["tokens_per_s"] > 0 and mod["tokens_per_s"] > 0 and set(report["ratios"]) == {"mod/dense",
                                                                                                "hybrid/dense"}
    assert dense["routed"] == [] and mod["routed"] == [0.0] * 4 and mod["trained"] == str(tmp_path / "mod")
    # cached generation equals uncached where routing really skips some tokens and runs others
    assert len(hyb["routed"]) == 2 and all(0 < r < 1 for r in hyb["routed"])
    assert dense["equal_without_cache"] and mod["equal_without_cache"] and hyb["equal_without_cache"]


# The planner counts the model's states and activations; a process also holds its runtime's own allocations
# (DeepSpeed's communication op, torch's thread pools), so a measured peak lies at or above the
# prediction and, where the model's states dominate, at most this far beyond it.
RUNTIME_GIB = 0.2


def test_peak_memory_of_a_case_with_its_model_settings_is_near_the_planners_prediction(capsys, tmp_path, run_command):
    """Measured in a fresh process: on a CPU the peak is the process's resident high-water mark, which tests run
    before in this one would own. The hybrid case with 16 experts: its model states dominate."""
    from adaptive_ds.tools.benchmark import _ds_config, main
    from adaptive_ds.tools.plan import plan

    done = run_command([sys.executable, "-m", "adaptive_ds.tools.benchmark", "--memory", "--preset", "debug", "--cases",
                        "hybrid", "--micro_batch", "1", "--experts", "16", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(re.search(r"^\{$.*?^\}$", done.stdout, re.M | re.S).group())
    # its report, named as the planner's validation reads the committed ones (benchmarks/memory_*.json)
    assert json.loads((tmp_path / "memory_debug_cpu_hybrid_mb1_e16.json").read_text()) == result
    assert (result["case"], result["arch"], result["experts"], result["device"]) == ("hybrid", "hybrid", 16, "cpu")
    assert 0 < result["predicted_gib"] <= result["measured_gib"] <= result["predicted_gib"] + RUNTIME_GIB, result
    # the hybrid case is MoD 0.5 in every block around top-2 MoE, as the throughput benchmark runs it, not the
    # hybrid's defaults
    predicted = {name: plan("debug", "hybrid", "h200", _ds_config(1, "fp32"), vocab_size=128, cpu_process=True,
                            model_overrides={"moe_drop_tokens": False, "num_local_experts": 16, **overrides}).peak_gib
                 for name, overrides in (("case", {**VARIANTS["mod:half"].model, "num_experts_per_tok": 2}),
                                         ("default", {}))}
    assert result["predicted_gib"] == predicted["case"] != predicted["default"]
    with pytest.raises(SystemExit):
        main(["--memory", "--cases", "hf_llama"])  # not one of our models: it would measure the dense one
    assert "--memory measures one of our models; --cases one of dense, moe, mod" in capsys.readouterr().err
