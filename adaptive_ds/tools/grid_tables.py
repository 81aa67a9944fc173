"""The grid's statistics across seeds, its Markdown tables and its figures: functions of the runs' figures.

`spread` (mean and sample standard deviation over seeds), `difference` (against the baseline, paired by seed
where possible, with a paired t-test: its 95% confidence interval and p-value), `aggregate` and `compare` (a
whole grid's rows; the verdicts are the Holm family's: tools/grid_family.py), `markdown` (the BENCHMARKS.md section)
and `plot` (loss against FLOPs, tokens and seconds, mean over the seeds with their min..max band).
adaptive_ds/tools/grid.py trains the runs and reads their figures.
"""

from __future__ import annotations

import json
import math

import numpy as np

from ..data.identity import describe
from ..training.metrics import PhaseClock
from .grid_family import family_of, section_key
from .report import device_kind, section_stem
from .significance import ALPHA, paired_t

PHASES = (*PhaseClock.PHASES, "other")
# The budgets at which train losses are compared: (name, index in a curve point, label).
BUDGETS = (("flops", 0, "training FLOPs"), ("tokens", 2, "tokens"), ("seconds", 3, "training seconds"))
# Quality figures compared with the baseline; lower is better for each.
COMPARED = ("validation_loss", "topk_routing_loss", "train_loss_at_equal_flops", "train_loss_at_equal_tokens",
            "train_loss_at_equal_seconds")
# What names a run in the report's rows, not a figure of it.
RUN_KEYS = ("variant", "seed", "run_dir", "kept", "trained")
# A row's loss curve, downsampled (CURVE_POINTS at most): the figures are drawn from the report's rows.
CURVE_POINTS = 50


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (n - 1 in the denominator; None for a single value), min, max, n."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values), "n": n}


def difference(variant: dict[int, float], baseline: dict[int, float]) -> dict:
    """variant - baseline over seeds ({seed: figure} each) and its standard deviation. With two or more seeds in
    common, paired: the mean and sd of the per-seed differences (the seed's data order and held-out set are
    shared, so their noise cancels), with the paired t-test of those differences (`t`, its two-sided `p` on n - 1
    degrees of freedom, the mean's 95% confidence interval `ci`). Otherwise unpaired: the difference of the means,
    with the sd of the difference of two single runs, sqrt(sd_v^2 + sd_b^2) (None when either side has one seed),
    and no test. The verdict is the Holm family's (tools/grid_family.py)."""
    common = sorted(set(variant) & set(baseline))
    if len(common) >= 2:
        d = spread([variant[s] - baseline[s] for s in common])
        return {"difference": d["mean"], "sd": d["sd"], "paired": True, "n": d["n"],
                **paired_t(d["mean"], d["sd"], d["n"])}
    v, b = spread(list(variant.values())), spread(list(baseline.values()))
    sd = math.hypot(v["sd"], b["sd"]) if v["sd"] is not None and b["sd"] is not None else None
    return {"difference": v["mean"] - b["mean"], "sd": sd, "paired": False, "n": min(v["n"], b["n"]), "t": None,
            "p": None, "ci": None}


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def aggregate(rows: list[dict]) -> dict:
    """The `spread` of every figure of a variant's runs (nested dicts recursively); None where a figure does
    not apply (a None in any run)."""
    out = {}
    for key, first in rows[0].items():
        if key in (*RUN_KEYS, "curve"):
            continue
        values = [r[key] for r in rows]
        if isinstance(first, dict):
            out[key] = aggregate(values)
        else:
            out[key] = spread([float(v) for v in values]) if all(_numeric(v) for v in values) else None
    return out


def _compared(row: dict, metric: str) -> float:
    # a model without routing has one validation loss: its top-k routing loss is that
    return row["validation_loss"] if metric == "topk_routing_loss" and row[metric] is None else row[metric]


