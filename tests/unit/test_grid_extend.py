"""--extend: an earlier report's rows, budgets, failures and provenance merged with the new seeds' (assemble), checked
against what must match (check_extension: another grid, another command, seeds left out, another device), a cut-short
extension (--report_only) listing each run once, and the figures drawn again from the report's rows. The verdicts of
the merged rows are checked against scipy.stats.ttest_rel and Holm's procedure by hand."""

import json

import pytest
from helpers.holm import holm_reference
from scipy import stats

from adaptive_ds.tools.grid import _without_seeds, assemble, check_extension, main, run_grid
from adaptive_ds.tools.grid_spec import GridSpec, parse_variant
from adaptive_ds.tools.grid_tables import CURVE_POINTS, downsample, markdown

EARLIER = {"commit": "abc1234", "machine": "x86_64 CPU, 2 cores, no GPU", "date": "2026-12-01"}
LATER = {"commit": "def5678", "machine": "x86_64 CPU, 2 cores, no GPU", "date": "2026-12-03"}
UNKNOWN = dict.fromkeys(("commit", "machine", "date"), "unknown")  # a run without grid_provenance.json
# validation losses by seed (1-4)
LOSSES = {"dense": (2.00, 2.10, 2.20, 2.05), "mod": (2.06, 2.15, 2.27, 2.12), "moe": (1.98, 2.11, 2.17, 2.04)}
HASH = {"sha256": "0" * 64, "of": "the embedded generator (hard tier)"}


def _finished(variant: str, seed: int, trained: dict = EARLIER, flops: float = 2e12) -> dict:
    """A finished run as load_run reads it: its curve (FLOPs, loss, tokens, training seconds) from 3.0 down to its
    validation loss, its final FLOPs `flops`."""
    loss = LOSSES[variant][seed - 1]
    curve = [(flops / 2, 3.0, 1000, 2.0), (flops, loss, 2000, 10.0)]
    phases = {"setup": 2.0, "data": 1.0, "train": 6.0, "checkpoint": 0.5, "eval": 0.4, "other": 0.1}
    summary = {"validation_loss": loss, "validation_loss_se": 0.01, "tokens_seen": 2000, "wall_time_s": 10.0,
               "time_breakdown_s": phases, "total_parameters": 1000, "active_parameters": 1000,
               "peak_memory": {"device": "cpu", "peak_rss_bytes": 2**30}}
    metrics = [{"loss": c[1], "tokens_seen": c[2], "elapsed_s": c[3] + 2.0} for c in curve]
    return {"variant": variant, "seed": seed, "run_dir": f"{variant}-{seed}", "kept": False, "trained": trained,
            "summary": summary, "metrics": metrics, "curve": curve}


def _spec(seeds, ds_config="ds_configs/debug_cpu.json", **kw) -> GridSpec:
    return GridSpec("debug", tuple(map(parse_variant, ("dense", "mod", "moe"))), tuple(seeds), 2000, ds_config,
                    data="embedded:hard", **kw)


def _failure(variant: str, seed: int) -> dict:
    return {"variant": variant, "seed": seed, "run_dir": f"{variant}-{seed}", "exit": 1, "log": f"{variant}-{seed}.log",
            "log_tail": "RuntimeError: out of patience\n"}


def _earlier() -> dict:
    """Seeds 1 and 2; moe's seed 2 and mod's seed 2 failed; dense's seed 2 kept from a grid without provenance."""
    finished = [_finished("dense", 1), _finished("dense", 2, UNKNOWN), _finished("mod", 1), _finished("moe", 1)]
    return assemble(_spec((1, 2)), finished, [_failure("mod", 2), _failure("moe", 2)], None, None, 0.09,
                    data_hash=HASH)



