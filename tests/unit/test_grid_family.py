"""The Holm family of grid reports: a report's comparisons and pairs are one family, and reports that share runs (a
child grid re-using a parent's runs with another baseline) are judged jointly by --restate, each recording its family
so that it renders alone. The verdicts are checked against scipy.stats.ttest_rel on the raw validation losses and
Holm's procedure worked here by hand."""

import json
import re

import pytest
from helpers.holm import holm_reference
from scipy import stats

from adaptive_ds.tools.grid import assemble, main, restate
from adaptive_ds.tools.grid_family import groups
from adaptive_ds.tools.grid_spec import GridSpec, parse_variant
from adaptive_ds.tools.grid_tables import markdown

TRAINED = {"commit": "abc1234", "machine": "x86_64 CPU, 2 cores, no GPU", "date": "2026-12-02"}
ISO = 'dense+{"tokens": 1000}'
# validation losses by seed: dense; dense on mod's FLOPs (ISO) 0.10, 0.08, 0.15 above it; mod 0.05, 0.07, 0.09 below
# ISO. Alone, the child grid's one test (mod against ISO) is 'better'; in the family of the three, a tie.
LOSSES = {"dense": (2.00, 2.10, 2.20), ISO: (2.10, 2.18, 2.35), "mod": (2.05, 2.11, 2.26)}


def _finished(variant: str, seed: int, loss: float, prefix: str = "") -> dict:
    """A finished run as load_run reads it; its run directory named after the variant and the seed."""
    curve = [(1e12, 3.0, 1000, 2.0), (2e12, loss, 2000, 10.0)]
    phases = {"setup": 2.0, "data": 1.0, "train": 6.0, "checkpoint": 0.5, "eval": 0.4, "other": 0.1}
    summary = {"validation_loss": loss, "validation_loss_se": 0.01, "tokens_seen": 2000, "wall_time_s": 10.0,
               "time_breakdown_s": phases, "total_parameters": 1000, "active_parameters": 1000,
               "peak_memory": {"device": "cpu", "peak_rss_bytes": 2**30}}
    metrics = [{"loss": c[1], "tokens_seen": c[2], "elapsed_s": c[3] + 2.0} for c in curve]
    return {"variant": variant, "seed": seed, "run_dir": f"{prefix}{variant}-{seed}", "kept": False,
            "trained": TRAINED, "summary": summary, "metrics": metrics, "curve": curve}


def _report(variants: list[str], baseline: str = "dense", name: str | None = None, prefix: str = "",
            pairs: tuple = ()) -> dict:
    spec = GridSpec("debug", tuple(map(parse_variant, variants)), (1, 2, 3), 2000, "ds_configs/debug_cpu.json",
                    data="embedded:hard", baseline=baseline, name=name, pairs=pairs)
    finished = [_finished(v, s, LOSSES[v][s - 1], prefix) for v in variants for s in (1, 2, 3)]
    return assemble(spec, finished, [], None, None, None)



def _p(variant: str, baseline: str) -> float:
    return stats.ttest_rel(LOSSES[variant], LOSSES[baseline]).pvalue


def test_reports_sharing_runs_are_one_family_and_each_records_it():
    parent = _report(["dense", ISO, "mod"], name=None)
    child = _report([ISO, "mod"], baseline=ISO, name="vs-iso")
    alone = child["comparisons"]["mod"]["validation_loss"]
    assert alone["p_holm"] == pytest.approx(_p("mod", ISO)) and alone["verdict"] == "better"  # its own family of 1
    assert child["holm_family"] == {"sections": ["grid:debug:embedded-hard:vs-iso"], "tests": 1}
    other = _report(["dense", "mod"], name="elsewhere", prefix="other-")  # no run in common: a family of its own
    parent_again, child_again, other_again = restate([parent, child, other])
    tests = [("mod", "dense"), (ISO, "dense"), ("mod", ISO)]
    expected = dict(zip(tests, holm_reference([_p(*t) for t in tests]), strict=True))
    assert expected[("mod", ISO)] >= 0.05  # 3 x p: the child's verdict is a tie in the family
    cells = {("mod", "dense"): parent_again["comparisons"]["mod"], (ISO, "dense"): parent_again["comparisons"][ISO],
             ("mod", ISO): child_again["comparisons"]["mod"]}
    for test, cell in cells.items():
        assert cell["validation_loss"]["p_holm"] == pytest.approx(expected[test], rel=1e-9), test
        assert cell["validation_loss"]["verdict"] == "tie", test
    family = {"sections": ["grid:debug:embedded-hard", "grid:debug:embedded-hard:vs-iso"], "tests": 3}
    assert parent_again["holm_family"] == child_again["holm_family"] == family
    assert other_again["holm_family"] == {"sections": ["grid:debug:embedded-hard:elsewhere"], "tests": 1}
    assert other_again["comparisons"] == other["comparisons"]
    text = markdown(child_again)  # rendered alone, it states its family
    assert ("Holm-adjusted over 3 validation-loss tests: this table's 1 and those of section "
            "`grid:debug:embedded-hard` sharing its runs (the same runs against the same runs in two tables counted "
            "once);") in text
    assert "at the Holm-corrected level 0.05/3, with the observed sd: a rough, post-hoc figure" in text
    detectable = child_again["comparisons"]["mod"]["validation_loss"]["detectable"]
    assert f"tie, detectable {detectable:.4f}" in text


