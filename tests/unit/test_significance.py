"""The grid's significance tests against independent references: Student's sleep data (the paired t-test's
textbook example, as R's t.test reports it), printed t tables, mpmath's incomplete beta function, Holm's
procedure worked by hand, and a simulation of the paired t-test for the detectable difference."""

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_ds.tools.significance import (
    detectable_difference,
    holm,
    judge,
    paired_t,
    t_quantile,
    t_two_sided_p,
)

# Cushny and Peebles' sleep data as Student (1908) analysed it: extra hours of sleep under two drugs, 10 patients.
# R: t.test(extra ~ group, data = sleep, paired = TRUE) -> t = -4.0621, df = 9, p-value = 0.002833,
# 95 percent confidence interval: -2.4598858 -0.7001142, mean difference -1.58.
DRUG_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
DRUG_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_the_paired_t_test_of_students_sleep_data():
    d = [a - b for a, b in zip(DRUG_1, DRUG_2, strict=True)]
    result = paired_t(statistics.mean(d), statistics.stdev(d), len(d))
    assert result["t"] == pytest.approx(-4.0621, abs=5e-5)
    assert result["p"] == pytest.approx(0.002833, abs=5e-7)
    assert result["ci"] == pytest.approx([-2.4598858, -0.7001142], abs=5e-8)


@pytest.mark.parametrize(("df", "t"), [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262),
                                       (10, 2.228), (30, 2.042)])