def compare(rows: list[dict], baseline: str) -> dict:
    """{variant: {figure: difference}} against the baseline variant's runs of the same seeds. The validation losses
    get a verdict from their Holm family (`grid_family.judge_reports`, over the report's comparisons and pairs and
    those of reports sharing its runs); the other figures (train losses at equal budgets, the top-k routing loss) are
    descriptive: their differences and intervals, no verdict."""
    by_variant: dict[str, dict[int, dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], {})[r["seed"]] = r
    if baseline not in by_variant:
        return {}
    base = by_variant[baseline]
    out = {}
    for name, runs in by_variant.items():
        if name == baseline:
            continue
        out[name] = {}
        for metric in COMPARED:
            # a figure a run lacks (a budget before its first logged step) leaves that seed out
            values, reference = ({s: v for s, r in side.items() if (v := _compared(r, metric)) is not None}
                                 for side in (runs, base))
            out[name][metric] = difference(values, reference) if values and reference else None
    return out


def downsample(curve: list[tuple]) -> list[list[float]]:
    """At most CURVE_POINTS points of a curve, evenly spaced by index, its first and last among them."""
    if len(curve) <= CURVE_POINTS:
        return [list(p) for p in curve]
    picked = sorted({round(i * (len(curve) - 1) / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)})
    return [list(curve[i]) for i in picked]


def _band(curves: list[list[tuple]], axis: int) -> tuple[np.ndarray, ...]:
    """x, and the mean, min and max over the seeds' curves interpolated on the x range they all cover."""
    lo, hi = max(c[0][axis] for c in curves), min(c[-1][axis] for c in curves)
    xs = np.linspace(lo, hi, 100) if hi > lo else np.array([hi])
    ys = np.array([np.interp(xs, [p[axis] for p in c], [p[1] for p in c]) for c in curves])
    return xs, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def plot(curves: dict[str, list[list[tuple]]], floor: float | None, prefix: str) -> None:
    """PREFIX_loss_vs_{flops,tokens,seconds}.png: per variant the mean train loss over its seeds, with a band
    from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, axis, label in BUDGETS:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        finals = []
        for variant, runs in curves.items():
            xs, mean, low, high = _band(runs, axis)
            (line,) = ax.plot(xs, mean, label=f"{variant} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
            if len(runs) > 1:
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
            finals.append(mean[-1])
        if floor is not None:
            ax.axhline(floor, color="gray", linestyle="--", label=f"entropy floor {floor:.3f}")
        bottom = (floor if floor is not None else min(finals)) - 0.1
        ax.set_ylim(bottom, bottom + 1.6)  # the early steps' losses would flatten the part that differs
        ax.set_xlabel(label)
        ax.set_ylabel("train loss (nats/token)")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{prefix}_loss_vs_{name}.png", dpi=110)
        plt.close(fig)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _money(value: float | None, spec: str) -> str:
    return "-" if value is None else f"${value:{spec}}"


def _cell(stat: dict | None, spec: str = ".4f", scale: float = 1.0, suffix: str = "", seeds: int = 0) -> str:
    """mean ± sd of a `spread` (scaled), and n where fewer runs than seeds finished; '-' where not applicable."""
    if stat is None:
        return "-"
    text = f"{stat['mean'] * scale:{spec}}{suffix}"
    if stat["sd"] is not None:
        text += f" ± {stat['sd'] * scale:{spec}}{suffix}"
    return text + (f" (n={stat['n']})" if stat["n"] < seeds else "")


def _difference_cell(d: dict | None, judged: bool = True) -> str:
    """difference ± sd [95% interval], and where `judged` p=... (Holm ...) and the verdict, a tie with the
    difference its seeds could have detected; a comparison without a test says why."""
    if d is None:
        return "-"
    if d["sd"] is None:
        return f"{d['difference']:+.4f} (one seed" + (": no verdict)" if judged else ")")
    text = f"{d['difference']:+.4f} ± {d['sd']:.4f}"
    if d.get("p") is None:
        return f"{text} (unpaired" + (": no verdict)" if judged else ")")
    low, high = d["ci"]
    text += f" [{low:+.4f}, {high:+.4f}]"
    if not judged:
        return text
    text += f" p={d['p']:.2g} (Holm {d['p_holm']:.2g}) {d['verdict']}"
    return text + (f", detectable {d['detectable']:.4f}" if d.get("detectable") is not None else "")


def _difference_cells(c: dict) -> str:
    """A comparison's cells: the validation loss judged, the other figures descriptive."""
    return " | ".join(_difference_cell(c[m], judged=m == "validation_loss") for m in COMPARED)


def _tests(cells: list[dict | None]) -> int:
    return sum(1 for d in cells if d is not None and d.get("p") is not None)