def test_overlap_is_followed_from_report_to_report_and_a_repeated_test_counts_once():
    """A third report sharing runs with the child only joins the parent's group too; a report repeating the parent's
    own test (the same runs against the same runs, here as a --pair the other way round) adds no test."""
    parent = _report(["dense", ISO], name=None)
    child = _report([ISO, "mod"], baseline=ISO, name="vs-iso")
    grandchild = _report(["mod"], baseline="mod", name="mod-alone")  # mod's runs: shares with the child only
    repeat = _report(["dense", ISO], name="repeat", pairs=((("dense", ISO)),))
    assert groups([parent, child, grandchild, repeat]) == [[0, 1, 2, 3]]
    # another runs directory's runs of the same names (their directories are named relative to --runs): not the same
    # runs, no family
    quiet = _report(["dense", ISO], name="quiet")
    quiet["runs"] = [{**r, "wall_time_s": 38.0} for r in quiet["runs"]]
    assert groups([parent, quiet]) == [[0], [1]] and groups([parent, _report(["dense"], name="x")]) == [[0, 1]]
    restated = restate([parent, child, grandchild, repeat])
    assert {r["holm_family"]["tests"] for r in restated} == {2}  # ISO against dense (three times), mod against ISO
    tests = [(ISO, "dense"), ("mod", ISO)]
    expected = dict(zip(tests, holm_reference([_p(*t) for t in tests]), strict=True))
    (pair,) = restated[3]["pairs"]
    assert pair["validation_loss"]["difference"] == pytest.approx(-0.11)  # dense - ISO
    for cell in (restated[0]["comparisons"][ISO], restated[3]["comparisons"][ISO], pair):
        assert cell["validation_loss"]["p_holm"] == pytest.approx(expected[(ISO, "dense")], rel=1e-9)
    text = markdown(restated[3])
    assert ("Holm over 2 validation-loss tests: this table's 1, the comparison table's 1 and those of sections "
            "`grid:debug:embedded-hard`, `grid:debug:embedded-hard:mod-alone`, `grid:debug:embedded-hard:vs-iso` "
            "sharing its runs") in text


def test_the_tables_name_their_count_of_tests_in_words():
    one = markdown(_report(["dense", "mod"]))
    assert "Holm-adjusted over this table's 1 validation-loss test;" in one
    two = markdown(_report(["dense", "mod", ISO]))
    assert "Holm-adjusted over this table's 2 validation-loss tests;" in two
    spec = GridSpec("debug", (parse_variant("dense"), parse_variant("mod")), (1,), 2000, "ds_configs/debug_cpu.json")
    seedless = assemble(spec, [_finished("dense", 1, 2.0), _finished("mod", 1, 2.1)], [], None, None, None)
    assert seedless["holm_family"]["tests"] == 0  # one seed: no test
    text = markdown(seedless)
    assert "Holm-adjusted over no test (no validation loss paired two or more seeds);" in text
    assert not re.search(r"\b0 (validation|tests)|1 tests\b", text)


def test_restate_takes_a_family_whole_or_refuses(tmp_path):
    """--restate of a report whose recorded family holds a section it is not given is refused before any file is
    written (restated alone, the family would shrink and its verdicts move); given together, each file holds its
    family's verdicts and each section is its report rendered alone."""
    parent, child = restate([_report(["dense", ISO, "mod"]), _report([ISO, "mod"], baseline=ISO, name="vs-iso")])
    paths = [tmp_path / "grid_debug_embedded-hard.json", tmp_path / "grid_debug_embedded-hard_vs-iso.json"]
    for path, report in zip(paths, (parent, child), strict=True):
        path.write_text(json.dumps(report))
    before = paths[1].read_bytes()
    with pytest.raises(SystemExit, match=r"--restate .*vs-iso.json: its Holm family also holds section\(s\) "
                                         r"grid:debug:embedded-hard \(reports sharing its runs\); pass their reports"):
        main(["--restate", str(paths[1])])
    assert paths[1].read_bytes() == before
    md = tmp_path / "B.md"
    main(["--restate", *map(str, paths), "--benchmarks_md", str(md)])
    assert [json.loads(p.read_text()) for p in paths] == json.loads(json.dumps([parent, child]))
    for key, report in (("grid:debug:embedded-hard", parent), ("grid:debug:embedded-hard:vs-iso", child)):
        section = re.search(rf"<!-- {re.escape(key)} -->\n(.*?)\n<!-- /{re.escape(key)} -->", md.read_text(),
                            flags=re.S).group(1)
        assert section == markdown(report)
