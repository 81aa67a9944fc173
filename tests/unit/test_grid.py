"""The benchmark grid: variants x seeds, their statistics against hand-worked numbers, the tables and figures from
synthetic runs, its command's checks, and where a user's grid writes."""

import hashlib
import json
import math
import os
import re
import shlex

import pytest
from helpers.common import ROOT, snapshot

from adaptive_ds.presets import VARIANTS, ArchVariant, model_config
from adaptive_ds.tools.grid import _parse_args, assemble, main, write_section
from adaptive_ds.tools.grid_runs import budgets, run_row
from adaptive_ds.tools.grid_spec import GridSpec, parse_variant
from adaptive_ds.tools.grid_tables import PHASES, difference, markdown, plot, spread
from adaptive_ds.training.arguments import parse

TRAINED = {"commit": "abc1234", "machine": "test CPU", "date": "2026-11-30"}


def test_spread_difference_and_the_paired_t_test_against_hand_worked_numbers():
    s = spread([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["sd"] == pytest.approx(math.sqrt(5 / 3)) and (s["min"], s["max"], s["n"]) == (1, 4, 4)
    assert spread([2.0])["sd"] is None
    # paired by seed: differences -0.05, -0.06, -0.08 -> mean -0.063333, sd sqrt(4.6667e-4 / 2) = 0.015275,
    # se 0.015275 / sqrt(3) = 0.0088192, t = -7.1813 on 2 df: p = 1 - |t| / sqrt(2 + t^2) = 0.018844;
    # the 95% interval -0.063333 -+ 4.3027 x 0.0088192 (t table, 2 df) = [-0.10128, -0.025388]
    d = difference({1: 1.50, 2: 1.60, 3: 1.70}, {1: 1.55, 2: 1.66, 3: 1.78})
    assert d["paired"] and d["n"] == 3
    assert d["difference"] == pytest.approx(-0.0633333) and d["sd"] == pytest.approx(0.0152753, rel=1e-5)
    assert d["t"] == pytest.approx(-7.1813, abs=1e-4) and d["p"] == pytest.approx(0.018844, abs=1e-6)
    assert d["ci"] == pytest.approx([-0.10128, -0.025388], abs=1e-5)
    # no seed in common: 1.1 - 1.2, sd sqrt(0.141421^2 + 0.173205^2) = sqrt(0.02 + 0.03) = 0.223607, and no test
    u = difference({4: 1.0, 5: 1.2}, {1: 1.1, 2: 1.1, 3: 1.4})
    assert not u["paired"] and u["n"] == 2
    assert u["difference"] == pytest.approx(-0.1) and u["sd"] == pytest.approx(math.sqrt(0.05))
    assert u["p"] is None and u["ci"] is None
    # one seed in common is not a pairing; a side with one seed has no sd
    one = difference({1: 2.0, 4: 2.2}, {1: 2.5})
    assert not one["paired"] and one["difference"] == pytest.approx(-0.4) and one["sd"] is None and one["p"] is None


def _record(variant: str, seed: int, curve: list[tuple], validation: float, topk: float | None = None,
            floor: float | None = 1.5, routing: dict | None = None) -> dict:
    """A finished run as load_run reads it: summary, metrics, curve (FLOPs, loss, tokens, training seconds)."""
    phases = {"setup": 2.0, "data": 1.0, "train": 6.0, "checkpoint": 0.5, "eval": 0.4, "other": 0.1}
    summary = {"validation_loss": validation, "validation_loss_se": 0.01, "tokens_seen": curve[-1][2],
               "wall_time_s": 10.0, "time_breakdown_s": {**phases, "total": 10.0},
               "peak_memory": {"device": "cpu", "peak_rss_bytes": 2**30}, "total_parameters": 1000,
               "active_parameters": 600}
    if floor is not None:
        summary["entropy_floor"] = floor
    if topk is not None:
        summary.update(validation_loss_topk_routing=topk, validation_loss_topk_routing_se=0.02)
    metrics = [{"loss": c[1], "tokens_seen": c[2], "elapsed_s": c[3] + 2.0, **(routing or {})} for c in curve]
    return {"variant": variant, "seed": seed, "run_dir": f"runs/{variant}-{seed}", "kept": False, "trained": TRAINED,
            "summary": summary, "metrics": metrics, "curve": curve}


def _synthetic_grid(floor: float | None = 1.5) -> tuple[GridSpec, list[dict], list[dict]]:
    """dense on seeds 1-3, mod on 1-2 (its seed 3 failed), moe on seed 1 only."""
    spec = GridSpec("debug", tuple(map(parse_variant, ["dense", "mod", "moe"])), (1, 2, 3), 2000, "ds.json",
                    data="embedded:hard")
    mod_routing = {"mod": {"skip_rate": 0.5, "flops_reduction": 0.5}}
    moe_routing = {"moe": {"expert_utilisation": 1.0, "load_balance": 0.9, "dropped_fraction": 0.05}}
    finished = [_record("dense", s, [(1e12, 3.0 + d, 1000, 2.0), (2e12, 2.0 + d, 2000, 10.0)], 2.0 + d, floor=floor)
                for s, d in ((1, 0.0), (2, 0.1), (3, 0.2))]
    finished += [_record("mod", s, [(0.5e12, 2.8, 1000, 2.0), (1.5e12, 1.8, 2000, 4.0)], v, topk=t, floor=floor,
                         routing=mod_routing) for s, v, t in ((1, 1.95, 1.90), (2, 2.08, 1.96))]
    finished.append(_record("moe", 1, [(2e12, 2.9, 1000, 3.0), (4e12, 1.9, 2000, 12.0)], 2.05, floor=floor,
                            routing=moe_routing))
    failed = [{"variant": "mod", "seed": 3, "run_dir": "runs/mod-3", "exit": 1, "log": "runs/mod-3.log",
               "log_tail": "Traceback (most recent call last):\nRuntimeError: out of patience\n"}]
    return spec, finished, failed


def test_run_figures_are_read_at_the_smallest_budget_any_run_reached():
    _, finished, _ = _synthetic_grid()
    at = budgets(finished)
    assert at == {"flops": 1.5e12, "tokens": 2000, "seconds": 4.0}
    dense = run_row(finished[1], at, peak_tflops=100.0, price=0.5)  # seed 2: losses 3.1 -> 2.1
    assert dense["train_loss_at_equal_flops"] == pytest.approx(2.6)  # halfway from 1e12 to 2e12
    assert dense["train_loss_at_equal_tokens"] == pytest.approx(2.1)
    assert dense["train_loss_at_equal_seconds"] == pytest.approx(3.1 - 2 / 8)  # 4 s of 2..10 s
    assert dense["tokens_per_s"] == pytest.approx(2000 / 7)  # data + train phases
    assert dense["achieved_tflops"] == pytest.approx(2e12 / 7 / 1e12) and dense["mfu"] == pytest.approx(
        dense["achieved_tflops"] / 100)
    assert dense["cost_usd"] == pytest.approx(10 / 3600 * 0.5)
    assert dense["cost_per_1b_tokens_usd"] == pytest.approx(0.5 / (2000 / 7 * 3600) * 1e9)
    assert dense["loss_minus_floor"] == pytest.approx(0.6) and dense["topk_routing_loss"] is None
    assert dense["peak_memory_gib"] == 1.0 and set(dense["time_breakdown_s"]) == set(PHASES)
    mod = run_row(finished[3], at, peak_tflops=None, price=None)
    assert mod["skip_rate"] == 0.5 and mod["load_balance"] is None and mod["mfu"] is None and mod["cost_usd"] is None
    assert mod["topk_routing_loss_minus_floor"] == pytest.approx(0.4) and mod["topk_routing_loss_se"] == 0.02


def _table(text: str, first_header: str) -> dict[str, list[str]]:
    """{first cell: cells} of the Markdown table whose header starts with `first_header`."""
    block = re.search(rf"^\| {re.escape(first_header)} .*?(?=\n\n|\Z)", text, flags=re.M | re.S).group(0)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()]
    return {row[0]: row[1:] for row in [rows[0], *rows[2:]]}


def test_report_tables_and_figures_from_synthetic_runs(tmp_path):
    spec, finished, failed = _synthetic_grid()
    report = assemble(spec, finished, failed, gpu=None, peak_tflops=None, price=0.5)
    json.dumps(report)  # the JSON report holds plain data only
    assert report["entropy_floor"] == 1.5 and report["commit"] == "abc1234" and report["date"] == "2026-11-30"
    dense, mod = report["results"]["dense"], report["results"]["mod"]
    assert dense["validation_loss"]["mean"] == pytest.approx(2.1)
    assert dense["validation_loss"]["sd"] == pytest.approx(0.1)
    assert mod["validation_loss"]["n"] == 2 and mod["skip_rate"]["mean"] == 0.5 and dense["skip_rate"] is None
    assert report["results"]["moe"]["validation_loss"]["sd"] is None
    c = report["comparisons"]["mod"]
    # two seeds paired, so t on 1 df: p = 1 - 2 atan(|t|) / pi. The verdicts are the validation losses' alone, Holm
    # over the table's one test (moe has one seed): validation -0.05, -0.02 -> -0.035 +- 0.021213, t = -2.3333,
    # p = 0.25776, a tie
    assert c["validation_loss"]["paired"] and c["validation_loss"]["difference"] == pytest.approx(-0.035)
    assert c["validation_loss"]["sd"] == pytest.approx(0.0212132) and c["validation_loss"]["p"] == pytest.approx(
        0.25776, abs=1e-5)
    assert c["validation_loss"]["p_holm"] == pytest.approx(0.25776, abs=1e-5)
    assert c["validation_loss"]["verdict"] == "tie" and c["validation_loss"]["detectable"] > 0.035
    # top-k routing against dense's only validation loss: -0.10, -0.14 -> -0.12 +- 0.028284, t = -6, p = 0.10514
    assert c["topk_routing_loss"]["difference"] == pytest.approx(-0.12)
    assert c["topk_routing_loss"]["p"] == pytest.approx(0.10514, abs=1e-5)
    # equal FLOPs (1.5e12): mod 1.8, dense 2.5 and 2.6 -> -0.75 +- 0.070711, t = -15, p = 0.042379, below 5%: yet
    # descriptive, no verdict (train losses are not judged); its interval -0.75 -+ 12.706 x 0.05
    flops = c["train_loss_at_equal_flops"]
    assert flops["difference"] == pytest.approx(-0.75) and flops["p"] == pytest.approx(0.042379, abs=1e-6)
    assert "verdict" not in flops and "p_holm" not in flops
    assert flops["ci"] == pytest.approx([-1.38531, -0.11469], abs=1e-5)
    assert report["comparisons"]["moe"]["validation_loss"]["verdict"] is None  # one seed
    text = markdown(report)
    assert "`python -m adaptive_ds.tools.grid --preset debug --tokens 2000 --ds_config ds.json --data embedded:hard " \
           "--variants dense mod moe --seeds 1 2 3`" in text and "commit abc1234" in text and "test CPU" in text
    assert "entropy floor 1.5000" in text and "1.5e+12 training FLOPs, 2,000 tokens, 4.0 training seconds" in text
    quality = _table(text, "variant | params")
    assert quality["variant"][2:4] == ["its SE (per run)", "loss - floor"]
    assert quality["dense"][1:4] == ["2.1000 ± 0.1000", "0.0100", "0.6000 ± 0.1000"]
    assert quality["mod"][1] == "2.0150 ± 0.0919 (n=2)" and quality["mod"][5] == "1.8000 ± 0.0000 (n=2)"
    assert quality["moe"][1] == "2.0500 (n=1)" and quality["dense"][4] == "-"
    versus = _table(text, "variant | validation loss")
    assert versus["mod"] == ["-0.0350 ± 0.0212 [-0.2256, +0.1556] p=0.26 (Holm 0.26) tie, detectable 0.2450",
                             "-0.1200 ± 0.0283 [-0.3741, +0.1341]", "-0.7500 ± 0.0707 [-1.3853, -0.1147]",
                             "-0.2500 ± 0.0707 [-0.8853, +0.3853]", "-1.0000 ± 0.0707 [-1.6353, -0.3647]", "2 paired"]
    assert "Holm-adjusted over this table's 1 validation-loss test; 'better' / 'worse' only in the validation loss" \
        in text and "at the Holm-corrected level 0.05/1, with the observed sd: a rough, post-hoc figure" in text
    assert report["holm_family"] == {"sections": ["grid:debug:embedded-hard"], "tests": 1}
    assert versus["moe"][0] == "-0.0500 (one seed: no verdict)" and versus["moe"][-1] == "unpaired"
    # moe's first logged step already spent more than the equal-FLOPs budget: no figure rather than a clamped one
    assert quality["moe"][5] == "-" and versus["moe"][2] == "-" and quality["moe"][6] == "1.9000 (n=1)"
    cost = _table(text, "variant | tokens/s")
    assert cost["variant"][1] == "achieved TFLOP/s" and cost["dense"][-2:] == ["$0.0014", "$486.11"]
    routing = _table(text, "variant | expert utilisation")
    assert routing["moe"][:3] == ["100.0%", "0.900", "5.0%"] and routing["mod"][3:5] == ["50.0%", "50.0%"]
    assert routing["dense"][:5] == ["-"] * 5 and routing["dense"][6:] == ["2.0 s", "1.0 s", "6.0 s", "0.5 s", "0.4 s",
                                                                         "0.1 s"]
    assert "Failed: `mod` seed 3 (exit 1, log `runs/mod-3.log`" in text and "RuntimeError: out of patience" in text
    # data without an entropy floor: no floor column, and the header says so
    bare = markdown(assemble(*_synthetic_grid(floor=None), gpu=None, peak_tflops=None, price=None))
    assert "loss - floor" not in bare and "no known entropy floor" in bare and "no costs: pass `--price`" in bare
    curves = {}
    for r in finished:
        curves.setdefault(r["variant"], []).append(r["curve"])
    plot(curves, 1.5, str(tmp_path / "grid"))
    for name in ("flops", "seconds", "tokens"):
        assert (tmp_path / f"grid_loss_vs_{name}.png").stat().st_size > 10_000


def test_the_section_is_keyed_by_preset_and_data(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nearlier text\n")
    report = {"preset": "debug", "data": "embedded:hard", "data_name": "embedded-hard"}
    write_section(str(md), report, "first version")
    write_section(str(md), report, "second version")
    write_section(str(md), {**report, "data": "embedded", "data_name": "embedded"}, "plain corpus")
    content = md.read_text()
    assert "earlier text" in content and content.count("<!-- grid:debug:embedded-hard -->") == 1
    assert "second version" in content and "first version" not in content and "<!-- grid:debug:embedded -->" in content
    names = {data: GridSpec("debug", (), (1,), 1, "x", data=data).data_name
             for data in ("embedded", "embedded:hard", "/data/docstrings.json.gz", "prepared/docs/")}
    assert names == {"embedded": "embedded", "embedded:hard": "embedded-hard",
                     "/data/docstrings.json.gz": "docstrings", "prepared/docs/": "docs"}


def test_variants_are_named_or_a_name_with_json_overrides():
    assert parse_variant("moe") == parse_variant("moe") and parse_variant("mod").model == {}
    dropless = parse_variant('moe:dropless+{"router_aux_loss_coef": 0, "controller": {"spike_sigma": 3}}')
    assert dropless.arch == "moe" and dropless.model == {"moe_drop_tokens": False, "router_aux_loss_coef": 0}
    assert dropless.controller == {"spike_sigma": 3}
    with pytest.raises(ValueError, match=r"unknown variant 'moe:bogus'; valid: dense, moe, mod, hybrid, moe:dropless"):
        parse_variant("moe:bogus")
    with pytest.raises(ValueError, match=r"what follows '\+' is not JSON"):
        parse_variant("moe+{drop}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_variant("moe+[1]")


def test_the_grid_and_a_training_run_make_the_same_model_of_each_variant(tmp_path, tiny_ds_config):
    # presets.VARIANTS is the one table: a grid's variant (--arch and --model on the run's command line) and a
    # training run's --variant of the same name build the same model and controller settings, the entry's fields
    # over the architecture's defaults; every variant is a run the trainer accepts.
    config = tiny_ds_config()
    for name, entry in VARIANTS.items():
        spec = GridSpec("debug", (parse_variant(name),), (1,), 4096, config)
        grid, _ = parse(spec.training_args(spec.variants[0], 1) + ["--output_dir", str(tmp_path / name)], 1)
        run, _ = parse(["--ds_config", config, "--variant", name, "--output_dir", str(tmp_path / name)], 1)
        built = [model_config(s.preset, s.arch, 128, **s.model).to_dict() for s in (grid, run)]
        assert built[0] == built[1] and grid.controller == run.controller == entry.controller, name
        assert grid.arch == run.arch == entry.arch and entry.model.items() <= built[0].items(), name
        # a plain architecture name puts nothing on the command line: the run applies the defaults itself
        assert (grid.model == {}) == (name == entry.arch or not entry.model), name


@pytest.mark.parametrize(("name", "capacity", "interval"), [("mod", 0.125, 2), ("mod:paper", 0.125, 2),
                                                           ("mod:half", 0.5, 1), ("hybrid", 0.125, 2),
                                                           ("hybrid:paper", 0.125, 2), ("hybrid:half", 0.5, 1)])
def test_mod_variants_train_the_setting_they_name(tmp_path, name, capacity, interval, tiny_ds_config):
    # mod is the paper's setting (12.5% in every other block); mod:half the one mod had before
    spec = GridSpec("debug", (parse_variant(name),), (1,), 4096, tiny_ds_config())
    settings, _ = parse(spec.training_args(spec.variants[0], 1) + ["--output_dir", str(tmp_path / "run")], 1)
    config = model_config(settings.preset, settings.arch, 128, **settings.model)  # as the training run builds it
    assert (config.mod_capacity, config.mod_layer_interval) == (capacity, interval)


@pytest.mark.parametrize(("name", "top_k", "drop", "capacity"), [
    ("hybrid", 1, False, 0.125), ("hybrid:top1", 1, True, 0.125), ("hybrid:paper", 2, True, 0.125),
    ("hybrid:half", 2, True, 0.5), ("hybrid:dropless", 2, False, 0.5), ("moe", 2, True, None),
    ("moe:fine1-dropless", 4, False, None)])
def test_moe_variants_train_the_routing_they_name(tmp_path, name, top_k, drop, capacity, tiny_ds_config):
    # what each hybrid variant trained in the grid that named it, whatever the hybrid's defaults are now
    spec = GridSpec("debug", (parse_variant(name),), (1,), 4096, tiny_ds_config())
    settings, _ = parse(spec.training_args(spec.variants[0], 1) + ["--output_dir", str(tmp_path / "run")], 1)
    config = model_config(settings.preset, settings.arch, 128, **settings.model)
    assert (config.num_experts_per_tok * config.moe_expert_granularity, config.moe_drop_tokens) == (top_k, drop)
    if capacity is not None:
        assert config.mod_capacity == capacity


def test_a_change_of_an_architectures_defaults_trains_its_runs_anew(monkeypatch, tiny_ds_config):
    config = tiny_ds_config()
    names = ("dense", "mod", "mod:half", "hybrid")
    spec = GridSpec("debug", tuple(map(parse_variant, names)), (1,), 4096, config)
    before = {v.name: spec.run_dir("runs", v, 1) for v in spec.variants}
    monkeypatch.setitem(VARIANTS, "mod", ArchVariant("mod", {"mod_capacity": 0.25, "mod_layer_interval": 2}))
    after = {v.name: spec.run_dir("runs", v, 1) for v in spec.variants}
    # mod's runs are trained anew; mod:half overrides every default it could take, dense and hybrid are untouched
    assert [after[n] == before[n] for n in names] == [True, False, True, True]
    # an architecture without defaults keeps the key of before they existed (command line + ds_config text), so
    # its finished runs are still kept
    with open(config, "rb") as f:
        old_key = json.dumps(spec.training_args(spec.variants[0], 1)).encode() + f.read()
    assert before["dense"].endswith("-" + hashlib.sha256(old_key).hexdigest()[:10])


def test_the_command_refuses_bad_variants_seeds_configs_and_presets(tmp_path, capsys, tiny_ds_config):
    config = tiny_ds_config()
    with pytest.raises(SystemExit, match=r"unknown variant 'moe:bogus'; valid: dense, moe, mod, hybrid, moe:dropless"):
        main(["--ds_config", config, "--variants", "dense", "moe:bogus"])
    with pytest.raises(SystemExit, match=r"variant dense\+\{\"no_such_field\": 1\}: unknown model field\(s\) "
                                         r"no_such_field; valid: "):
        main(["--ds_config", config, "--variants", 'dense+{"no_such_field": 1}'])
    with pytest.raises(SystemExit, match=r"variant mod: .*data path '/nowhere/x.jsonl' does not exist"):
        main(["--ds_config", config, "--variants", "mod", "--data", "/nowhere/x.jsonl"])
    with pytest.raises(SystemExit, match=r"seed\(s\) 2 given twice"):
        main(["--ds_config", config, "--seeds", "1", "2", "2"])
    with pytest.raises(SystemExit, match="ds_config .*none.json' does not exist; pass a JSON file, or the name of a "
                                         "shipped config: b1_a100.json, "):
        main(["--ds_config", str(tmp_path / "none.json")])
    half = tmp_path / "half.json"
    half.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
                                "bf16": {"enabled": True}}))
    with pytest.raises(SystemExit, match="fp16 and bf16 are both enabled"):
        main(["--ds_config", str(half)])
    with pytest.raises(SystemExit):
        main(["--preset", "debug", "b3"])
    assert "invalid choice: 'b3'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_a_section_is_written_into_a_new_file_and_replaced_in_place_later(tmp_path):
    from adaptive_ds.markdown_sections import replace_section

    path = tmp_path / "new" / "B.md"
    path.parent.mkdir()
    replace_section(str(path), "grid:x", "first", "Grid x")  # no file yet: after hours of runs, never a crash
    assert path.read_text() == "# Benchmarks\n\n## Grid x\n\n<!-- grid:x -->\nfirst\n<!-- /grid:x -->\n"
    path.write_text(path.read_text() + "\nhand-written notes\n")
    replace_section(str(path), "grid:x", "second", "Grid x")
    assert path.read_text() == ("# Benchmarks\n\n## Grid x\n\n<!-- grid:x -->\nsecond\n<!-- /grid:x -->\n"
                                "\nhand-written notes\n")