def test_an_extension_merges_rows_budgets_failures_and_provenance():
    earlier = _earlier()
    # seeds 3-4 and mod's seed 2 retried, on a later commit; their curves run further (3e12 FLOPs), yet they are read
    # at the earlier report's budgets; moe's seed 2 was not retried (still failed), mod's seed 4 failed now
    new = [_finished(v, s, LATER, flops=3e12) for v, s in (("dense", 3), ("dense", 4), ("mod", 2), ("mod", 3),
                                                          ("moe", 3), ("moe", 4))]
    report = assemble(_spec((1, 2, 3, 4, 5)), new, [_failure("mod", 4)], None, None, 0.09, extend=earlier,
                      data_hash=HASH)
    assert [(r["variant"], r["seed"]) for r in report["runs"]] == [
        ("dense", 1), ("dense", 2), ("dense", 3), ("dense", 4), ("mod", 1), ("mod", 2), ("mod", 3), ("moe", 1),
        ("moe", 3), ("moe", 4)]  # the grid's order: variant by variant, seed by seed
    assert report["runs"][:2] == earlier["runs"][:2] and report["budgets"] == earlier["budgets"] == {
        "flops": 2e12, "tokens": 2000, "seconds": 10.0}
    # a new run read at the earlier budget: a third of the way along its curve from 1.5e12 FLOPs (loss 3.0) to 3e12
    # (its validation loss, 2.20): 3.0 - 0.8 / 3
    assert report["runs"][2]["train_loss_at_equal_flops"] == pytest.approx(3.0 - 0.8 / 3)
    assert [(f["variant"], f["seed"]) for f in report["failed"]] == [("moe", 2), ("mod", 4)]
    assert (report["date"], report["commit"], report["runs_without_provenance"]) == (
        "2026-12-01 to 2026-12-03", "abc1234, def5678", 1)
    header = markdown(report).split("\n")[0]
    assert header.startswith("Measured 2026-12-01 to 2026-12-03 on x86_64 CPU, 2 cores, no GPU, commit abc1234, "
                             "def5678 (1 run without provenance): `python -m") and "unknown" not in header
    assert "one process each, seeds 1-5 requested, 1-4 finished; data" in header
    # the verdicts over the merged rows: each variant against dense on the seeds both finished, one family
    seeds = {"mod": (1, 2, 3), "moe": (1, 3, 4)}
    p = [stats.ttest_rel([LOSSES[v][s - 1] for s in seeds[v]], [LOSSES["dense"][s - 1] for s in seeds[v]]).pvalue
         for v in ("mod", "moe")]
    for name, adjusted in zip(("mod", "moe"), holm_reference(p), strict=True):
        cell = report["comparisons"][name]["validation_loss"]
        assert cell["n"] == 3 and cell["p_holm"] == pytest.approx(adjusted, rel=1e-9), name
        assert cell["verdict"] == ("tie" if adjusted >= 0.05 else "worse" if cell["difference"] > 0 else "better")
    # by hand: mod - dense 0.06, 0.05, 0.07: t = 0.06 / (0.01 / sqrt 3) = 10.392 on 2 df, p = 1 - t / sqrt(2 + t^2)
    # = 0.0091326, x 2 (Holm over 2) = 0.018265: worse
    assert report["comparisons"]["mod"]["validation_loss"]["p_holm"] == pytest.approx(0.018265, abs=1e-6)
    assert report["comparisons"]["mod"]["validation_loss"]["verdict"] == "worse"
    assert report["holm_family"]["tests"] == 2


def test_a_run_without_provenance_is_counted_not_named():
    alone = assemble(_spec((1,)), [_finished("dense", 1, UNKNOWN)], [], None, None, None, data_hash=HASH)
    assert (alone["date"], alone["machine"], alone["runs_without_provenance"]) == ("", "", 1)
    header = markdown(alone).split("\n")[0]
    assert header.startswith("Measured (1 run without provenance): `python") and "unknown" not in header
    # trained outside a git checkout: its date and machine recorded, its commit "unknown"
    copy = {**LATER, "commit": "unknown"}
    runs = [_finished("dense", 1, copy), _finished("dense", 2, copy), _finished("mod", 1, EARLIER)]
    mixed = assemble(_spec((1, 2)), runs, [], None, None, None, data_hash=HASH)
    assert (mixed["commit"], mixed["runs_without_commit"], mixed["runs_without_provenance"]) == ("abc1234", 2, 0)
    assert markdown(mixed).startswith("Measured 2026-12-01 to 2026-12-03 on x86_64 CPU, 2 cores, no GPU, commit "
                                      "abc1234 (2 runs trained outside a git checkout): `python")
    nothing = assemble(_spec((1,)), [_finished("dense", 1, copy)], [], None, None, None, data_hash=HASH)
    assert markdown(nothing).startswith("Measured 2026-12-03 on x86_64 CPU, 2 cores, no GPU, commit not recorded (1 "
                                        "run trained outside a git checkout): `python")


def test_a_rows_curve_is_kept_downsampled():
    curve = [(float(i), 3.0 - i / 1000, i * 10, i / 10) for i in range(1, 121)]
    kept = downsample(curve)
    assert len(kept) == CURVE_POINTS and kept[0] == list(curve[0]) and kept[-1] == list(curve[-1])
    assert all(a[0] < b[0] for a, b in zip(kept, kept[1:], strict=False))
    assert downsample(curve[:3]) == [list(c) for c in curve[:3]]
    report = assemble(_spec((1,)), [_finished("dense", 1)], [], None, None, None, data_hash=HASH)
    assert report["runs"][0]["curve"] == [[1e12, 3.0, 1000, 2.0], [2e12, 2.0, 2000, 10.0]]
    assert "curve" not in report["results"]["dense"]