def _count(n: int) -> str:
    return "no validation-loss test" if n == 0 else f"{n} validation-loss test{'' if n == 1 else 's'}"


def _family_text(report: dict, table: str) -> str:
    """What the p-values of `table` ("comparisons" or "pairs") are Holm-adjusted over: the report's family (its
    comparisons, its pairs and the tests of the reports sharing its runs), with where its tests come from."""
    family = family_of(report)
    m = family["tests"]
    counts = {"comparisons": _tests([c["validation_loss"] for c in report["comparisons"].values()]),
              "pairs": _tests([p["validation_loss"] for p in report.get("pairs") or [] if not p.get("missing")])}
    others = [f"`{key}`" for key in family["sections"] if key != section_key(report)]
    if m == 0:
        return "no test (no validation loss paired two or more seeds)"
    other = "pairs" if table == "comparisons" else "comparisons"
    parts = [*([f"this table's {counts[table]}"] if counts[table] else []),
             *([f"the {'pairs' if other == 'pairs' else 'comparison'} table's {counts[other]}"] if counts[other]
               else []),
             *([f"those of section{'s' if len(others) > 1 else ''} {', '.join(others)} sharing its runs"] if others
               else [])]
    if parts == [f"this table's {m}"]:
        return f"this table's {_count(m)}"
    once = " (the same runs against the same runs in two tables counted once)" if others or sum(counts.values()) > m \
        else ""
    return f"{_count(m)}: {', '.join(parts[:-1])}{' and ' if len(parts) > 1 else ''}{parts[-1]}{once}"


def _rule(report: dict) -> str:
    m = family_of(report)["tests"]
    return (f"'better' / 'worse' only in the validation loss, where its Holm-adjusted p is below {ALPHA}, else 'tie' "
            "with the smallest difference its seeds could have detected (80% power, two-sided, at the Holm-corrected "
            f"level {ALPHA}/{m if m else 'm'}, with the observed sd: a rough, post-hoc figure); the other columns are "
            "descriptive, without a test")


def _header(report: dict) -> list[str]:
    price = report["price_per_hour"]
    at = report["budgets"]
    floor = report["entropy_floor"]
    variants = "; ".join(
        f"`{name}` = {v['arch']}" + (f" + model `{json.dumps(v['model'])}`" if v["model"] else "")
        + (f" + controller `{json.dumps(v['controller'])}`" if v["controller"] else "")
        for name, v in report["variants"].items())
    return [
        f"{_measured(report)}: `{report['command']}` "
        f"({report['tokens']:,} tokens per run unless a variant names its own, one process each, {_seeds(report)}; "
        f"data `{report['data']}`"
        + (f", entropy floor {floor:.4f} nats/token (mean over the seeds' held-out sets)" if floor is not None
           else ", which has no known entropy floor") + "). "
        + (f"Costs at ${price:.2f}/hour (`adaptive_ds/hardware.py`; `--price` to change). " if price is not None
           else "No price is known for this device, so no costs: pass `--price`. ")
        + "Each figure is the mean ± the standard deviation over the seeds (n: the runs that finished where "
        "fewer); '-' marks a figure that does not apply. Train losses are read off each run's curve at the "
        f"smallest total any run on the grid's budget reached: {at['flops']:.3g} training FLOPs, "
        f"{at['tokens']:,.0f} tokens, {at['seconds']:.1f} training seconds; '-' where a run's curve does not reach "
        "that far (a variant with a smaller token budget of its own)."
        + (f" A continuation grid: each run starts from `{report['init_from']}` of its seed, and its FLOPs, tokens "
           "and seconds count the continuation only (the routing table gives the total with the base run's); a "
           "variant with `\"init_from\": null` trains from random weights instead, its train losses not read at the "
           "continuations' budgets." if report.get("init_from") else ""),
        "",
        f"Variants: {variants}.",
        "",
        _provenance(report),
    ]


def _measured(report: dict) -> str:
    """When, where and from what code the runs trained: ranges over the runs that recorded it, and how many did not
    (a run kept from a grid stopped before writing its provenance; a run trained outside a git checkout)."""
    counts = {"trained outside a git checkout": report.get("runs_without_commit", 0),
              "without provenance": report.get("runs_without_provenance", 0)}
    notes = [f"{n} run{'' if n == 1 else 's'} {what}" for what, n in counts.items() if n]
    without = f" ({'; '.join(notes)})" if notes else ""
    if not report["date"]:
        return f"Measured{without}"
    return f"Measured {report['date']} on {report['machine']}, commit {report['commit'] or 'not recorded'}{without}"


