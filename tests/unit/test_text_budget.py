"""The text budget's rule against hand-worked curves (one that flattens at a known point, one that never does, noisy
evaluations with a stray one), its report and section from a finished pilot's files, and its refusals."""

import json
import math

import pytest
from helpers.pilots import pilot_dir, prepared_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from adaptive_ds.data.identity import data_identity
from adaptive_ds.tools.text_budget import choose, flat, least_squares_slope, main, markdown, slopes


def test_the_least_squares_slope_and_its_standard_error_by_hand_and_by_scipy():
    # (0, 1), (1, 3), (2, 2): mean x 1, mean y 2, Sxx 2, Sxy 1 -> slope 0.5; residuals -0.5, 1, -0.5, RSS 1.5 on
    # 1 degree of freedom -> SE sqrt(1.5 / 2) = 0.8660
    slope, se = least_squares_slope([(0, 1), (1, 3), (2, 2)])
    assert slope == pytest.approx(0.5) and se == pytest.approx(math.sqrt(0.75))
    assert least_squares_slope([(1, 5.0), (3, 4.0)]) == (pytest.approx(-0.5), None)  # two points: no residual
    xs, ys = [0.8, 0.9, 1.0, 1.1, 1.2, 1.3], [5.31, 5.22, 5.18, 5.09, 5.07, 4.98]
    reference = stats.linregress(xs, ys)
    assert least_squares_slope(list(zip(xs, ys, strict=True))) == (pytest.approx(reference.slope),
                                                      pytest.approx(reference.stderr))


def _kinked(k: int) -> float:
    """Falls 1 nat per 1M tokens to 5.0 at 1M tokens, then stays there."""
    return 6.0 - min(k, 10) * 0.1


KINKED = [(100_000 * k, _kinked(k)) for k in range(1, 21)]


def test_a_curve_that_flattens_at_a_known_point():
    rows = slopes(KINKED, min_points=3)
    by_tokens = {r["tokens"]: r for r in rows}
    # [0.72M, 0.9M] holds 0.8M and 0.9M: two evaluations, under 3, so undecided
    assert by_tokens[900_000]["slope_per_million"] is None and by_tokens[900_000]["points"] == 2
    # [0.8M, 1M]: 5.2, 5.1, 5.0 -> -1 per 1M; [0.88M, 1.1M]: 5.1, 5.0, 5.0 -> Sxy -0.01 / Sxx 0.02 (in M) = -0.5;
    # [0.96M, 1.2M]: 5.0 three times -> 0
    assert by_tokens[1_000_000]["slope_per_million"] == pytest.approx(-1.0)
    assert by_tokens[1_100_000]["slope_per_million"] == pytest.approx(-0.5)
    assert by_tokens[1_200_000]["slope_per_million"] == pytest.approx(0.0, abs=1e-9)
    assert by_tokens[1_100_000]["slope_se"] == pytest.approx(math.sqrt((1 / 600) / 0.02))  # RSS 1/600 on 1 df
    assert choose(rows, 0.05) == (1_200_000, 1_200_000)
    assert choose(rows, 0.6) == (1_100_000, 1_100_000)  # -0.5 is above -0.6
    assert choose(rows, 1.01) == (1_000_000, 1_000_000)  # the first decided slope is flat
    assert choose(rows, 0.99)[0] == 1_100_000


def test_a_curve_that_never_flattens_proposes_the_pilots_budget():
    falling = [(100_000 * k, 6.0 - 0.02 * k) for k in range(1, 31)]  # -0.2 nats per 1M tokens throughout
    rows = slopes(falling, min_points=5)
    assert all(r["slope_per_million"] == pytest.approx(-0.2) for r in rows if r["slope_per_million"] is not None)
    assert choose(rows, 0.05) == (None, None) and choose(rows, 0.25) == (2_000_000, 2_000_000)