def test_check_extension_refuses_what_would_change_the_earlier_runs():
    earlier = _earlier()
    check_extension(_spec((1, 2, 3)), earlier, HASH, (None, None, 0.09))  # the same grid, device and price
    with pytest.raises(ValueError, match=r"it is another grid: its tokens differ from this command's"):
        check_extension(GridSpec("debug", _spec((1,)).variants, (1, 2, 3), 4000, "ds_configs/debug_cpu.json",
                                 data="embedded:hard"), earlier)
    with pytest.raises(ValueError, match=r"its command differs beyond the seeds: .*--seeds 1 2`?$"):
        check_extension(_spec((1, 2, 3), warmup_steps=5), earlier)
    with pytest.raises(ValueError, match=r"--seeds leaves out its seeds 2; name them all"):
        check_extension(_spec((1, 3)), earlier)
    with pytest.raises(ValueError, match=r"it was measured on another device: its gpu None \(this machine: 'h100'\), "
                                         r"peak_tflops None \(this machine: 989\.0\), price_per_hour 0\.09 \(this "
                                         r"machine: 2\.5\); its speed, MFU and costs would mix devices"):
        check_extension(_spec((1, 2, 3)), earlier, HASH, ("h100", 989.0, 2.5))
    with pytest.raises(ValueError, match=r"its price_per_hour 0\.09 \(this machine: None\);"):
        check_extension(_spec((1, 2, 3)), earlier, HASH, (None, None, None))
    # the seeds are all that may differ; the module path moved once (adaptive_ds.grid to adaptive_ds.tools.grid)
    a = "python -m adaptive_ds.grid --preset debug --tokens 2000 --seeds 1 2 --name x"
    assert _without_seeds(a) == _without_seeds("python -m adaptive_ds.tools.grid --preset debug --tokens 2000 "
                                               "--seeds 1 2 3 4 5 --name x")
    assert _without_seeds(a) != _without_seeds(a.replace("--name x", "--name y"))
    assert _without_seeds("python -m adaptive_ds.tools.grid --preset debug --seeds 1") == ["--preset", "debug",
                                                                                           "--seeds"]


def test_the_command_refuses_to_extend_on_another_device(tmp_path):
    report = tmp_path / "grid.json"
    spec = GridSpec("debug", (parse_variant("dense"),), (1,), 2000, "ds_configs/debug_cpu.json")
    earlier = assemble(spec, [_finished("dense", 1)], [], "h100", 989.0, 2.5, data_hash=None)
    report.write_text(json.dumps(earlier))
    with pytest.raises(SystemExit) as refused:
        main(["--variants", "dense", "--tokens", "2000", "--data", "embedded", "--runs", str(tmp_path / "runs"),
              "--out", str(tmp_path / "out"), "--seeds", "1", "2", "--extend", str(report)])
    assert str(refused.value.code).startswith(f"error: --extend {report}: it was measured on another device: its gpu "
                                              "'h100' (this machine: None)")
    assert "\n" not in str(refused.value.code) and not (tmp_path / "runs").exists()


def test_a_cut_short_extension_lists_each_run_once_and_draws_every_seed(tmp_path):
    """--report_only --extend with nothing new on the machine: the earlier failures stay failed (not also 'not
    run'), the seeds never tried are 'not run', and the figures are drawn from the rows' curves, earlier seeds too;
    an earlier report whose rows hold no curve keeps its figures, and its section says which seeds they show."""
    earlier = _earlier()
    spec = _spec((1, 2, 3), ds_config="debug_cpu.json")
    out = tmp_path / "out"
    report = run_grid(spec, str(out), str(tmp_path / "runs"), report_only=True, extend=earlier, data_hash=HASH)
    assert [(f["variant"], f["seed"]) for f in report["failed"]] == [("mod", 2), ("moe", 2)]
    assert [(r["variant"], r["seed"]) for r in report["not_run"]] == [("dense", 3), ("mod", 3), ("moe", 3)]
    assert report["figure_seeds"] == [1, 2]
    assert (out / "grid_debug_embedded-hard_loss_vs_flops.png").stat().st_size > 10_000
    assert "The figures" not in markdown(report)
    without = {**earlier, "runs": [{k: v for k, v in r.items() if k != "curve"} for r in earlier["runs"]]}
    (out / "grid_debug_embedded-hard_loss_vs_flops.png").unlink()
    old = run_grid(spec, str(out), str(tmp_path / "runs"), report_only=True, extend=without, data_hash=HASH)
    assert old["figure_seeds"] == [1, 2] and not (out / "grid_debug_embedded-hard_loss_vs_flops.png").exists()
    assert json.loads((out / "grid_debug_embedded-hard.json").read_text())["figure_seeds"] == [1, 2]
    old["runs"].append({**old["runs"][0], "seed": 3})  # as if seed 3 had been trained now
    assert ("The figures (`grid_debug_embedded-hard_loss_vs_*.png`) show seeds 1, 2 only: they were drawn from those "
            "runs' curves, which the report's rows do not hold") in markdown(old)
