"""Every figure of BENCHMARKS.md's generated sections comes from a file: each measured section is its JSON report
under benchmarks/ rendered by the command that wrote it (a section without its report, or a number edited by
hand, fails), under its "stale since <commit>" label where it has one (tests/integration/test_staleness.py), each
report's tokens/s agree with its own raw figures and stay under its hardware's peak for the FLOPs it counts, its
ratios are paired within its rounds, the planner's sections are what the planner renders now, and the prose between
the sections states no figure that a section does not hold."""

import json
import math
import re
import shutil
import statistics

import pytest
from helpers.common import ROOT

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.flops import training_flops_per_token
from adaptive_ds.hardware import DEVICES, gpu_key
from adaptive_ds.presets import PRESETS, model_config
from adaptive_ds.tools.acceptance import TARGETS
from adaptive_ds.tools.benchmark import CASES, RATIOS, markdown, paired_ratios, restate
from adaptive_ds.tools.report import section_stem
from adaptive_ds.tools.staleness import unlabelled

BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()
SECTIONS = dict(re.findall(r"^<!-- ([\w:.-]+) -->\n(.*?)\n<!-- /\1 -->$", BENCHMARKS, flags=re.S | re.M))
# Rendered by the planner from its model of memory and speed (and its table of measured peaks, each row naming its
# source), not from one run's report: checked against what the planner renders now.
PLANNER = ("plan:validation", "plan:projections")
MEASURED = [key for key in SECTIONS if key not in PLANNER]
# A bound no CPU core reaches: 4 GHz x 2 FMA units x 16 fp32 lanes (AVX-512) x 2 FLOPs, per core.
CPU_CORE_PEAK_TFLOPS = 4e9 * 2 * 16 * 2 / 1e12


def _render(key: str, report: dict) -> str:
    """The section the command that wrote `report` renders from it."""
    kind = key.split(":")[0]
    if kind == "grid":
        from adaptive_ds.tools.grid_tables import markdown
    elif kind == "throughput":
        from adaptive_ds.tools.benchmark import markdown
    elif kind == "generate":
        from adaptive_ds.tools.benchmark import generation_markdown as markdown
    elif kind == "data":
        from adaptive_ds.tools.data_benchmark import markdown
    elif kind == "loss-breakdown":
        from adaptive_ds.tools.loss_breakdown import markdown
    elif kind == "acceptance":
        from adaptive_ds.tools.acceptance import markdown
    elif kind == "quickstart":
        from adaptive_ds.tools.quickstart import markdown
    elif kind == "realsize":
        from adaptive_ds.tools.realsize import markdown
    elif kind == "ops-build":
        from adaptive_ds.tools.build_ops import markdown
    elif kind == "text-budget":
        from adaptive_ds.tools.text_budget import markdown
    else:
        raise AssertionError(f"BENCHMARKS.md section {key}: no command renders a section of this kind")
    return markdown(report)


def _report(key: str) -> dict:
    path = ROOT / "benchmarks" / f"{section_stem(key)}.json"
    if not path.exists() and key.startswith("throughput:") and key.endswith(":gpu"):
        # the GPU acceptance command writes the throughput section from its own report's benchmark stage
        acceptance = ROOT / "benchmarks" / "acceptance_gpu.json"
        if acceptance.exists():
            return json.loads(acceptance.read_text())["stages"]["benchmark"]
    assert path.exists(), f"BENCHMARKS.md section {key} has no report benchmarks/{path.name}: its figures are unbacked"
    return json.loads(path.read_text())


def _peak_tflops(report: dict) -> float:
    """The peak of the hardware a report names: its GPUs' (the hardware table), or a bound on its CPU cores."""
    gpu = report.get("gpu")
    if gpu:
        return DEVICES[gpu].peak_tflops
    cores = re.search(r"(\d+) cores", report["machine"])
    assert cores and "no GPU" in report["machine"], f"a report without a known device: {report['machine']!r}"
    return int(cores.group(1)) * CPU_CORE_PEAK_TFLOPS


@pytest.mark.parametrize("key", MEASURED)
def test_each_measured_section_is_its_committed_report_rendered(key):
    """Under its staleness label, where it has one: that the label is there exactly when git says the code the
    section measures changed after its commit is tests/integration/test_staleness.py's (git is a process)."""
    section = SECTIONS[key]
    assert "Measured" in section and "commit" in section and "`python -m adaptive_ds." in section, key
    assert unlabelled(section) == _render(key, _report(key)), (
        f"BENCHMARKS.md section {key} differs from its report rendered; regenerate it from "
        f"benchmarks/{section_stem(key)}.json (--restate for a throughput report), or rerun its command")