def test_restate_works_a_reports_verdicts_out_anew_from_its_runs(tmp_path, capsys):
    """A report written under an earlier verdict rule (a difference and its sd, 'better' beyond two sd) gets this
    version's tests from its recorded runs, and its section follows; nothing else in it changes."""
    spec, finished, failed = _synthetic_grid()
    report = assemble(spec, finished, failed, gpu=None, peak_tflops=None, price=0.5)
    old = json.loads(json.dumps(report))
    for cell in old["comparisons"]["mod"].values():
        for key in ("t", "p", "ci", "p_holm", "detectable"):
            cell.pop(key, None)
        cell["verdict"] = "better"
    path, md = tmp_path / "grid_debug_embedded-hard.json", tmp_path / "B.md"
    path.write_text(json.dumps(old))
    main(["--restate", str(path), "--benchmarks_md", str(md)])
    restated = json.loads(path.read_text())
    assert restated == json.loads(json.dumps(report))
    assert "[-0.2256, +0.1556] p=0.26 (Holm 0.26) tie, detectable 0.2450" in md.read_text()
    assert "<!-- grid:debug:embedded-hard -->" in md.read_text()
    (tmp_path / "bad.json").write_text('{"runs": []}')
    with pytest.raises(SystemExit, match=r"error: --restate .*bad.json: not a grid report"):
        main(["--restate", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit, match="its folder does not exist"):
        main(["--restate", str(path), "--benchmarks_md", str(tmp_path / "no" / "B.md")])
    assert json.loads(path.read_text()) == restated  # a refused command leaves the report as it was


def test_a_variant_may_carry_its_own_token_budget_for_an_iso_flop_baseline():
    variant = parse_variant('dense+{"tokens": 280122}')
    assert variant.arch == "dense" and variant.tokens == 280122 and variant.model == {}
    spec = GridSpec("debug", (variant, parse_variant("mod:paper")), (1,), 500_000, "ds_configs/debug_cpu.json")
    args = spec.training_args(variant, 1)
    assert args[args.index("--tokens") + 1] == "280122"
    other = spec.training_args(spec.variants[1], 1)
    assert other[other.index("--tokens") + 1] == "500000"
    with pytest.raises(ValueError, match="'tokens' must be a positive integer, got 0.5"):
        parse_variant('dense+{"tokens": 0.5}')
    # its own warm-up too (a from-scratch arm at the shipped warm-up beside short continuations), over the grid's
    own = parse_variant('dense+{"tokens": 280122, "warmup_steps": 30}')
    short = GridSpec("debug", (own, variant), (1,), 500_000, "ds_configs/debug_cpu.json", warmup_steps=6)
    assert own.model == {} and parse(short.training_args(own, 1), world_size=1)[0].warmup_steps == 30
    assert parse(short.training_args(variant, 1), world_size=1)[0].warmup_steps == 6
    with pytest.raises(ValueError, match="'warmup_steps' must be a whole number of steps, got -1"):
        parse_variant('dense+{"warmup_steps": -1}')


def _finished_run(run_dir: str, arch: str, seed: int) -> None:
    """A finished run's files as the trainer leaves them (summary.json, metrics.jsonl, final/config.json), so that
    the grid keeps it instead of training it."""
    config = model_config("debug", arch, 128)
    config.save_pretrained(os.path.join(run_dir, "final"))
    phases = {"setup": 2.0, "data": 1.0, "train": 6.0, "checkpoint": 0.5, "eval": 0.4, "other": 0.1}
    summary = {"seq_len": 256, "validation_loss": 2.0 + seed / 100, "validation_loss_se": 0.01, "tokens_seen": 4096,
               "wall_time_s": 10.0, "time_breakdown_s": {**phases, "total": 10.0}, "entropy_floor": 1.4,
               "peak_memory": {"device": "cpu", "peak_rss_bytes": 2**30}, "total_parameters": 1000,
               "active_parameters": 600}
    routing = {"mod": {"skip_rate": 0.875, "flops_reduction": 0.44}} if arch == "mod" else {}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step, loss in ((1, 3.0), (2, 2.5)):
            f.write(json.dumps({"step": step, "loss": loss, "tokens_seen": 2048 * step, "elapsed_s": 2.0 + 3 * step,
                                **routing}) + "\n")


def test_a_users_grid_leaves_the_published_results_alone_unless_told(tmp_path, monkeypatch, tiny_ds_config):
    """A user's own grid (from the repository's root, as README shows it) writes its JSON and figures under its
    runs directory and leaves BENCHMARKS.md and the committed benchmarks/ byte for byte; --benchmarks_md and --out
    publish, under a section key and file names of its own (--name), recorded in the section's command."""
    from adaptive_ds.tools.grid import _parse_args, specs

    monkeypatch.chdir(tmp_path)
    published = "grid_debug_embedded-hard.json"
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / published).write_bytes((ROOT / "benchmarks" / published).read_bytes())
    (tmp_path / "BENCHMARKS.md").write_bytes((ROOT / "BENCHMARKS.md").read_bytes())
    before_md, before_results = (tmp_path / "BENCHMARKS.md").read_bytes(), snapshot(tmp_path / "benchmarks")
    assert "<!-- grid:debug:embedded-hard -->" in before_md.decode()
    config = os.path.relpath(tiny_ds_config(), tmp_path)
    argv = ["--preset", "debug", "--data", "embedded:hard", "--variants", "mod", "dense", "--seeds", "7",
            "--tokens", "4096", "--ds_config", config]
    (spec,) = specs(_parse_args(argv))
    for variant in spec.variants:  # finished runs, kept by the grid: nothing trains
        _finished_run(spec.run_dir("runs/grid", variant, 7), variant.arch, 7)
    main(argv)
    assert (tmp_path / "BENCHMARKS.md").read_bytes() == before_md
    assert snapshot(tmp_path / "benchmarks") == before_results
    report = json.loads((tmp_path / "runs" / "grid" / "report" / "grid_debug_embedded-hard.json").read_text())
    assert [r["variant"] for r in report["runs"]] == ["mod", "dense"]
    # run directories relative to --runs: the report names no path of the machine that made it
    assert report["runs"][0]["run_dir"] == os.path.basename(spec.run_dir("runs/grid", spec.variants[0], 7))
    assert str(tmp_path) not in json.dumps(report)
    for name in ("flops", "seconds", "tokens"):
        assert (tmp_path / "runs" / "grid" / "report" / f"grid_debug_embedded-hard_loss_vs_{name}.png").exists()

    main([*argv, "--name", "mine", "--out", "benchmarks", "--benchmarks_md", "BENCHMARKS.md"])
    text = (tmp_path / "BENCHMARKS.md").read_text()
    published_report = json.loads((tmp_path / "benchmarks" / "grid_debug_embedded-hard_mine.json").read_text())
    section = re.search(r"<!-- grid:debug:embedded-hard:mine -->\n(.*)\n<!-- /grid:debug:embedded-hard:mine -->",
                        text, flags=re.S).group(1)
    assert section == markdown(published_report) and "--seeds 7 --name mine`" in section
    # nothing else moved: the published section and its JSON are those of before
    assert text.replace(re.search(r"\n\n## [^\n]*\n\n<!-- grid:debug:embedded-hard:mine -->.*", text,
                                  flags=re.S).group(0), "") == before_md.decode().rstrip("\n")
    assert (tmp_path / "benchmarks" / published).read_bytes() == before_results[published]
    with pytest.raises(SystemExit, match=r"--name 'Mine 2' .*lower-case letters, digits and '-'"):
        main([*argv, "--name", "Mine 2"])