def seed_list(seeds: list[int]) -> str:
    """1, 2 / 1-5 / 1-3, 7: runs of three or more consecutive seeds as a range."""
    seeds, parts, i = sorted(seeds), [], 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        parts += [f"{seeds[i]}-{seeds[j]}"] if j - i >= 2 else [str(s) for s in seeds[i:j + 1]]
        i = j + 1
    return ", ".join(parts)


def _seeds(report: dict) -> str:
    """The seeds with a finished run, and the requested ones where they differ (a grid cut short or failed)."""
    finished = sorted({r["seed"] for r in report["runs"]})
    if finished == sorted(report["seeds"]):
        return f"seeds {seed_list(finished)}"
    return f"seeds {seed_list(report['seeds'])} requested, {seed_list(finished) or 'none'} finished"


def _figures(report: dict) -> list[str]:
    """Which seeds the PNG figures show, where not every finished seed (an extension of a report whose earlier rows
    hold no loss curve: its figures are kept as they were)."""
    shown = report.get("figure_seeds")
    if shown is None or shown == sorted({r["seed"] for r in report["runs"]}):
        return []
    return ["", f"The figures (`{section_stem(section_key(report))}_loss_vs_*.png`) show seeds {seed_list(shown)} "
                "only: they were drawn from those runs' curves, which the report's rows do not hold, so the added "
                "seeds could not be drawn with them."]


def _provenance(report: dict) -> str:
    """The corpus the runs read (its hash: `adaptive_ds.data.identity`) and the compute they spent."""
    data = describe(report.get("data_hash"))
    unchecked = (report.get("data_hash") or {}).get("unchecked_seeds")
    if unchecked:
        data += (f"; seeds {', '.join(map(str, unchecked))} were trained before the data hash was recorded, so "
                 "their corpus is unchecked")
    hours = sum(r["wall_time_s"] for r in report["runs"]) / 3600
    return (f"Corpus: {data}. Compute: {hours:.2f} {device_kind(report['machine'])}-hours (the wall times of its "
            f"{len(report['runs'])} finished runs summed, one process each).")