def test_the_measured_sections_are_there():
    kinds = {key.split(":")[0] for key in MEASURED}
    assert {"grid", "throughput"} <= kinds and "grid:debug:embedded-hard" in MEASURED


@pytest.mark.parametrize("key", [key for key in MEASURED if key.startswith("grid:")])
def test_grid_tokens_per_s_are_the_runs_own_and_under_the_peak(key):
    report = _report(key)
    peak = _peak_tflops(report)
    for row in report["runs"]:
        busy = row["time_breakdown_s"]["data"] + row["time_breakdown_s"]["train"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / busy, rel=1e-9), row["variant"]
        assert row["tokens_per_s"] * (row["training_flops"] / row["tokens"]) / 1e12 < peak, row["variant"]
    for name, result in report["results"].items():  # what the section shows: the mean over the variant's seeds
        seeds = [r["tokens_per_s"] for r in report["runs"] if r["variant"] == name]
        assert result["tokens_per_s"]["mean"] == pytest.approx(statistics.mean(seeds), rel=1e-9), name


GRIDS = [key for key in MEASURED if key.startswith("grid:")]


@pytest.fixture(scope="module")
def restated_grids() -> dict[str, dict]:
    """Every published grid report restated together, as the published sections are: reports sharing runs are one
    Holm family."""
    from adaptive_ds.tools.grid import restate

    return dict(zip(GRIDS, restate([_report(key) for key in GRIDS]), strict=True))


@pytest.mark.parametrize("key", GRIDS)
def test_grid_verdicts_are_this_versions_tests_of_the_recorded_runs(key, restated_grids):
    """A change of the statistics reaches every published grid: its comparisons are what the code works out from
    its runs now, judged with every published report sharing its runs (python -m adaptive_ds.tools.grid --restate
    benchmarks/grid_*.json --benchmarks_md BENCHMARKS.md), and the family it records is that one."""
    report = _report(key)
    assert restated_grids[key] == report, "restate every published grid report together (benchmarks/grid_*.json)"
    assert set(report["holm_family"]["sections"]) <= set(GRIDS), "a report of the family is not published"


@pytest.mark.parametrize("key", [key for key in MEASURED if key.split(":")[0] in ("throughput", "generate")])
def test_benchmark_tokens_per_s_are_the_rounds_own_and_under_the_peak(key):
    report = _report(key)
    peak = _peak_tflops(report) if "no GPU" in report["machine"] else DEVICES[gpu_key(report["device"])].peak_tflops
    vocab = len(embedded_tokenizer())
    for name, result in report["results"].items():
        assert result["tokens_per_s"] == pytest.approx(statistics.median(result["rounds"]), rel=1e-9), name
        overrides = {k: v for k, v in CASES[name].model.items() if k != "arch"}
        config = model_config(report["preset"], CASES[name].model["arch"], vocab, moe_drop_tokens=False, **overrides)
        # every token through every block: at least what a routed model computes
        flops = training_flops_per_token(config, PRESETS[report["preset"]].seq_len)
        if key.startswith("throughput:"):
            if name.split("_")[0] in ("dense", "hf", "moe"):  # no MoD routing: the FLOPs are the config's
                assert result["flops_per_token"] == pytest.approx(flops, rel=1e-9), name
            assert result["tokens_per_s"] * result["flops_per_token"] / 1e12 < peak, name
        else:  # generation: a forward pass, a third of a training step's FLOPs at most
            assert result["tokens_per_s"] * flops / 3 / 1e12 < peak, name
    if key.startswith("throughput:"):  # paired, as this version works them out from the recorded rounds
        assert restate(report) == report, f"python -m adaptive_ds.tools.benchmark --restate {section_stem(key)}.json"
    else:
        rounds = paired_ratios(report["results"], [(name, "dense") for name in report["results"] if name != "dense"])
        assert report["ratios"] == {name: statistics.median(values) for name, values in rounds.items()}