def test_the_95_percent_multiplier_is_the_t_tables(df, t):
    """Two-sided 5% critical values as every t table prints them (three decimals)."""
    assert t_quantile(0.975, df) == pytest.approx(t, abs=5e-4)
    assert t_two_sided_p(t_quantile(0.975, df), df) == pytest.approx(0.05, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(df=st.integers(1, 60), t=st.floats(0, 50))
def test_the_p_value_is_the_incomplete_beta_functions(df, t):
    """P(|T| >= t) = I_{df/(df+t^2)}(df/2, 1/2), computed by mpmath at high precision."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(40):  # x near 1 for a small t: its complement must not round away
        x = mpmath.mpf(df) / (df + mpmath.mpf(t) ** 2)
        reference = float(mpmath.betainc(mpmath.mpf(df) / 2, mpmath.mpf(1) / 2, 0, x, regularized=True))
    assert t_two_sided_p(t, df) == pytest.approx(reference, rel=1e-9, abs=1e-12)
    assert t_two_sided_p(-t, df) == t_two_sided_p(t, df)


def test_degenerate_differences():
    # every seed 0.01 lower: certain, whatever n; none different: no evidence
    same = paired_t(-0.01, 0.0, 3)
    assert same["p"] == 0.0 and same["t"] is None and same["ci"] == [-0.01, -0.01]
    assert paired_t(0.0, 0.0, 3)["p"] == 1.0
    assert paired_t(0.1, 0.05, 1) == {"t": None, "p": None, "ci": None}
    with pytest.raises(ValueError, match="positive integer"):
        t_two_sided_p(1.0, 0)


def test_holm_against_hand_worked_examples():
    # four tests at 5%: sorted 0.005, 0.01, 0.03, 0.04 against 0.05/4, 0.05/3, 0.05/2 (stops), 0.05/1:
    # the first two rejected. Adjusted: 4 x 0.005 = 0.02, 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, max(0.06, 0.04) = 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # 5 x 0.01, 4 x 0.02, 3 x 0.03, then kept from falling (2 x 0.04 = 0.08 < 0.09), capped at 1 where it exceeds
    assert holm([0.01, 0.02, 0.03, 0.04, 0.05]) == pytest.approx([0.05, 0.08, 0.09, 0.09, 0.09])
    assert holm([0.5, 0.9]) == [1.0, 1.0] and holm([]) == []


def test_a_table_is_judged_as_a_whole():
    """0.02 alone is significant; beside a larger second p Holm doubles it (0.04, still below 5%); beside four more
    it is 0.1 (a tie). A comparison without a test has no verdict; lower losses are better."""
    def cells(*ps):
        return [{"difference": -0.1 if i % 2 else 0.1, "p": p, "sd": 0.1, "n": 3} for i, p in enumerate(ps)]

    alone = cells(0.02)
    judge(alone)
    assert alone[0]["verdict"] == "worse" and alone[0]["p_holm"] == pytest.approx(0.02)
    two = cells(0.02, 0.03)
    judge(two)
    assert [c["verdict"] for c in two] == ["worse", "better"] and two[0]["p_holm"] == pytest.approx(0.04)
    assert two[1]["p_holm"] == pytest.approx(0.04)  # 1 x 0.03, kept from falling below the smaller p's 0.04
    five = cells(0.02, 0.3, 0.5, 0.7, 0.9) + [{"difference": -0.4, "p": None}]
    judge(five)
    assert five[0]["p_holm"] == pytest.approx(0.1) and five[0]["verdict"] == "tie"
    assert five[-1]["verdict"] is None and five[-1]["p_holm"] is None
    assert not math.isnan(five[1]["p_holm"])
    # a tie's detectable difference at the level its verdict used: 5% / m, m = 5 tests
    assert five[0]["detectable"] == pytest.approx(detectable_difference(0.1, 3, alpha=0.01))
    assert five[0]["detectable"] > detectable_difference(0.1, 3) and two[0]["detectable"] is None


def test_the_same_test_in_two_tables_is_counted_once():
    """Cells of equal key are one test: three cells, two of one key, are a family of 2 (Holm 2 x 0.02 = 0.04 for the
    pair, not 3 x 0.02 = 0.06), and the returned m says so; without keys the three are three tests."""
    def cells():
        return [{"difference": 0.1, "p": 0.02, "sd": 0.1, "n": 3}, {"difference": 0.1, "p": 0.02, "sd": 0.1, "n": 3},
                {"difference": -0.1, "p": 0.5, "sd": 0.1, "n": 3}]

    shared = cells()
    assert judge(shared, ["a", "a", "b"]) == 2
    assert [c["p_holm"] for c in shared] == pytest.approx([0.04, 0.04, 0.5])
    assert [c["verdict"] for c in shared] == ["worse", "worse", "tie"]
    assert shared[2]["detectable"] == pytest.approx(detectable_difference(0.1, 3, alpha=0.025))
    apart = cells()
    assert judge(apart) == 3 and [c["verdict"] for c in apart] == ["tie", "tie", "tie"]
    assert apart[0]["p_holm"] == pytest.approx(0.06) and judge([]) == 0


@pytest.mark.parametrize(("sd", "n", "alpha"), [(0.02, 3, 0.05), (1.0, 5, 0.05), (0.5, 10, 0.05), (0.02, 3, 0.05 / 10),
                                                (1.0, 5, 0.05 / 23)])
def test_the_detectable_difference_is_detected_four_times_in_five(sd, n, alpha):
    """Simulated seeds: n normal per-seed differences whose mean is the detectable difference at level `alpha` (5%,
    or a Holm family's 5% / m) and whose sd is `sd`; scipy's one-sample t-test (its own code path) rejects at that
    level in 80% of 20,000 draws (binomial sd 0.3%)."""
    stats = pytest.importorskip("scipy.stats")
    import numpy as np

    delta = detectable_difference(sd, n, alpha=alpha)
    draws = np.random.default_rng(0).normal(delta, sd, size=(20_000, n))
    rejected = stats.ttest_1samp(draws, 0.0, axis=1).pvalue < alpha
    assert rejected.mean() == pytest.approx(0.80, abs=0.012)
    # a smaller n detects only a larger difference; no spread, no test
    assert detectable_difference(sd, n + 2, alpha=alpha) < delta
    assert detectable_difference(None, n) is None and detectable_difference(0.0, n) == 0.0
