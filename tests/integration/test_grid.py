"""One real grid of one tiny run: reported, and kept untouched by a second invocation."""

import json
import os
import shlex

import pytest
from transformers import AutoModelForCausalLM

from adaptive_ds.tools.grid import main, run_grid
from adaptive_ds.tools.grid_spec import GridSpec, parse_variant
from adaptive_ds.tools.grid_tables import markdown


def _files(directory) -> dict[str, tuple[int, int]]:
    return {os.path.relpath(os.path.join(d, f), directory): (os.stat(os.path.join(d, f)).st_mtime_ns,
                                                             os.path.getsize(os.path.join(d, f)))
            for d, _, names in os.walk(directory) for f in names}


def _first_grid(tmp_path, config: str) -> tuple[dict, str]:
    """One real run of mod, seed 1, through the command, published into a Markdown file: checked against the model it
    trained; returns the report and the run's directory."""
    out, runs, md = str(tmp_path / "out"), str(tmp_path / "runs"), tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    main(["--variants", "mod", "--seeds", "1", "--tokens", "4096", "--ds_config", config, "--warmup_steps", "5",
          "--price", "0.5", "--out", out, "--runs", runs, "--benchmarks_md", str(md)])
    report = json.loads((tmp_path / "out" / "grid_debug_embedded.json").read_text())
    (row,) = report["runs"]
    run_dir = os.path.join(runs, row["run_dir"])  # recorded relative to --runs
    total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final"))
                .parameters())  # counted on the trained model itself
    assert "<!-- grid:debug:embedded -->" in md.read_text() and f"\n| mod | {total:,} / " in md.read_text()
    first = json.loads(open(os.path.join(run_dir, "metrics.jsonl")).readline())
    # the run warmed up over 5 steps (the config says 1): the first step's learning rate is below the peak 3e-3
    assert first["step"] == 1 and first["lr"] < 0.5 * 3e-3 and "--warmup_steps 5" in report["command"]
    assert row["tokens"] == 4096 and not row["kept"] and row["validation_loss_se"] > 0
    # mod is the paper's setting: 32 of 256 tokens run each routed block
    assert row["skip_rate"] == pytest.approx(0.875) and row["flops_reduction"] > 0.4 and row["load_balance"] is None
    assert row["topk_routing_loss"] is not None and row["loss_minus_floor"] > 0 and report["entropy_floor"] > 1
    assert sum(row["time_breakdown_s"].values()) == pytest.approx(row["wall_time_s"])
    assert 0.1 < row["peak_memory_gib"] < 8 and row["mfu"] is None and row["achieved_tflops"] > 0
    assert report["commit"] != "unknown" and report["runs_without_provenance"] == 0
    assert report["comparisons"] == {}  # no dense in this grid
    assert 2 <= len(row["curve"]) <= 50 and row["curve"][-1][2] == 4096  # its loss curve, to the last step
    for name in ("flops", "seconds", "tokens"):
        assert (tmp_path / "out" / f"grid_debug_embedded_loss_vs_{name}.png").stat().st_size > 10_000
    return report, run_dir


def _kept_and_failed(tmp_path, config: str, run_dir: str, row: dict) -> None:
    """The same grid again, with a variant the trainer refuses, whose earlier attempt left a partial directory
    (through run_grid: the command would refuse this variant before training anything); then --report_only."""
    out, runs = str(tmp_path / "out"), str(tmp_path / "runs")
    before = _files(run_dir)
    broken = parse_variant('dense+{"no_such_field": 1}')
    spec = GridSpec("debug", (parse_variant("mod"), broken), (1,), 4096, config, warmup_steps=5)
    partial = spec.run_dir(runs, broken, 1)
    os.makedirs(partial)
    open(os.path.join(partial, "metrics.jsonl"), "w").close()
    again = run_grid(spec, out, runs)
    assert _files(run_dir) == before and again["runs"][0]["kept"]  # not retrained, not rewritten
    assert again["runs"][0]["validation_loss"] == row["validation_loss"]
    (failure,) = again["failed"]
    assert failure["variant"] == broken.name and failure["exit"] != 0
    assert "unknown model field(s) no_such_field" in failure["log_tail"]
    assert os.path.exists(os.path.join(f"{partial}.failed", "metrics.jsonl"))  # the earlier attempt, set aside
    assert "unknown model field(s) no_such_field" in markdown(again)
    # --report_only: the finished run is reported, the unfinished one neither trained nor set aside again
    cut = run_grid(GridSpec("debug", (parse_variant("mod"), parse_variant("dense")), (1,), 4096, config,
                            warmup_steps=5), out, runs, report_only=True)
    assert [r["variant"] for r in cut["runs"]] == ["mod"] and cut["not_run"] == [{"variant": "dense", "seed": 1}]
    assert not os.path.exists(spec.run_dir(runs, parse_variant("dense"), 1)) and cut["failed"] == []
    assert "Not run (reported with `--report_only`, the grid cut short): `dense` seed 1." in markdown(cut)