@pytest.mark.parametrize("key", [key for key in MEASURED if key.startswith("throughput:")])
def test_a_throughput_section_not_labelled_stale_has_five_rounds_after_a_warmup_round(key):
    """A section of the code as it is holds at least 5 rounds, counted after a warm-up round like them; one
    labelled stale (or whose staleness its history cannot tell) waits to be measured again."""
    report = _report(key)
    if unlabelled(SECTIONS[key]) != SECTIONS[key]:
        pytest.skip(f"{key}: {SECTIONS[key].splitlines()[0]}")
    assert report["rounds"] >= 5 and report.get("warmup_steps") == report["steps_per_round"], key


# The throughput report of commit 20b32a5, as the benchmark then wrote it: each ratio the ratio of two cases'
# medians over the rounds, taken from different rounds.
OLD_REPORT = ROOT / "tests" / "fixtures" / "throughput_debug_cpu_20b32a5.json"


def test_the_ratios_are_paired_within_rounds_not_medians_of_different_rounds():
    """Worked by hand from the 20b32a5 report's rounds: dense / hf_llama was 0.73, 0.97 and 1.07 in its three rounds
    and hybrid / moe 10.56, 1.44 and 1.57; that version published the ratios of the medians, 1.07x and 1.65x, the
    second of which no round gave. A report of that version renders with the paired ratios."""
    old = json.loads(OLD_REPORT.read_text())
    assert "ratio_rounds" not in old and "warmup_steps" not in old
    assert f"{old['ratios']['dense/hf_llama']:.2f}" == "1.07" and f"{old['ratios']['hybrid/moe']:.2f}" == "1.65"
    rounds = paired_ratios(old["results"], RATIOS)
    assert [f"{r:.2f}" for r in rounds["dense/hf_llama"]] == ["0.73", "0.97", "1.07"]
    assert [f"{r:.2f}" for r in rounds["hybrid/moe"]] == ["10.56", "1.44", "1.57"]
    restated = restate(old)
    assert [f"{restated['ratios'][name]:.2f}" for name in ("dense/hf_llama", "hybrid/moe")] == ["0.97", "1.57"]
    assert restated["ratio_rounds"] == rounds and restated["results"] == old["results"]
    section = markdown(old)
    assert section == markdown(restated)
    assert "| dense / hf_llama | 0.97x | 0.73x – 1.07x | 0.73x, 0.97x, 1.07x |" in section
    assert "| hybrid / moe | 1.57x | 1.44x – 10.56x | 10.56x, 1.44x, 1.57x |" in section
    assert "| median of 3 rounds |" in section and "1.65" not in section
    assert "after a warm-up of 3 optimizer steps per case, not a full round, not counted" in section


def test_a_hand_edited_figure_or_a_missing_report_fails():
    """The check above would catch what it exists for: a tokens/s figure doubled in the text, and a section whose
    report is not committed."""
    key = next(k for k in MEASURED if k.startswith("grid:"))
    section, report = SECTIONS[key], _report(key)
    mean = report["results"]["dense"]["tokens_per_s"]["mean"]
    shown = f"{mean:,.0f}"
    assert f"| dense | {shown} " in section
    doubled = section.replace(f"| dense | {shown} ", f"| dense | {2 * mean:,.0f} ", 1)
    assert doubled != _render(key, report)
    with pytest.raises(AssertionError, match="has no report"):
        _report("grid:debug:embedded-hard:no-such-grid")


def test_the_planner_sections_are_what_the_planner_renders(tmp_path):
    from adaptive_ds.tools.plan import write_benchmarks

    copy = tmp_path / "BENCHMARKS.md"
    shutil.copy(ROOT / "BENCHMARKS.md", copy)
    write_benchmarks(str(copy))
    assert copy.read_text() == BENCHMARKS, "regenerate them: python -m adaptive_ds.tools.plan --write BENCHMARKS.md"


def test_projections_are_labelled_and_stay_under_the_gpu_peak():
    section = SECTIONS["plan:projections"]
    assert "not measurements" in section
    presets = re.findall(r"\*\*(\w+)\*\*", section)
    tables = [block for block in re.findall(r"(?:^\|.*\|\n?)+", section, flags=re.M)]
    assert presets == ["debug_200m", "b1", "b7"] and len(tables) == len(presets)
    for preset, table in zip(presets, tables, strict=True):
        lines = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.strip().splitlines()]
        header, rows = lines[0], lines[2:]
        bound, projected = header.index("tokens/s bound"), header.index("projected tokens/s")
        for row in rows:
            gpus, gpu = re.match(r"(\d+) x (\w+),", row[header.index("hardware, config")]).groups()
            config = model_config(preset, row[0], 32000)
            flops = training_flops_per_token(config, PRESETS[preset].seq_len)
            limit = int(gpus) * DEVICES[gpu].peak_tflops * 1e12 / flops
            number = [float(re.sub(r"[^0-9.]", "", row[i])) for i in (projected, bound)]
            assert number[0] <= number[1] <= limit * 1.001 and not math.isnan(number[0]), (preset, row[0], gpu)