def test_a_run_that_validated_off_the_logging_cadence_is_read_by_its_logged_steps(tmp_path):
    """eval_steps need not fall on log_steps: a step that only validated has a record without a train loss, and the
    run's loss curve is its logged steps."""
    from adaptive_ds.tools.grid_runs import load_run

    run_dir = str(tmp_path / "run")
    _finished_run(run_dir, "dense", 1)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    validated = {"step": 1, "tokens_seen": 2048, "elapsed_s": 4.0, "validation_loss": 2.9, "validation_loss_se": 0.1}
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for record in (validated, {**logged[1], "step": 2}):
            f.write(json.dumps(record) + "\n")
    run = load_run(run_dir)
    assert [c[1:3] for c in run["curve"]] == [(2.5, 4096)]  # one logged step: its loss at its tokens
    assert run["curve"][0][0] > 0 and [m["step"] for m in run["metrics"]] == [2]


# Recorded runs that today's grid names differently, because their command line has changed since they trained: the
# architecture's shipped MoD setting or the hybrid's MoE routing moved (a run key holds the defaults its overrides
# leave standing), or the variant was made to name every field those defaults moved through. The same command trains
# them anew, as it should: their directories are history. The text-prepared reports record the corpus where the
# README prepares it (data/text_prepared), not the directory their runs read, and --data is part of every run's key.
_RETRAINED = {
    "grid_debug_embedded-hard.json": {"mod", "mod:predictor", "hybrid", "hybrid:dropless"},
    "grid_debug_embedded-hard_active-flops.json": {"hybrid:paper", "hybrid:top1"},
    "grid_debug_embedded-hard_active-flops-vs-iso-dense.json": {"hybrid:top1"},
}
_DATA_MOVED = ("grid_debug_text-prepared.json", "grid_debug_text-prepared_new-defaults.json",
               "grid_debug_text-prepared_new-defaults-vs-iso-dense.json")


