"""The Holm family of grid reports: every validation-loss test drawn from one set of runs is corrected as one family.

Within a report that is its comparisons with the baseline and its `--pair` comparisons together. Across reports,
those whose runs overlap are one group, overlap followed from report to report: a run in common is the same run
directory (it names the variant, the seed and every setting of the run) with the same recorded validation loss and
wall time, since the directory is named relative to --runs and another runs directory may hold another run of that
name. A group's validation-loss tests are judged jointly (`judge_reports`, which `python -m adaptive_ds.tools.grid
--restate REPORT ...` applies to the reports it is given); the same runs against the same runs in two tables (either
way round) are one test, counted once. Each report records its family (`holm_family`: the section keys of its group
and the number m of tests), so that its section renders alone and states it.
"""

from __future__ import annotations

from .significance import judge


def section_key(report: dict) -> str:
    """The section key of a grid report: grid:PRESET:DATA[:NAME] (reports before --name have none)."""
    return ":".join(["grid", report["preset"], report["data_name"], *([report["name"]] if report.get("name") else [])])


def run_id(row: dict) -> tuple:
    """What tells one run from another across reports: its directory's name (relative to --runs) and what it measured
    when it trained."""
    return row["run_dir"], row["validation_loss"], row["wall_time_s"]


def _by_seed(report: dict, variant: str) -> dict[int, tuple]:
    return {r["seed"]: run_id(r) for r in report["runs"] if r["variant"] == variant}


def _test_key(report: dict, variant: str, baseline: str) -> tuple:
    """What a paired test of `variant` against `baseline` is drawn from: the runs of the seeds both have, either way
    round (B against A is A against B's two-sided test, its sign turned)."""
    ours, theirs = _by_seed(report, variant), _by_seed(report, baseline)
    common = sorted(set(ours) & set(theirs))
    return min(tuple((ours[s], theirs[s]) for s in common), tuple((theirs[s], ours[s]) for s in common))


def tests(report: dict) -> list[tuple[dict, tuple]]:
    """(validation-loss comparison, its key) of each comparison with the baseline and each --pair of the report, in
    that order; a comparison without a figure (no run of a side) is not there."""
    found = [(c["validation_loss"], _test_key(report, name, report["baseline"]))
             for name, c in report["comparisons"].items() if c["validation_loss"] is not None]
    found += [(p["validation_loss"], _test_key(report, p["variant"], p["baseline"]))
              for p in report.get("pairs") or [] if not p.get("missing") and p["validation_loss"] is not None]
    return found


def groups(reports: list[dict]) -> list[list[int]]:
    """The indices of `reports` grouped by shared runs (`run_id`): two reports with a run in common are in one group,
    and so is a third sharing one with either (the groups partition the reports; each group in the given order)."""
    parent = list(range(len(reports)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[tuple, int] = {}
    for i, report in enumerate(reports):
        for row in report["runs"]:
            j = owner.setdefault(run_id(row), i)
            parent[root(i)] = root(j)
    found: dict[int, list[int]] = {}
    for i in range(len(reports)):
        found.setdefault(root(i), []).append(i)
    return list(found.values())


def judge_reports(reports: list[dict]) -> None:
    """Judge the validation-loss tests of each group of `reports` sharing runs as one Holm family (in place), and
    record the family in each of its reports: `holm_family` = {"sections": the group's section keys, sorted,
    "tests": m}."""
    for group in groups(reports):
        cells = [found for i in group for found in tests(reports[i])]
        m = judge([cell for cell, _ in cells], [key for _, key in cells])
        sections = sorted(section_key(reports[i]) for i in group)
        for i in group:
            reports[i]["holm_family"] = {"sections": list(sections), "tests": m}


def family_of(report: dict) -> dict:
    """The report's recorded family; a report from before families were recorded was judged alone."""
    if "holm_family" in report:
        return report["holm_family"]
    return {"sections": [section_key(report)], "tests": len({key for cell, key in tests(report) if cell.get("p")
                                                             is not None})}