# The prose (BENCHMARKS.md outside the generated sections, their markers, inline code and fenced code) states no
# figure of its own: each one it states appears, as written, in a generated section, so regenerating a section cannot
# leave the prose holding an old figure, and no figure is worked out by hand (a ratio, a difference, a rounding).
# A figure is a number written as a measurement: with a decimal point or an exponent (1.8656, 7.12e+12, 1.1B), with
# thousands separators (14,358), as a percentage (87.5%), a ratio (1.07x, 6x) or a dollar amount ($0.09), or followed
# by a unit of time, memory or rate (38.5 training seconds, 40 h, 15 GiB, 100 tokens/s). Any other plain integer is
# a count or a setting named by the runs' commands, not a figure: 3 seeds, 2 cores, 8 experts, 489 optimizer steps,
# 500k tokens. The GPU targets' thresholds (12 GiB, 1.3x) are requirements, allowed as `TARGETS` states them (the
# targets table is TARGETS' names: tests/unit/test_acceptance.py).
NUMBER = re.compile(
    r"(?<![\w.$])(?P<dollar>\$)?(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)*(?:e[+-]?\d+)?[kMBT]?)"
    r"(?![\w.,]\d)(?P<unit>%|x\b|\s?(?:GiB|GB|MB|s|ms|seconds?|training seconds|minutes?|hours?|h|days?|"
    r"tokens/s|TFLOP/s)(?![\w/]))?")


def _figures(text: str) -> set[str]:
    """The figures `text` states, each as its digits are written (sign, unit and magnitude words aside)."""
    found = set()
    for match in NUMBER.finditer(text):
        number = match.group("number")
        if match.group("dollar") or match.group("unit") or re.search(r"[.,e]", number):
            found.add(number)
    return found


