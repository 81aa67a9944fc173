"""The side-by-side throughput benchmark runs every case through the DeepSpeed engine on CPU."""

import torch

from adaptive_ds.benchmark import CASES, RATIOS, measure_generation, run_benchmark, write_section
from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.presets import model_config


def test_benchmark_reports_every_case_and_ratio(tmp_path):
    report = run_benchmark("debug", steps=1, rounds=2, warmup=1, micro_batch=2, precision="fp32", cases=list(CASES))
    assert set(report["results"]) == set(CASES)
    for result in report["results"].values():
        assert len(result["rounds"]) == 2 and result["tokens_per_s"] > 0 and result["mfu"] is None
    assert [name for name, r in report["results"].items() if r["compiled"]] == ["dense_compile", "hf_llama_compile"]
    assert set(report["ratios"]) == {f"{a}/{b}" for a, b in RATIOS}
    # MoD's FLOPs per token count only the routed tokens
    assert report["results"]["mod"]["flops_per_token"] < 0.6 * report["results"]["dense"]["flops_per_token"]
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    write_section(str(md), report)
    text = md.read_text()
    assert "<!-- throughput:debug:cpu -->" in text and "--micro_batch 2 --precision fp32" in text
    assert text.count("| ") > len(CASES) + len(RATIOS) and "| dense / hf_llama_compile |" in text


def test_generation_benchmark_measures_each_case_at_equal_length(tmp_path):
    tokenizer = embedded_tokenizer()
    trained = AdaptiveDSForCausalLM(model_config("debug", "mod", len(tokenizer)))
    for name, param in trained.named_parameters():
        if name.endswith("router.weight"):
            torch.nn.init.zeros_(param)  # a router that routes nothing: random ones route about half
    trained.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    report = measure_generation("debug", ["dense", "mod"], batch=2, prompt_len=4, new_tokens=3, rounds=1,
                                trained={"mod": str(tmp_path)})
    dense, mod = report["results"]["dense"], report["results"]["mod"]
    assert dense["tokens_per_s"] > 0 and mod["tokens_per_s"] > 0 and set(report["ratios"]) == {"mod/dense"}
    assert dense["routed"] == [] and mod["routed"] == [0.0] * 4 and mod["trained"] == str(tmp_path)
    assert dense["equal_without_cache"] and mod["equal_without_cache"]
