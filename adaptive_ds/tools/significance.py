"""The grid's significance tests: a paired t-test over seeds, Holm's correction over a family of comparisons (every
validation-loss test drawn from one set of runs), and the smallest difference a tie's seeds could have detected.

Student's t and the noncentral t come from scipy.stats; Holm's step-down procedure is a sort and a running maximum,
written here (scipy has none).
"""

from __future__ import annotations

import math

from scipy import optimize, stats

ALPHA = 0.05  # the test's level, after Holm's correction
POWER = 0.8  # the power at which a tie states the difference its seeds could have detected


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with `df` (>= 1, integer) degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    return float(min(1.0, 2 * stats.t.sf(abs(t), df)))


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (0.5 <= p < 1): e.g. 0.975 gives a two-sided 95% interval's multiplier."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    return float(stats.t.ppf(p, df))


def paired_t(mean: float, sd: float, n: int) -> dict:
    """The paired t-test of n per-seed differences of this mean and sample standard deviation: t, the two-sided
    p-value (n - 1 degrees of freedom) and the mean's 95% confidence interval [low, high]. Differences all equal
    (sd 0) have an infinite t, recorded as None (JSON has no infinity), and p 0 unless they are all 0."""
    if n < 2 or math.isnan(mean) or math.isnan(sd):
        return {"t": None, "p": None, "ci": None}
    se = sd / math.sqrt(n)
    if se == 0:  # every seed differs by the same amount: certain, unless that amount is nothing
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
    else:
        t = mean / se
    half = t_quantile(0.975, n - 1) * se
    return {"t": t if math.isfinite(t) else None, "p": t_two_sided_p(t, n - 1), "ci": [mean - half, mean + half]}


def paired_power(difference: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """The chance that a two-sided paired t-test at level `alpha` over n seeds rejects when the true mean difference
    is `difference` and the per-seed differences' standard deviation is `sd` (the noncentral t, noncentrality
    difference / (sd / sqrt(n)))."""
    df = n - 1
    critical = stats.t.ppf(1 - alpha / 2, df)
    noncentrality = abs(difference) / (sd / math.sqrt(n))
    # the lower tail as the upper tail of the mirrored distribution: scipy's far-left cdf can come out NaN
    return float(stats.nct.sf(critical, df, noncentrality) + stats.nct.sf(critical, df, -noncentrality))


def detectable_difference(sd: float | None, n: int, power: float = POWER, alpha: float = ALPHA) -> float | None:
    """The smallest true mean difference that a two-sided paired t-test at level `alpha` over n seeds detects with
    probability `power`, taking the observed sd of the per-seed differences as the true one; None without a spread
    (fewer than two seeds) and 0 where the differences did not vary."""
    if sd is None or n < 2 or math.isnan(sd):
        return None
    if sd == 0:
        return 0.0
    se = sd / math.sqrt(n)
    high = se
    while paired_power(high, sd, n, alpha) < power:
        high *= 2
    return float(optimize.brentq(lambda d: paired_power(d, sd, n, alpha) - power, 0.0, high, xtol=1e-12 * high))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order: the i-th smallest times (m - i + 1), made
    non-decreasing along the sorted order and capped at 1. Rejecting where the adjusted p < alpha keeps the
    chance of any false rejection among the m tests at most alpha."""
    m = len(p_values)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: p_values[j])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def judge(comparisons: list[dict], keys: list | None = None) -> int:
    """Set each comparison's `p_holm` (Holm over those of the list with a p-value: one family of validation-loss
    tests) and `verdict`: for a loss (lower is better) 'better' or 'worse' where the adjusted p < ALPHA, else 'tie',
    with the difference its seeds could have detected (`detectable`, at 80% power and the level the verdict uses,
    conservatively ALPHA / m); None without a test (fewer than two seeds paired). `keys` (one per comparison, where
    given): comparisons of equal key are one test (the same runs against the same runs, in two tables), counted once.
    Returns m, the number of distinct tests."""
    keys = list(range(len(comparisons))) if keys is None else keys
    tested = {}
    for c, key in zip(comparisons, keys, strict=True):
        if c.get("p") is not None:
            tested.setdefault(key, []).append(c)
    adjusted = holm([cells[0]["p"] for cells in tested.values()])
    m = len(tested)
    for cells, p_holm in zip(tested.values(), adjusted, strict=True):
        for c in cells:
            c["p_holm"] = p_holm
            c["verdict"] = "tie" if p_holm >= ALPHA else ("better" if c["difference"] < 0 else "worse")
            c["detectable"] = (detectable_difference(c.get("sd"), c.get("n", 0), alpha=ALPHA / m)
                               if c["verdict"] == "tie" else None)
    for c in comparisons:
        if c.get("p") is None:
            c.update(p_holm=None, verdict=None, detectable=None)
    return m