def _decaying(k: int, noise: bool = True, stray: bool = True) -> float:
    """5 + 2 exp(-t / 0.5M) at t = 100k k tokens, with a deterministic noise of at most 0.004 nats and, at 1.5M
    tokens, one evaluation 0.1 nats too high."""
    loss = 5 + 2 * math.exp(-k / 5)
    if noise:
        loss += 0.004 * ((k * 7919) % 11 - 5) / 5
    return loss + (0.1 if stray and k == 15 else 0.0)


def test_noisy_evaluations_and_a_stray_one_do_not_decide_early():
    clean = slopes([(100_000 * k, _decaying(k, noise=False, stray=False)) for k in range(1, 31)], min_points=4)
    # the slope over the window is close to the curve's derivative at the window's mean, -4 exp(-2 x) per 1M tokens
    # (x in M): at 2.3M the window is 1.9M..2.3M, x 2.1, -0.0600; at 2.4M it is 2.0M..2.4M, x 2.2, -0.0491. So with a
    # threshold of 0.055 the clean curve flattens at 2.4M
    for row in clean[14:]:
        mean = row["tokens"] / 1e6 - 0.05 * (row["points"] - 1)
        assert row["slope_per_million"] == pytest.approx(-4 * math.exp(-2 * mean), rel=0.06)
    assert choose(clean, 0.055) == (2_400_000, 2_400_000)
    noisy = slopes([(100_000 * k, _decaying(k, stray=False)) for k in range(1, 31)], min_points=4)
    assert choose(noisy, 0.055) == (2_300_000, 2_300_000)  # one evaluation from the clean curve's
    stray = slopes([(100_000 * k, _decaying(k)) for k in range(1, 31)], min_points=4)
    budget, first = choose(stray, 0.055)
    # the stray evaluation ends the window at 1.5M and makes its slope positive; the windows after it fall steeply
    # again, so it decides nothing
    assert first == 1_500_000 and stray[14]["slope_per_million"] > 0 > stray[16]["slope_per_million"]
    assert budget == 2_300_000


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=4.0, max_value=8.0), min_size=1, max_size=30),
       st.floats(min_value=0.001, max_value=2.0), st.integers(min_value=2, max_value=6))
def test_the_budget_is_where_the_curve_flattens_for_good(losses, threshold, min_points):
    rows = slopes([(50_000 * (k + 1), v) for k, v in enumerate(losses)], min_points)
    budget, first = choose(rows, threshold)
    flats = [flat(r, threshold) for r in rows]
    # by enumeration: the first index of the run of flat slopes that ends the curve, and the first flat one
    tail = next((i for i in range(len(rows)) if all(flats[i:])), None)
    assert budget == (rows[tail]["tokens"] if tail is not None else None)
    assert first == next((r["tokens"] for r, f in zip(rows, flats, strict=True) if f), None)
    assert budget is None or first <= budget


TRAINED = {"commit": "abc1234", "machine": "x86_64 CPU, 2 cores, no GPU", "date": "2026-12-02"}


def _run(tmp_path, curve, *extra):
    corpus = prepared_dir(tmp_path / "corpus")
    run = pilot_dir(tmp_path / "pilot", curve, corpus, trained=TRAINED)
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    main(["--data", corpus, "--run_dir", run, "--out", str(tmp_path / "out"), "--min_points", "3",
          "--benchmarks_md", str(md), *extra])
    report = json.loads((tmp_path / "out" / "text-budget_debug_corpus.json").read_text())
    return corpus, report, md.read_text()