@pytest.mark.parametrize("report", sorted(p.name for p in (ROOT / "benchmarks").glob("grid_*.json")))
def test_a_published_grids_command_names_its_recorded_run_directories(report, monkeypatch):
    # `grid --report_only` with a report's recorded command finds its runs only if today's run_dir() names them as
    # the grid that trained them did: rebuilt here from the command (the grid's own parser; --name is not part of a
    # run's key, and the data need not exist), every recorded run directory, relative to --runs.
    monkeypatch.chdir(ROOT)  # the recorded ds_config path is relative to the repository
    recorded = json.loads((ROOT / "benchmarks" / report).read_text())
    args = _parse_args(shlex.split(recorded["command"])[3:])
    assert recorded["name"] == args.name and recorded["data"] == args.data and args.preset == [recorded["preset"]]
    variants = {text: parse_variant(text) for text in args.variants}
    spec = GridSpec(args.preset[0], tuple(variants.values()), tuple(args.seeds), args.tokens, args.ds_config,
                    args.data, args.tokenizer, args.warmup_steps, args.baseline, args.eval_batches, args.name,
                    log_steps=args.log_steps)

    def named(run_dir: str) -> str:
        # a continuation's directory is keyed by its base weights' content too, which is not committed: its name
        # up to the digest is checked (the digest of a run from random weights is not keyed by them: all of it)
        return run_dir.rsplit("-", 1)[0] if args.init_from else run_dir

    differ = {run["variant"] for run in recorded["runs"]
              if named(os.path.basename(spec.run_dir("runs", variants[run["variant"]], run["seed"])))
              != named(run["run_dir"])}
    if args.init_from:  # the from-scratch arms' whole names, digest included: they are those of a plain grid
        assert all(os.path.basename(spec.run_dir("runs", variants[run["variant"]], run["seed"])) == run["run_dir"]
                   for run in recorded["runs"] if variants[run["variant"]].scratch)
    retrained = _RETRAINED.get(report, set())
    assert differ == (set(variants) if report in _DATA_MOVED else retrained)
    for name in set(variants) - retrained:  # each name still means what the report records it trained
        v = variants[name]
        assert recorded["variants"][name] == {"arch": v.arch, "model": v.model, "controller": v.controller}, name