def _prose(text: str) -> str:
    """`text` with its generated sections, fenced code and inline code blanked (their line breaks kept, so every
    line keeps its number)."""
    def blank(match: re.Match) -> str:
        return "\n" * match.group(0).count("\n")

    text = re.sub(r"^<!-- ([\w:.-]+) -->\n.*?\n<!-- /\1 -->$", blank, text, flags=re.S | re.M)
    text = re.sub(r"^```.*?^```", blank, text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", blank, text)  # an inline code span may run over a line break


def _unbacked(text: str) -> list[str]:
    sections = dict(re.findall(r"^<!-- ([\w:.-]+) -->\n(.*?)\n<!-- /\1 -->$", text, flags=re.S | re.M))
    # every number a section or a target shows, figure or not (a table cell's "833" under a tokens/s header)
    held = {m.group("number") for text in [*sections.values(), *(t.name for t in TARGETS)]
            for m in NUMBER.finditer(text)}
    return [f"line {number}: {figure}" for number, line in enumerate(_prose(text).splitlines(), start=1)
            for figure in sorted(_figures(line) - held)]


def test_the_prose_states_only_figures_the_sections_hold():
    assert _unbacked(BENCHMARKS) == [], "state these as a section holds them, or cite the section's row instead"


@pytest.mark.parametrize(("prose", "figures"), [
    ("tokens/s 14,358 against 13,214", {"14,358", "13,214"}), ("1.07x, 6x the parameters", {"1.07", "6"}),
    ("0.097 ± 0.034 nats", {"0.097", "0.034"}), ("ends 44% lower", {"44"}), ("7.12e12 FLOPs", {"7.12e12"}),
    ("an independent 1.10B Llama", {"1.10B"}), ("$0.09/hour", {"0.09"}), ("39 s, 40 h, 15 GiB", {"39", "40", "15"}),
    ("3 seeds on 2 cores, 8 experts, 489 optimizer steps, 500k tokens at 2M", set()),
    ("b1 on an H200, top-2 of x86_64, ZeRO-3, fp16, 8 x 2048 tokens, embedded:hard", set()),
])
def test_what_counts_as_a_figure(prose, figures):
    assert _figures(prose) == figures


def test_a_figure_the_sections_do_not_hold_is_named_with_its_line():
    key = "throughput:debug:cpu"
    section = f"<!-- {key} -->\n{SECTIONS[key]}\n<!-- /{key} -->"
    held = re.search(r"\| (\d\.\d\d)x \| ", SECTIONS[key]).group(1)  # a ratio the section holds
    absent = next(f"{v / 100:.2f}" for v in range(300, 999) if f"{v / 100:.2f}" not in SECTIONS[key])
    prose = f"Dense is {held}x transformers' Llama, and {absent}x its eager speed."
    text = f"# T\n\n{section}\n\n{prose}\n"
    assert _unbacked(text) == [f"line {text.splitlines().index(prose) + 1}: {absent}"]


def _row_label_problems(text: str) -> list[str]:
    """Rows of the Conclusions whose "stale since" labels are not those of the sections they link: each row citing
    a section labelled stale carries its label, and no other row carries one."""
    sections = dict(re.findall(r"^<!-- ([\w:.-]+) -->\n(.*?)\n<!-- /\1 -->$", text, flags=re.S | re.M))
    stale = {key: found.group(1) for key, section in sections.items()
             if (found := re.match(r"\*\*stale since ([0-9a-f]+)\*\*: ", section))}
    conclusions = text.split("\n## Conclusions\n")[1].split("\n## ")[0]
    problems = []
    for row in (line for line in conclusions.splitlines() if line.startswith("| ") and "](#" in line):
        cited = re.findall(r"\[`([\w:.-]+)`\]\(#", row)
        wanted = {stale[key] for key in cited if key in stale}
        if set(re.findall(r", \*\*stale since ([0-9a-f]+)\*\*", row)) != wanted:
            problems.append(f"{row[:60]}...: labels {sorted(wanted)}")
    return problems


def test_each_conclusion_row_carries_the_stale_labels_of_the_sections_it_cites():
    assert _row_label_problems(BENCHMARKS) == [], "render the section again (its command, or --restate)"


def test_a_row_without_its_sections_label_or_with_a_label_of_its_own_is_named():
    from adaptive_ds.tools.staleness import Staleness, label_rows

    key = "throughput:debug:cpu"
    state = Staleness("20b32a5", ("adaptive_ds/models",), since="abc1234")
    section = f"<!-- {key} -->\n{state.label}\n\nMeasured ...\n<!-- /{key} -->"
    row = f"| dense / hf_llama | 0.97x | [`{key}`](#throughputdebugcpu) |"
    text = f"# B\n\n## Conclusions\n\n| q | r | section |\n|---|---|---|\n{row}\n\n## Evidence\n\n{section}\n"
    assert len(_row_label_problems(text)) == 1  # the section is labelled, its row not
    labelled = label_rows(text, key, state)
    assert "(#throughputdebugcpu), **stale since abc1234** |" in labelled and _row_label_problems(labelled) == []
    assert label_rows(labelled, key, state) == labelled  # labelled once
    fresh = labelled.replace(f"{state.label}\n\n", "")
    assert len(_row_label_problems(fresh)) == 1  # a row labelled stale whose section is not
    measured_again = label_rows(fresh, key, Staleness("20b32a5", state.paths))  # the row's label goes
    assert measured_again == text.replace(f"{state.label}\n\n", "") and _row_label_problems(measured_again) == []
    assert label_rows(labelled, key, Staleness("20b32a5", state.paths, unknown="no history")) == labelled


def test_restate_rewrites_a_reports_ratios_from_its_rounds_and_a_bad_file_leaves_every_report_as_it_was(
        tmp_path, capsys):
    from adaptive_ds.tools.benchmark import main

    old, bad = tmp_path / "throughput_debug_cpu.json", tmp_path / "grid.json"
    old.write_bytes(OLD_REPORT.read_bytes())
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(SystemExit, match=r"error: --restate .*grid.json: not a throughput report"):
        main(["--restate", str(old), str(bad)])
    assert old.read_bytes() == OLD_REPORT.read_bytes()
    main(["--restate", str(old)])
    assert json.loads(old.read_text()) == restate(json.loads(OLD_REPORT.read_text()))
    assert capsys.readouterr().out.strip() == f"restated {old}"
