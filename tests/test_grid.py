"""The benchmark grid trains every architecture in its own process and writes the seed's tables."""

import json

import pytest
from conftest import write_ds_config

from adaptive_ds.grid import PHASES, GridError, markdown, run_grid, write_section


@pytest.mark.slow  # four training subprocesses
def test_grid_reports_every_architecture_and_rewrites_its_section(tmp_path):
    # a config that names C4 (as the GPU configs do): the grid still trains offline on the embedded corpus
    config = write_ds_config(tmp_path, micro=16, data="allenai/c4", tokenizer="bpe:32000", log_steps=1)
    report = run_grid("debug", 8192, str(tmp_path / "out"), config, str(tmp_path / "runs"), price=0.5,
                      warmup_steps=5)
    results = report["results"]
    # the runs warmed up over 5 steps (the config says 1): the first step's learning rate is below the peak 3e-3
    first = json.loads(next((tmp_path / "runs").glob("debug-dense-*/metrics.jsonl")).read_text().splitlines()[0])
    assert first["step"] == 1 and first["lr"] < 0.5 * 3e-3 and "--warmup_steps 5" in report["command"]
    assert set(results) == {"dense", "moe", "mod", "hybrid"}
    for arch, r in results.items():
        assert r["tokens"] == 8192 and r["training_flops"] >= report["equal_flops_budget"]
        assert r["loss_minus_floor"] == r["validation_loss"] - report["entropy_floor"]
        assert all(r["time_breakdown_s"][p] >= 0 for p in PHASES) and r["time_breakdown_s"]["train"] > 0
        assert sum(r["time_breakdown_s"].values()) == pytest.approx(r["wall_time_s"])
        assert 0.1 < r["peak_memory_gib"] < 8  # each run's own process: a real, separate high-water mark
        assert r["cost_usd"] == pytest.approx(r["wall_time_s"] / 3600 * 0.5)
        assert r["cost_per_1b_tokens_usd"] == pytest.approx(0.5 / (r["tokens_per_s"] * 3600) * 1e9)
        assert r["mfu"] is None and r["achieved_tflops"] > 0  # no GPU: achieved TFLOP/s instead of MFU
        assert (r["load_balance"] is not None) == (arch in ("moe", "hybrid"))
        assert (r["skip_rate"] is not None) == (arch in ("mod", "hybrid"))
    assert 0 < results["moe"]["load_balance"] <= 1 and results["moe"]["expert_utilisation"] > 0
    assert results["mod"]["skip_rate"] == pytest.approx(0.5) and results["mod"]["flops_reduction"] > 0.4
    assert results["mod"]["topk_routing_loss"] is not None and results["dense"]["topk_routing_loss"] is None
    for name in ("flops", "seconds", "tokens"):
        assert (tmp_path / "out" / f"grid_debug_loss_vs_{name}.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "grid_debug.json").read_text())["preset"] == "debug"
    text = markdown(report)
    assert "achieved TFLOP/s" in text and "$0.50/hour" in text and "| hybrid |" in text
    assert "no costs: pass `--price`" in markdown({**report, "price_per_hour": None})  # a device without a price
    rows = text.splitlines()
    assert any(row.startswith("| mod | - | - | - | 50.0% |") for row in rows)  # no experts; half the tokens skip
    assert any(row.startswith("| dense | - | - | - | - | - |") for row in rows)
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nearlier text\n")
    write_section(str(md), "debug", text)
    write_section(str(md), "debug", "second version")
    content = md.read_text()
    assert "earlier text" in content and content.count("<!-- grid:debug -->") == 1 and "second version" in content
    assert "load balance" not in content  # the first version was replaced, not kept


@pytest.mark.slow
def test_a_failed_run_names_the_architecture(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(GridError, match="the dense run failed .*broken.json"):
        run_grid("debug", 4096, str(tmp_path / "out"), str(broken), str(tmp_path / "runs"))


def test_the_command_refuses_a_missing_config_and_an_unknown_preset(tmp_path, capsys):
    from adaptive_ds.grid import main

    with pytest.raises(SystemExit, match="ds_config .*none.json' does not exist; pass a JSON file such as ds_configs/"):
        main(["--ds_config", str(tmp_path / "none.json")])
    half = tmp_path / "half.json"
    half.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
                                "bf16": {"enabled": True}}))
    with pytest.raises(SystemExit, match="fp16 and bf16 are both enabled"):
        main(["--ds_config", str(half)])
    with pytest.raises(SystemExit):
        main(["--preset", "debug", "b3"])
    assert "invalid choice: 'b3'" in capsys.readouterr().err
