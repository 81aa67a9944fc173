"""The side-by-side throughput benchmark runs every case through the DeepSpeed engine on CPU."""

from adaptive_ds.benchmark import CASES, RATIOS, run_benchmark, write_section


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