def test_the_report_and_its_section_from_a_finished_pilot(tmp_path, capsys):
    corpus, report, benchmarks = _run(tmp_path, KINKED)
    assert report["budget"] == report["first_flat"] == report["proposed_tokens"] == 1_200_000
    assert [(r["tokens"], r["validation_loss"]) for r in report["curve"]] == KINKED
    assert report["curve"][0]["step"] == 100 and report["eval_steps"] == 100 and report["tokens_per_step"] == 1000
    assert report["data_hash"] == data_identity(corpus) and report["threshold_per_million"] == 0.05
    assert report["uniform_loss"] == pytest.approx(math.log(8192)) and report["max_tokens"] == 2_000_000
    assert report["commit"] == "abc1234" and report["ds_config"] is None  # read, not trained: its config unknown
    section = markdown(report)
    assert f"<!-- text-budget:debug:corpus -->\n{section}\n<!-- /text-budget:debug:corpus -->" in benchmarks
    assert capsys.readouterr().out.startswith(section)
    assert "Measured 2026-12-02 on x86_64 CPU, 2 cores, no GPU, commit abc1234: `python -m adaptive_ds.tools." \
           "text_budget --data" in section and "trained as its run directory says" in section
    assert f"data sha256 `{report['data_hash']['sha256']}` (prepared directory: its 3 token shards (43 tokens)" \
           in section
    assert "and its tokenizer); 40 training tokens, so the pilot read 50000.00 epochs. Compute: 0.50 CPU-hours " \
           "(one process)" in section and "scores 9.01" in section
    assert "**Budget: 1,200,000 tokens**: the validation loss there is 5.0000 and its slope over the last fifth " \
           "+0.0000 nats per 1M tokens, above -0.05, as at every later evaluation." in section
    table = [line for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert table[0] == "| 100,000 | 5.9000 | - | - | 1 | - |"
    assert "| 1,100,000 | 5.0000 | -0.5000 | 0.2887 | 3 | no |" in table
    assert table[-1] == "| 2,000,000 | 5.0000 | +0.0000 | 0.0000 | 5 | yes |"


def test_a_pilot_that_never_flattens_says_so_and_proposes_its_budget(tmp_path):
    falling = [(100_000 * k, 6.0 - 0.02 * k) for k in range(1, 31)]
    _, report, benchmarks = _run(tmp_path, falling)
    assert report["budget"] is None and report["proposed_tokens"] == 3_000_000
    assert report["last_fifth_slope_per_million"] == pytest.approx(-0.2)
    assert "**No budget up to 3,000,000 tokens**: the validation loss has not flattened (the slope over the " \
           "pilot's last fifth: -0.2000 nats per 1M tokens, the threshold -0.05). Proposed: 3,000,000 tokens" \
           in benchmarks
    rows = [line for line in benchmarks.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 15 and rows[-1].startswith("| 3,000,000 |")  # every other evaluation, the last among them


@pytest.mark.parametrize(("argv", "message"), [
    (["--data", "{tmp}/nowhere"], r"^error: --data '.*nowhere': no such directory; pass a prepared directory"),
    (["--data", "{tmp}"], r"^error: --data: '.*' is not a prepared directory \(no manifest.json\); make one"),
    (["--data", "{corpus}", "--threshold", "0"], r"^error: --threshold 0.0 must be above 0 \(nats per 1M tokens"),
    (["--data", "{corpus}", "--threshold", "-0.05"], r"^error: --threshold -0.05 must be above 0"),
    (["--data", "{corpus}", "--min_points", "1"], r"^error: --min_points 1 must be at least 2"),
    (["--data", "{corpus}", "--max_tokens", "0"], r"^error: --max_tokens 0 must be at least 1$"),
    (["--data", "{corpus}", "--run_dir", "{moe}"], r"^error: --run_dir '.*moe' trained moe; the pilot is a dense run$"),
    (["--data", "{other}", "--run_dir", "{pilot}"], r"^error: the pilot trained with tokenizer sha256:\w+, not --data "
                                                    r".*other's \(sha256:\w+\): it read another corpus$"),
])
def test_bad_input_is_refused_in_one_line_and_writes_nothing(tmp_path, argv, message):
    corpus = prepared_dir(tmp_path / "corpus")
    paths = {"tmp": str(tmp_path), "corpus": corpus, "other": prepared_dir(tmp_path / "other", tokenizer_text="v2"),
             "pilot": pilot_dir(tmp_path / "pilot", KINKED, corpus),
             "moe": pilot_dir(tmp_path / "moe", KINKED, corpus, arch="moe")}
    with pytest.raises(SystemExit, match=message) as refused:
        main([a.format(**paths) for a in argv] + ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")])
    assert "\n" not in str(refused.value.code) and not (tmp_path / "out").exists() and not (tmp_path / "w").exists()