def _head(columns: list[str]) -> list[str]:
    """A table's header row (after the variant column) and its separator."""
    return ["| variant | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]


def _quality_table(report: dict) -> list[str]:
    results, seeds = report["results"], len(report["seeds"])
    floor = report["entropy_floor"] is not None
    columns = ["validation_loss", *(["loss_minus_floor"] if floor else []), "topk_routing_loss",
               "train_loss_at_equal_flops", "train_loss_at_equal_tokens", "train_loss_at_equal_seconds"]
    lines = _head(["params (total / active)", "validation loss", "its SE (per run)",
                   *(["loss - floor"] if floor else []), "top-k routing loss", "train loss at equal FLOPs",
                   "at equal tokens", "at equal seconds"])
    for name, r in results.items():
        cells = [f"{r['total_parameters']['mean']:,.0f} / {r['active_parameters']['mean']:,.0f}",
                 *(_cell(r[c], seeds=seeds) for c in columns)]
        cells.insert(2, _fmt(r["validation_loss_se"] and r["validation_loss_se"]["mean"], ".4f"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _comparison_table(report: dict) -> list[str]:
    comparisons = report["comparisons"]
    if not comparisons:
        return [f"No comparison: the baseline `{report['baseline']}` has no finished run."]
    lines = [f"Against `{report['baseline']}` (variant - baseline, lower is better; paired by seed where two or more "
             "seeds are shared: the mean ± the sd of the per-seed differences and the mean's 95% confidence interval "
             "(Student's t, n - 1 degrees of freedom); in the validation loss the paired t-test's two-sided p, "
             f"Holm-adjusted over {_family_text(report, 'comparisons')}; {_rule(report)}):", "",
             *_head(["validation loss", "top-k routing loss", "train loss at equal FLOPs", "at equal tokens",
                     "at equal seconds", "seeds"])]
    for name, c in comparisons.items():
        pairing = f"{c['validation_loss']['n']} paired" if c["validation_loss"]["paired"] else "unpaired"
        lines.append(f"| {name} | {_difference_cells(c)} | {pairing} |")
    return lines


def _pairs_table(report: dict) -> list[str]:
    pairs = report.get("pairs") or []
    if not pairs:
        return []
    lines = ["", f"Each against its pair (variant - baseline, as above; Holm over {_family_text(report, 'pairs')}):",
             "",
             "| variant | baseline | validation loss | top-k routing loss | train loss at equal FLOPs "
             "| at equal tokens | at equal seconds | seeds |", "|---" * 8 + "|"]
    for p in pairs:
        if p.get("missing"):
            lines.append(f"| {p['variant']} | {p['baseline']} | " + " | ".join(["-"] * 5)
                         + f" | no finished run of {', '.join(f'`{m}`' for m in p['missing'])} |")
            continue
        pairing = f"{p['validation_loss']['n']} paired" if p["validation_loss"]["paired"] else "unpaired"
        lines.append(f"| {p['variant']} | {p['baseline']} | {_difference_cells(p)} | {pairing} |")
    return lines


def _cost_table(report: dict) -> list[str]:
    results, seeds = report["results"], len(report["seeds"])
    gpu = report["peak_tflops"] is not None
    lines = _head(["tokens/s", "MFU" if gpu else "achieved TFLOP/s", "peak memory (GiB)", "wall time (s)", "cost",
                   "$ per 1B tokens"])
    for name, r in results.items():
        speed = _cell(r["mfu"], ".1f", 100, "%", seeds) if gpu else _cell(r["achieved_tflops"], ".3f", seeds=seeds)
        lines.append(
            f"| {name} | {_cell(r['tokens_per_s'], ',.0f', seeds=seeds)} | {speed} | "
            f"{_cell(r['peak_memory_gib'], '.2f', seeds=seeds)} | {_cell(r['wall_time_s'], '.0f', seeds=seeds)} | "
            f"{_money(r['cost_usd'] and r['cost_usd']['mean'], '.4f')} | "
            f"{_money(r['cost_per_1b_tokens_usd'] and r['cost_per_1b_tokens_usd']['mean'], ',.2f')} |")
    return lines


def _routing_table(report: dict) -> list[str]:
    continued = bool(report.get("init_from"))
    lines = _head(["expert utilisation", "load balance", "dropped", "skip rate", "FLOPs reduction", "training FLOPs",
                   *(["with the base run's"] if continued else []), *PHASES])
    for name, r in report["results"].items():
        mean = {k: (v["mean"] if v is not None else None) for k, v in r.items() if k != "time_breakdown_s"}
        t = r["time_breakdown_s"]
        lines.append(
            f"| {name} | {_fmt(mean['expert_utilisation'] and 100 * mean['expert_utilisation'], '.1f', '%')} | "
            f"{_fmt(mean['load_balance'], '.3f')} | {_fmt(mean['dropped_fraction'], '.1%')} | "
            f"{_fmt(mean['skip_rate'], '.1%')} | {_fmt(mean['flops_reduction'], '.1%')} | "
            f"{mean['training_flops']:.3g} | "
            + (f"{_fmt(mean.get('total_training_flops'), '.3g')} | " if continued else "")
            + " | ".join(f"{t[p]['mean']:.1f} s" for p in PHASES) + " |")
    return lines


def _failures(report: dict) -> list[str]:
    lines = []
    if report.get("not_run"):
        runs = ", ".join(f"`{r['variant']}` seed {r['seed']}" for r in report["not_run"])
        lines += ["", f"Not run (reported with `--report_only`, the grid cut short): {runs}."]
    for f in report["failed"]:
        tail = "\n".join(f["log_tail"].strip().splitlines()[-8:])
        lines += ["", f"Failed: `{f['variant']}` seed {f['seed']} (exit {f['exit']}, log `{f['log']}` in the runs "
                      "directory; the same command retries it), its log ends:", "", "```", tail, "```"]
    return lines


def markdown(report: dict) -> str:
    """The grid's section of BENCHMARKS.md: provenance, then quality, comparison, cost and routing tables."""
    return "\n".join([*_header(report), *_figures(report), "", *_quality_table(report), "", *_comparison_table(report),
                      *_pairs_table(report), "", *_cost_table(report), "", *_routing_table(report), *_failures(report)])
