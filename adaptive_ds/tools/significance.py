"""The grid's significance tests: a paired t-test over seeds and Holm's correction over a table's comparisons.

Student's t distribution is computed in closed form for integer degrees of freedom (Abramowitz and Stegun 26.7.3
and 26.7.4), which is all a paired test over n seeds needs (n - 1 degrees of freedom), so no statistics library is
required; its quantile (the 95% interval's half-width) is the distribution function inverted by bisection.
"""

from __future__ import annotations

import math

ALPHA = 0.05  # the test's level, after Holm's correction


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with `df` (>= 1, integer) degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: A = 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), df - 3 over 2 terms
        term = total = 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + s * math.cos(theta) * total)
    else:  # even: A = sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), df / 2 terms
        term = total = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    return min(1.0, max(0.0, 1.0 - inside))


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (0.5 <= p < 1): e.g. 0.975 gives a two-sided 95% interval's multiplier."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    tail = 2 * (1 - p)  # the two-sided p-value at that t
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > tail:
        lo, hi = hi, 2 * hi
    for _ in range(200):  # bisection to float resolution
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > tail else (lo, mid)
    return (lo + hi) / 2


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


def judge(comparisons: list[dict]) -> None:
    """Set each comparison's `p_holm` (Holm over those of the list with a p-value: one table's) and `verdict`:
    for a loss (lower is better) 'better' or 'worse' where the adjusted p < ALPHA, else 'tie'; None without a
    test (fewer than two seeds paired)."""
    tested = [c for c in comparisons if c.get("p") is not None]
    for c, adjusted in zip(tested, holm([c["p"] for c in tested]), strict=True):
        c["p_holm"] = adjusted
        c["verdict"] = "tie" if adjusted >= ALPHA else ("better" if c["difference"] < 0 else "worse")
    for c in comparisons:
        if c.get("p") is None:
            c.update(p_holm=None, verdict=None)
