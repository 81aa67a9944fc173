"""The quality grid writes its JSON, figures and its own section of a BENCHMARKS.md."""

import json

from conftest import DEBUG_CPU

from adaptive_ds.grid import markdown, run_grid, write_section


def test_grid_reports_every_architecture_and_rewrites_its_section(tmp_path):
    report = run_grid("debug", 8192, str(tmp_path / "out"), DEBUG_CPU, str(tmp_path / "runs"))
    assert set(report["results"]) == {"dense", "moe", "mod", "hybrid"}
    for r in report["results"].values():
        assert r["tokens"] == 8192 and r["training_flops"] >= report["equal_flops_budget"]
        assert r["loss_minus_floor"] == r["validation_loss"] - report["entropy_floor"]
    assert (tmp_path / "out" / "grid_debug.json").exists()
    assert (tmp_path / "out" / "grid_debug_loss_vs_flops.png").stat().st_size > 10_000
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nearlier text\n")
    write_section(str(md), "debug", markdown(report))
    write_section(str(md), "debug", "second version")
    text = md.read_text()
    assert "earlier text" in text and text.count("<!-- grid:debug -->") == 1 and "second version" in text
    assert json.loads((tmp_path / "out" / "grid_debug.json").read_text())["preset"] == "debug"