def _extended(tmp_path, config: str, report: dict) -> None:
    """--extend: seed 2 added to the published one-seed report, whose run directory is gone (moved away)."""
    out, runs = str(tmp_path / "out"), str(tmp_path / "runs")
    published = tmp_path / "out" / "grid_debug_embedded.json"
    published.write_text(json.dumps(report))
    os.rename(runs, str(tmp_path / "elsewhere"))
    common = ["--variants", "mod", "--tokens", "4096", "--ds_config", config, "--warmup_steps", "5", "--price",
              "0.5", "--out", out, "--runs", runs, "--extend", str(published)]
    with pytest.raises(SystemExit, match=r"--extend .*grid_debug_embedded.json: --seeds leaves out its seeds 1"):
        main([*common, "--seeds", "2"])
    with pytest.raises(SystemExit, match=r"--extend .*: it is another grid: its tokens differ"):
        main([*common[:2], "--tokens", "8192", *common[4:], "--seeds", "1", "2"])
    with pytest.raises(SystemExit, match=r"--extend .*: it was measured on another device: its price_per_hour 0.5 "):
        main([*common[:9], "0.7", *common[10:], "--seeds", "1", "2"])
    figure = tmp_path / "out" / "grid_debug_embedded_loss_vs_flops.png"
    figure.unlink()
    main([*common, "--seeds", "1", "2"])
    extended = json.loads(published.read_text())
    assert [(r["variant"], r["seed"]) for r in extended["runs"]] == [("mod", 1), ("mod", 2)]
    assert extended["runs"][0] == report["runs"][0] and extended["budgets"] == report["budgets"]
    assert extended["seeds"] == [1, 2] and "--seeds 1 2" in extended["command"]
    assert extended["results"]["mod"]["validation_loss"]["n"] == 2
    assert not os.path.exists(os.path.join(runs, report["runs"][0]["run_dir"]))  # seed 1 was not trained again
    # drawn again, seed 1's curve from the report's row beside seed 2's run
    assert extended["figure_seeds"] == [1, 2] and figure.stat().st_size > 10_000


@pytest.mark.slow  # one real training run, then a second invocation that keeps it and reports a failing run
def test_a_real_grid_run_is_reported_and_kept_by_the_next_invocation(tmp_path, tiny_ds_config):
    # a config that names C4 (as the GPU configs do): the grid trains on its own --data (the embedded corpus)
    config = tiny_ds_config(micro=8, data="allenai/c4", tokenizer="bpe:32000", log_steps=1)
    report, run_dir = _first_grid(tmp_path, config)
    _kept_and_failed(tmp_path, config, run_dir, report["runs"][0])
    _extended(tmp_path, config, report)


@pytest.mark.slow  # three tiny training runs: a base run, then its continuation as dense and as upcycled MoE
def test_a_continuation_grid_starts_every_run_from_its_seeds_base_and_counts_the_base_flops(tmp_path,
                                                                                            tiny_ds_config):
    config = tiny_ds_config(micro=8, log_steps=1)
    runs, out = str(tmp_path / "runs"), str(tmp_path / "out")
    base = run_grid(GridSpec("debug", (parse_variant("dense"),), (1,), 4096, config, warmup_steps=1,
                             name="base"), out, os.path.join(runs, "base"))
    template = os.path.join(runs, "base", "debug-embedded-dense-seed{seed}-*", "final")
    scratch = 'dense+{"init_from": null}'
    main(["--variants", "dense", "moe", scratch, "--seeds", "1", "--tokens", "4096", "--ds_config", config,
          "--warmup_steps", "1", "--out", out, "--runs", runs, "--name", "continued", "--init_from", template,
          "--pair", "dense", scratch])
    report = json.loads((tmp_path / "out" / "grid_debug_embedded_continued.json").read_text())
    assert report["init_from"] == template and f"--init_from {shlex.quote(template)}" in report["command"]
    base_flops = base["runs"][0]["training_flops"]
    (fresh,) = [row for row in report["runs"] if row["variant"] == scratch]  # from random weights: no base
    assert "base_model" not in json.loads(open(os.path.join(runs, fresh["run_dir"], "summary.json")).read())
    assert fresh["base_training_flops"] is None and fresh["validation_loss"] > report["runs"][0]["validation_loss"]
    (pair,) = report["pairs"]
    assert pair["validation_loss"]["difference"] == pytest.approx(
        report["runs"][0]["validation_loss"] - fresh["validation_loss"])
    for row in [r for r in report["runs"] if r["variant"] != scratch]:
        summary = json.loads(open(os.path.join(runs, row["run_dir"], "summary.json")).read())
        assert summary["base_model"].endswith("final") and summary["steps"] == 2  # this run's steps only
        assert row["base_training_flops"] == base_flops
        assert row["total_training_flops"] == pytest.approx(row["training_flops"] + base_flops)
    # the same variant from random weights is another run (the source's content is part of its directory's name)
    spec = GridSpec("debug", (parse_variant("dense"),), (1,), 4096, config, warmup_steps=1)
    continued = GridSpec("debug", (parse_variant("dense"),), (1,), 4096, config, warmup_steps=1, init_from=template)
    assert spec.run_dir(runs, parse_variant("dense"), 1) != continued.run_dir(runs, parse_variant("dense"), 1)