def test_a_continuation_grid_compares_each_continuation_with_its_from_scratch_pair():
    """A continuation grid's from-scratch arm ("init_from": null) trains from random weights: no --init_from, the
    same training command as that variant's in a grid without --init_from; it neither sets the budgets the
    continuations' train losses are read at nor is read at them (nor is a variant with a budget of its own); and
    --pair compares it with a continuation, paired by seed, against hand-worked numbers."""
    template = "runs/base/debug-embedded-hard-dense-seed1{seed}-*/final"
    scratch = parse_variant('moe+{"init_from": null}')
    assert scratch.scratch and scratch.arch == "moe" and scratch.model == {} and scratch.tokens is None
    with pytest.raises(ValueError, match="'init_from' may only be null"):
        parse_variant('moe+{"init_from": "other/final"}')
    continued, cheaper = parse_variant("moe"), parse_variant('moe+{"tokens": 1000}')
    spec = GridSpec("debug", (parse_variant("dense"), continued, cheaper, scratch), (1, 2), 2000,
                    "ds_configs/debug_cpu.json", data="embedded:hard", init_from=template,
                    pairs=(("moe", scratch.name), (cheaper.name, "hybrid")))
    assert "--init_from" not in spec.training_args(scratch, 1)
    plain = GridSpec("debug", (scratch,), (1, 2), 2000, "ds_configs/debug_cpu.json", data="embedded:hard")
    assert spec.training_args(scratch, 1) == plain.training_args(scratch, 1)
    assert f"--pair moe {shlex.quote(scratch.name)}" in spec.command()
    # a short continuation's curve needs more points than the ds_config's cadence: --log_steps reaches every run
    logged = GridSpec("debug", (continued,), (1,), 2000, "ds_configs/debug_cpu.json", log_steps=2)
    args = _parse_args(["--log_steps", "2"])
    assert args.log_steps == 2 and "--log_steps 2" in logged.command()
    assert parse(logged.training_args(continued, 1), world_size=1)[0].log_steps == 2
    # continuations: dense 2.0 / 2.1, moe 1.9 / 2.05 (validation); moe from scratch 2.3 / 2.35, its curve from 9.0
    # and ending before the continuations' (were it read, the budgets would be its own: 1.8e12 FLOPs, 1,800 tokens)
    finished = [_record("dense", s, [(1e12, 2.5, 1000, 2.0), (2e12, 2.2, 2000, 4.0)], v)
                for s, v in ((1, 2.0), (2, 2.1))]
    finished += [_record("moe", s, [(1.5e12, 2.4, 1000, 2.0), (3e12, 2.1, 2000, 4.0)], v)
                 for s, v in ((1, 1.9), (2, 2.05))]
    finished += [_record(cheaper.name, s, [(0.5e12, 2.6, 500, 1.0), (1.5e12, 2.3, 1000, 2.0)], 2.2) for s in (1, 2)]
    finished += [_record(scratch.name, s, [(0.5e12, 9.0, 500, 1.0), (1.8e12, 2.6, 1800, 3.0)], v)
                 for s, v in ((1, 2.3), (2, 2.35))]
    report = assemble(spec, finished, [], gpu=None, peak_tflops=None, price=None)
    assert report["budgets"] == {"flops": 2e12, "tokens": 2000, "seconds": 4.0}  # the continuations' alone
    for row in [r for r in report["runs"] if r["variant"] in (scratch.name, cheaper.name)]:
        assert [row[f"train_loss_at_equal_{b}"] for b in ("flops", "tokens", "seconds")] == [None] * 3
    pair, missing = report["pairs"]
    # moe - scratch: -0.40, -0.30 -> -0.35 +- 0.070711, t = -7 on 1 df, p = 1 - 2 atan(7) / pi = 0.090334. One
    # family with the comparisons against dense (validation losses only; the top-k routing loss is descriptive):
    # moe -0.1, -0.05 (t = -3, p = 0.204833), the cheaper moe +0.2, +0.1 (t = 3, p = 0.204833), the scratch arm
    # +0.3, +0.25 (t = 11, p = 0.057716). Holm over the 4: 4 x 0.057716 = 0.230864, 3 x 0.090334 = 0.271003: a tie
    assert pair["variant"] == "moe" and pair["baseline"] == scratch.name
    assert pair["validation_loss"]["difference"] == pytest.approx(-0.35)
    assert pair["validation_loss"]["sd"] == pytest.approx(0.0707107)
    assert pair["validation_loss"]["p"] == pytest.approx(0.090334, abs=1e-6)
    assert pair["validation_loss"]["p_holm"] == pytest.approx(0.271003, abs=1e-6)
    assert report["comparisons"][scratch.name]["validation_loss"]["p_holm"] == pytest.approx(0.230864, abs=1e-6)
    assert pair["validation_loss"]["verdict"] == "tie" and report["holm_family"]["tests"] == 4
    assert pair["train_loss_at_equal_flops"] is None  # the scratch arm has no figure at the continuations' budget
    assert missing == {"variant": cheaper.name, "baseline": "hybrid", "missing": ["hybrid"]}
    # every variant with a budget of its own: the budgets are theirs, and the from-scratch arm is still read at none
    theirs = [r for r in finished if r["variant"] in (cheaper.name, scratch.name)]
    alone = assemble(GridSpec("debug", (cheaper, scratch), (1, 2), 2000, "ds_configs/debug_cpu.json",
                              init_from=template), theirs, [], gpu=None, peak_tflops=None, price=None)
    assert alone["budgets"] == {"flops": 1.5e12, "tokens": 1000, "seconds": 2.0}
    assert all(r["train_loss_at_equal_flops"] == (2.3 if r["variant"] == cheaper.name else None)
               for r in alone["runs"])
    text = markdown(report)
    assert "A continuation grid: each run starts from `runs/base/" in text
    pairs = _table(text, "variant | baseline")
    cell = "-0.3500 ± 0.0707 [-0.9853, +0.2853]"
    assert pairs["moe"] == [scratch.name, cell + " p=0.09 (Holm 0.27) tie, detectable 3.2637", cell, "-", "-", "-",
                            "2 paired"]
    assert ("Each against its pair (variant - baseline, as above; Holm over 4 validation-loss tests: this table's 1 "
            "and the comparison table's 3)") in text
    assert "Holm-adjusted over 4 validation-loss tests: this table's 3 and the pairs table's 1;" in text
    assert pairs[cheaper.name][-1] == "no finished run of `hybrid`"


def test_the_command_refuses_a_pair_outside_the_variants_and_a_scratch_arm_without_init_from(tiny_ds_config):
    config = tiny_ds_config()
    with pytest.raises(SystemExit, match=r"--pair moe mod: 'mod' not among --variants \(dense, moe\)"):
        main(["--ds_config", config, "--variants", "dense", "moe", "--pair", "moe", "mod"])
    with pytest.raises(SystemExit, match=r"--pair moe moe compares a variant with itself"):
        main(["--ds_config", config, "--variants", "dense", "moe", "--pair", "moe", "moe"])
    with pytest.raises(SystemExit, match=r"--pair moe dense is given twice"):
        main(["--ds_config", config, "--variants", "dense", "moe", "--pair", "moe", "dense", "--pair", "moe", "dense"])
    with pytest.raises(SystemExit, match=r"\"init_from\": null needs --init_from"):
        main(["--ds_config", config, "--variants", "dense", 'moe+{"init_from": null}'])
