"""Benchmark grid: variants (an architecture and its options) x seeds, trained side by side on the same data.

    python -m adaptive_ds.tools.grid --preset debug --tokens 1000000 --data embedded --seeds 1 2 3
    python -m adaptive_ds.tools.grid --variants dense moe moe:dropless 'moe+{"router_aux_loss_coef": 0}' mod mod:half
    python -m adaptive_ds.tools.grid --preset debug_200m --ds_config ds_configs/debug_200m_t4.json   (on a GPU)

A variant is an architecture plus overrides of its model config (and of the controller's settings): a name of
`adaptive_ds.presets.VARIANTS` (`python -m adaptive_ds.presets` lists them), or such a name followed by ``+`` and a
JSON object of AdaptiveDSConfig fields (a ``"controller"`` key inside it holds ControllerSettings fields). Each
variant x seed is a separate training run of the full harness (`python -m adaptive_ds.training`, the DeepSpeed
engine, the given ds_config and --data), one after another on the same machine, each in its own process so that its
peak memory and time breakdown are its own. A run's directory under --runs is named after its exact settings, so the
same command continues an interrupted grid: a run whose summary.json exists is kept, not retrained; a failed run is
reported with the end of its log, the others go on, and the next invocation retries it.

From each run's summary.json and metrics.jsonl the grid reports, per variant, the mean and the standard deviation
across seeds (`spread`) of:

- quality: validation loss (MoD and hybrid: causal routing, the honest figure; and with the train-time top-k)
  with each run's own standard error, loss minus the entropy floor (on data that has one), and the train loss
  at equal training FLOPs, at equal tokens and at equal training seconds: each run's train-loss curve
  interpolated at the smallest total any run of the grid reached;
- speed and cost: training tokens/s (data and train phases), MFU on a GPU of the hardware table (achieved
  TFLOP/s on a CPU, where no peak is agreed), peak memory, wall time, the time breakdown, the run's cost and
  the cost per 1B tokens at the device's $/hour (`adaptive_ds.hardware.DEVICES`, or --price);
- routing: expert utilisation, load balance and dropped share (MoE), skip rate and FLOPs reduction (MoD);
- against the baseline (dense): each quality figure's difference with its standard deviation, paired by seed
  where both have two or more seeds in common (`difference`), and the mean's 95% confidence interval; for the
  validation loss the paired t-test's two-sided p-value and a verdict: better or worse where that p,
  Holm-corrected over its family, is below 0.05, else a tie with the smallest difference its seeds could have
  detected at 80% power and the corrected level (tools/significance.py). The family is every validation-loss test
  drawn from one set of runs: a report's comparisons and its --pair comparisons, and with --restate those of the
  reports given that share its runs (tools/grid_family.py). The train losses at equal budgets are descriptive.

The report records the data's content hash (`adaptive_ds.data.identity`: a prepared directory's token shards and
tokenizer, the embedded generator's output, local files' bytes; none for a streamed Hub dataset), worked out once per
invocation, and `--extend` refuses a report whose recorded hash differs from its --data's, or whose device (GPU
kind, peak TFLOP/s) or price differs from this machine's. Its section states the hash and the compute its runs spent
(their wall times summed, in CPU- or GPU-hours: one process each).

It writes the report `grid_<preset>_<data>[_<name>].json` (each run's row with its loss curve, 50 points at most)
and loss-vs-FLOPs, -seconds and -tokens PNGs (mean over the seeds, band min..max, drawn from the report's rows: an
extended report's figures show every seed) into --out, and prints the Markdown tables; the tables go into a Markdown
file between ``<!-- grid:<preset>:<data>[:<name>] -->`` markers only when --benchmarks_md names one. Nothing a user runs
writes into the repository's committed results unless asked: by default the report lands in the runs directory
(`runs/grid/report/`); publishing is `--out benchmarks --benchmarks_md BENCHMARKS.md`, with `--name` to keep a
grid's section apart from the others of its preset and data (recorded in the section's command, so the command
regenerates that section). Run directories are recorded relative to --runs, so a report names no path of the
machine that made it. What a grid trains (its variants, each run's command line and directory) is
tools/grid_spec.py's; training and reading one run, tools/grid_runs.py's; the statistics, tables and plots,
tools/grid_tables.py's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex

from .. import ds_config as ds_config_reader
from .. import pretrained
from ..data import EMBEDDED
from ..data.identity import data_identity
from ..hardware import DEVICES, detect_device
from ..markdown_sections import replace_section
from ..presets import ARCHITECTURES, PRESETS, VARIANTS
from .grid_family import family_of, judge_reports, section_key
from .grid_runs import GridError, budgets, execute, load_run, run_row
from .grid_spec import GridSpec, parse_variant
from .grid_tables import BUDGETS, RUN_KEYS, aggregate, compare, downsample, markdown, plot
from .report import check_markdown_path, check_name, section_stem, write_report

logger = logging.getLogger(__name__)


def _device(price: float | None) -> tuple[str | None, float | None, float | None]:
    """(GPU key or None, peak TFLOP/s or None, $/hour or None) of this machine."""
    key = detect_device()  # None: a GPU the hardware table does not know (no peak, no price)
    device = DEVICES.get(key)
    if price is None and device is not None:
        price = device.price_per_hour
    return (key if key != "cpu" else None), (device.peak_tflops if device else None), price


def run_grid(spec: GridSpec, out_dir: str, runs_dir: str, price: float | None = None,
             report_only: bool = False, extend: dict | None = None, data_hash: dict | None = None) -> dict:
    """Train (or keep) every variant x seed of `spec`, then write the JSON report and the plots into `out_dir`;
    returns the report. Failed runs are listed in it; GridError when none finished. `report_only`: train nothing,
    report the runs that finished and list the others as not run. Run directories and logs are recorded relative to
    `runs_dir`. `extend`: an earlier report of this grid (`check_extension`), whose rows are kept as they are (their
    run directories need not exist) and whose budgets the new runs are read at: only the variant x seed pairs it
    lacks train. `data_hash`: `data_identity(spec.data)`, worked out here when not given (the command works it out
    once for all its presets)."""
    if data_hash is None:
        try:
            data_hash = data_identity(spec.data)
        except ValueError as error:
            raise GridError(str(error)) from None
    earlier = {(r["variant"], r["seed"]) for r in extend["runs"]} if extend else set()
    failed_before = {(f["variant"], f["seed"]) for f in extend["failed"]} if extend else set()
    finished, failed, not_run = [], [], []
    for variant in spec.variants:
        for seed in spec.seeds:
            if (variant.name, seed) in earlier:
                continue
            run_dir = spec.run_dir(runs_dir, variant, seed)
            kept = os.path.exists(os.path.join(run_dir, "summary.json"))
            if report_only and not kept:  # an earlier failure not retried stays listed as failed, not as not run
                if (variant.name, seed) not in failed_before:
                    not_run.append({"variant": variant.name, "seed": seed})
                continue
            failure = execute(spec.training_args(variant, seed), run_dir)
            entry = {"variant": variant.name, "seed": seed, "run_dir": os.path.relpath(run_dir, runs_dir)}
            if failure:
                logger.error("grid: %s seed %d failed (exit %d); log %s", variant.name, seed, failure["exit"],
                             failure["log"])
                failed.append({**entry, **failure, "log": os.path.relpath(failure["log"], runs_dir)})
            else:
                finished.append({**entry, "kept": kept, **load_run(run_dir)})
    if not finished and not extend:
        raise GridError("no run finished; the first failure's log ends:\n" + failed[0]["log_tail"] if failed else
                        f"no run of this grid has finished in {runs_dir} (--report_only trains nothing)")
    report = {**assemble(spec, finished, failed, *_device(price), extend=extend, data_hash=data_hash),
              "not_run": not_run}
    # a continuation grid's figures show the continuations: a from-scratch curve starts elsewhere
    scratch = {v.name for v in spec.variants if spec.init_from is not None and v.scratch}
    drawn = [r for r in report["runs"] if r["variant"] not in scratch]
    curves = {}
    if drawn and all("curve" in r for r in drawn):  # every seed's curve, the earlier ones' from the report's rows
        for r in drawn:
            curves.setdefault(r["variant"], []).append(r["curve"])
        report["figure_seeds"] = sorted({r["seed"] for r in drawn})
    elif drawn:  # rows of a report from before they held curves: its figures stay as they were drawn
        report["figure_seeds"] = extend.get("figure_seeds") or sorted({r["seed"] for r in extend["runs"]})
        logger.warning("grid: the earlier report's rows hold no loss curve: its figures are kept as they were")
    path = write_report(out_dir, spec.key, report)
    logger.info("grid: report %s", path)
    if curves:  # none when every continuation failed: the report and its tables still stand
        plot(curves, report["entropy_floor"], os.path.join(out_dir, section_stem(spec.key)))
    return report


# What must match between a grid and the earlier report it extends: the same runs but for their seeds.
_EXTENSION_KEYS = ("preset", "data", "name", "tokens", "baseline", "variants", "ds_config", "init_from")


def check_extension(spec: GridSpec, report: dict, data_hash: dict | None = None,
                    device: tuple[str | None, float | None, float | None] | None = None) -> None:
    """ValueError unless `report` is an earlier report of `spec`'s grid (the same settings, seeds aside) whose seeds
    --seeds includes, whose data hash, where it recorded one, is `data_hash`'s (the same --data path holding
    another corpus), and whose device, where `device` (this machine's GPU key, peak TFLOP/s and $/hour: `_device`) is
    given, is this one: adding seeds must not change what the earlier runs were, nor mix devices in its figures."""
    ours = {"preset": spec.preset, "data": spec.data, "name": spec.name, "tokens": spec.tokens,
            "baseline": spec.baseline, "ds_config": spec.ds_config, "init_from": spec.init_from,
            "variants": {v.name: {"arch": v.arch, "model": v.model, "controller": v.controller}
                         for v in spec.variants}}
    differing = [key for key in _EXTENSION_KEYS if ours[key] != report.get(key)]
    if differing:
        raise ValueError(f"it is another grid: its {', '.join(differing)} differ from this command's")
    if _without_seeds(spec.command()) != _without_seeds(report["command"]):
        raise ValueError(f"its command differs beyond the seeds: {report['command']}")
    missing = sorted(set(report["seeds"]) - set(spec.seeds))
    if missing:
        raise ValueError(f"--seeds leaves out its seeds {', '.join(map(str, missing))}; name them all")
    recorded = report.get("data_hash")
    if recorded is not None and data_hash is not None and recorded["sha256"] != data_hash["sha256"]:
        raise ValueError(f"its data hashed sha256 {recorded['sha256']}, --data {spec.data} now hashes "
                         f"{data_hash['sha256']}: the new seeds would train on another corpus; restore the one it "
                         "recorded, or run a new grid")
    if device is not None:
        recorded = (report.get("gpu"), report.get("peak_tflops"), report.get("price_per_hour"))
        differ = [f"{name} {theirs!r} (this machine: {ours!r})" for name, theirs, ours
                  in zip(("gpu", "peak_tflops", "price_per_hour"), recorded, device, strict=True) if theirs != ours]
        if differ:
            raise ValueError(f"it was measured on another device: its {', '.join(differ)}; its speed, MFU and costs "
                             "would mix devices: extend it on its own kind of machine (and --price), or run a new grid")


def _without_seeds(command: str) -> list[str]:
    """A grid command's words from --preset on (the module moved once), without its seeds."""
    words = shlex.split(command)
    words = words[words.index("--preset"):] if "--preset" in words else words
    start = words.index("--seeds") + 1 if "--seeds" in words else len(words)
    end = next((i for i in range(start, len(words)) if words[i].startswith("--")), len(words))
    return words[:start] + words[end:]


def assemble(spec: GridSpec, finished: list[dict], failed: list[dict], gpu: str | None, peak_tflops: float | None,
             price: float | None, extend: dict | None = None, data_hash: dict | None = None) -> dict:
    """The report of a grid: `finished` holds each finished run's name (RUN_KEYS) and `load_run` record,
    `failed` each failure of `execute` with the variant and seed; `extend` an earlier report whose rows and budgets
    it keeps (`run_grid`); `data_hash` the data's `data_identity` (an earlier report that recorded none: its seeds
    are listed as unchecked)."""
    # Equal-budget figures are read at what every run on the grid's own budget reached: a variant with a smaller
    # budget of its own (an iso-FLOP baseline) is compared by its validation loss, not by moving that point.
    # A from-scratch arm of a continuation grid is never read at them: its curve starts from random weights, the
    # continuations' from the base model; its validation loss compares.
    scratch = {v.name for v in spec.variants if spec.init_from is not None and v.scratch}
    own_budget = {v.name for v in spec.variants if v.tokens is not None} | scratch
    at = extend["budgets"] if extend else budgets([r for r in finished if r["variant"] not in own_budget]
                                                  or [r for r in finished if r["variant"] not in scratch] or finished)
    rows = [{**{k: r[k] for k in RUN_KEYS}, **run_row(r, at, peak_tflops, price), "curve": downsample(r["curve"])}
            for r in finished]
    for row in rows:
        if row["variant"] in scratch:
            row.update({f"train_loss_at_equal_{name}": None for name, _, _ in BUDGETS})
    if extend:  # the earlier rows first, then the new seeds', in the grid's order
        order = {(v.name, s): i for i, (v, s) in enumerate((v, s) for v in spec.variants for s in spec.seeds)}
        rows = sorted([*extend["runs"], *rows], key=lambda r: order[(r["variant"], r["seed"])])
        done = {(r["variant"], r["seed"]) for r in rows}
        again = {(f["variant"], f["seed"]) for f in failed}
        failed = [*[f for f in extend["failed"] if (f["variant"], f["seed"]) not in done | again], *failed]
    floors = [r["entropy_floor"] for r in rows]
    names = [v.name for v in spec.variants if any(r["variant"] == v.name for r in rows)]
    if extend and data_hash is not None:  # seeds trained before the hash was recorded stay listed as unchecked
        unchecked = extend["seeds"] if extend.get("data_hash") is None else extend["data_hash"].get("unchecked_seeds")
        if unchecked:
            data_hash = {**data_hash, "unchecked_seeds": list(unchecked)}
    report = {
        "preset": spec.preset, "data": spec.data, "data_name": spec.data_name, "data_hash": data_hash,
        "name": spec.name, "tokens": spec.tokens,
        "seeds": list(spec.seeds), "baseline": spec.baseline,
        "variants": {v.name: {"arch": v.arch, "model": v.model, "controller": v.controller} for v in spec.variants},
        "entropy_floor": None if None in floors else sum(floors) / len(floors), "budgets": at,
        **provenance(rows), "gpu": gpu, "peak_tflops": peak_tflops, "price_per_hour": price,
        "ds_config": spec.ds_config, "init_from": spec.init_from, "command": spec.command(), "runs": rows,
        "failed": failed,
        "results": {name: aggregate([r for r in rows if r["variant"] == name]) for name in names},
        "comparisons": compare(rows, spec.baseline),
        "pairs": compare_pairs(rows, spec.pairs),
    }
    judge_reports([report])  # its own family: reports sharing its runs are judged together by --restate
    return report


def provenance(rows: list[dict]) -> dict:
    """Where, when and from what code a report's runs trained: its machines, commits and dates (one date, or a range)
    over the runs that recorded them, and how many did not: `runs_without_provenance` (a run kept from a grid that
    stopped before writing its grid_provenance.json records "unknown" for all three) and `runs_without_commit` (a run
    trained outside a git checkout)."""
    known = [r["trained"] for r in rows if "unknown" not in (r["trained"]["date"], r["trained"]["machine"])]
    trained = {k: sorted({t[k] for t in known} - {"unknown"}) for k in ("commit", "machine", "date")}
    return {"machine": "; ".join(trained["machine"]), "commit": ", ".join(trained["commit"]),
            "date": " to ".join(dict.fromkeys(trained["date"][:1] + trained["date"][-1:])),
            "runs_without_provenance": len(rows) - len(known),
            "runs_without_commit": sum(t["commit"] == "unknown" for t in known)}


def compare_pairs(rows: list[dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """Each `variant` against its `baseline` (--pair), as `compare` has it (the verdicts are the family's, with the
    comparisons against the baseline: `judge_reports`); "missing" names a side without a finished run."""
    out = []
    for variant, baseline in pairs:
        missing = [name for name in (variant, baseline) if not any(r["variant"] == name for r in rows)]
        if missing:
            out.append({"variant": variant, "baseline": baseline, "missing": missing})
            continue
        both = [r for r in rows if r["variant"] in (variant, baseline)]
        out.append({"variant": variant, "baseline": baseline, **compare(both, baseline)[variant]})
    return out


def restate(reports: list[dict]) -> list[dict]:
    """The reports with their comparisons, pairs and provenance worked out anew from their runs' rows by this
    version's statistics (a change of the verdict rule reaches a published report without its runs), the reports
    sharing runs judged as one Holm family (`judge_reports`); nothing else changes."""
    out = []
    for report in reports:
        pairs = [(p["variant"], p["baseline"]) for p in report.get("pairs") or []]
        out.append({**report, **provenance(report["runs"]), "comparisons": compare(report["runs"], report["baseline"]),
                    "pairs": compare_pairs(report["runs"], pairs)})
    judge_reports(out)
    return out


def _restate_files(paths: list[str], benchmarks_md: str | None) -> None:
    """--restate: rewrite the report files' comparisons (`restate`, all of them together: reports sharing runs are one
    family), and their sections where --benchmarks_md says. A report whose recorded family holds a section none of
    the files is refused: restated without it, the family would shrink."""
    reports = []
    for path in paths:
        try:
            with open(path) as f:
                reports.append(json.load(f))
            restate(reports[-1:])  # each on its own first: a file that is no grid report is named
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise SystemExit(f"error: --restate {path}: not a grid report ({error!r})") from None
    given = {section_key(r) for r in reports}
    for path, report in zip(paths, reports, strict=True):
        left = [key for key in family_of(report)["sections"] if key not in given] if "holm_family" in report else []
        if left:
            raise SystemExit(f"error: --restate {path}: its Holm family also holds section(s) {', '.join(left)} "
                             "(reports sharing its runs); pass their reports too")
    reports = restate(reports)
    for path, report in zip(paths, reports, strict=True):
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        if benchmarks_md is not None:
            write_section(benchmarks_md, report, markdown(report))
        logger.info("grid: %s restated%s", path, f", its section in {benchmarks_md}" if benchmarks_md else "")


def write_section(path: str, report: dict, text: str) -> None:
    """Replace (or append) the report's section (its preset, data and name) in the Markdown file at `path`."""
    name = f" ({report['name']})" if report.get("name") else ""
    replace_section(path, section_key(report), text,
                    f"Benchmark grid, {report['preset']} on {report['data']}{name} (measured)")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="Train variants x seeds side by side and report the tables.")
    p.add_argument("--preset", nargs="+", default=["debug"], choices=list(PRESETS),
                   help="one or more presets; each gets its own section")
    p.add_argument("--variants", nargs="+", default=list(ARCHITECTURES),
                   help=f"named variants ({', '.join(VARIANTS)}) or NAME+{{JSON of model overrides}}")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="each variant trains once per seed")
    p.add_argument("--baseline", default="dense", help="the variant the others are compared with")
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--data", default=EMBEDDED, help="as the training's --data: embedded, local files, a prepared "
                                                     "directory, ...")
    p.add_argument("--tokenizer", help="as the training's --tokenizer (text data)")
    p.add_argument("--ds_config", default="ds_configs/debug_cpu.json",
                   help="as the training's --ds_config: a path, or the name of a shipped config (debug_cpu.json)")
    p.add_argument("--warmup_steps", type=int,
                   help="learning-rate warm-up of every run (default: the ds_config's; a GPU config's 2000 steps "
                        "are meant for its 20000)")
    p.add_argument("--log_steps", type=int,
                   help="every run's logging cadence, the points of its loss curve (default: the ds_config's); a "
                        "short run needs a few steps between points to be read at the grid's budgets")
    p.add_argument("--eval_batches", type=int,
                   help="held-out batches of every run's validation loss (default: the ds_config's); more batches, "
                        "smaller standard errors")
    p.add_argument("--price", type=float, help="$ per device-hour (default: adaptive_ds/hardware.py's table)")
    p.add_argument("--runs", default="runs/grid", help="the training runs; the same directory continues a grid")
    p.add_argument("--out", help="the JSON report and PNG figures (default: RUNS/report; the repository's committed "
                                 "results: benchmarks)")
    p.add_argument("--benchmarks_md", help="also write the tables as a section of this Markdown file "
                                           "(the repository's: BENCHMARKS.md); by default no file is touched")
    p.add_argument("--name", help="a name for this grid (lower-case letters, digits, '-'): its section is "
                                  "grid:PRESET:DATA:NAME and its files grid_PRESET_DATA_NAME.*, apart from other "
                                  "grids of the same preset and data")
    p.add_argument("--init_from", help="every run starts from these pretrained weights (the training's --init_from), "
                                       "{seed} in it replaced by each run's seed, a glob matching one folder: a "
                                       "continuation of one base run per seed, e.g. "
                                       "'runs/base/debug-embedded-dense-seed{seed}-*/final'; the "
                                       "source's content enters each run's directory name, and a run's FLOPs are "
                                       "the continuation's, with the base run's beside them")
    p.add_argument("--pair", nargs=2, action="append", default=[], metavar=("VARIANT", "BASELINE"),
                   help="also compare VARIANT with BASELINE (both among --variants), in a table of pairs of their "
                        "own: e.g. a continuation with the same architecture from scratch ('moe+{\"init_from\": "
                        "null}'); repeat for more pairs")
    p.add_argument("--restate", nargs="+", metavar="REPORT",
                   help="train nothing: work each grid report's comparisons out anew from its recorded runs with "
                        "this version's statistics, the reports sharing runs judged as one Holm family, rewrite the "
                        "reports (and with --benchmarks_md their sections); pass every published report together")
    p.add_argument("--extend", metavar="REPORT",
                   help="add seeds to this earlier report of the same grid (--seeds names its seeds and the new "
                        "ones), on its kind of device and at its price: only the new seeds train; its runs' rows and "
                        "budgets are kept, and their run directories need not exist")
    p.add_argument("--report_only", action="store_true",
                   help="train nothing: report the runs that finished (a grid cut short), list the rest as not run")
    return p.parse_args(argv)


def specs(args: argparse.Namespace) -> list[GridSpec]:
    """One GridSpec per preset, every run's settings checked as its training run will check them: a bad variant,
    data or config fails here, in one line, not after hours of other runs."""
    from ..training.arguments import ConfigError, parse

    try:
        check_name(args.name)
        check_markdown_path(args.benchmarks_md)
        ds_config_reader.read(ds_config_reader.load(args.ds_config))
        variants = tuple(parse_variant(text) for text in args.variants)
    except (ds_config_reader.ConfigError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    for what, values in (("variant", [v.name for v in variants]), ("seed", args.seeds)):
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            raise SystemExit(f"error: {what}(s) {', '.join(repeated)} given twice; each trains once")
    found = [GridSpec(preset, variants, tuple(args.seeds), args.tokens, args.ds_config, args.data, args.tokenizer,
                      args.warmup_steps, args.baseline, args.eval_batches, args.name, args.init_from,
                      tuple(map(tuple, args.pair)), args.log_steps)
             for preset in args.preset]
    names = [v.name for v in variants]
    for i, pair in enumerate(args.pair):
        unknown = [name for name in pair if name not in names]
        if pair[0] == pair[1] or pair in args.pair[:i]:
            raise SystemExit(f"error: --pair {' '.join(map(shlex.quote, pair))} "
                             f"{'compares a variant with itself' if pair[0] == pair[1] else 'is given twice'}")
        if unknown:
            raise SystemExit(f"error: --pair {' '.join(map(shlex.quote, pair))}: {', '.join(map(repr, unknown))} "
                             f"not among --variants ({', '.join(names)})")
    if args.init_from is None and any(v.scratch for v in variants):
        raise SystemExit("error: a variant with \"init_from\": null needs --init_from: without it every run is from "
                         "random weights")
    if args.init_from is not None:  # every seed's base weights, before any run trains
        try:
            for seed in args.seeds:
                pretrained.resolve(found[0].source(seed))
        except ValueError as error:
            raise SystemExit(f"error: --init_from, seed {seed}: {error}") from None
    for spec in found:
        for variant in variants:
            try:
                parse(spec.training_args(variant, args.seeds[0]), world_size=1)
            except ConfigError as error:
                raise SystemExit(f"error: variant {variant.name}: {error}") from None
    if len(args.seeds) < 2:
        logger.warning("one seed: no standard deviations and no verdicts (pass --seeds 1 2 3)")
    if args.baseline not in [v.name for v in variants]:
        logger.warning("the baseline %r is not among the variants: no comparison table", args.baseline)
    return found


def _earlier_report(path: str, found: list[GridSpec], data_hash: dict, price: float | None) -> dict:
    """--extend's report, checked against the (one) grid it extends and its data, before anything trains."""
    if len(found) != 1:
        raise SystemExit("error: --extend extends one grid: name one --preset")
    try:
        with open(path) as f:
            report = json.load(f)
        check_extension(found[0], report, data_hash, _device(price))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"error: --extend {path}: {error}") from None
    if "data_hash" not in report:
        logger.warning("--extend %s: that report recorded no data hash, so its seeds' corpus cannot be checked against "
                       "this --data; the new report lists them as unchecked", path)
    return report


def check(args: argparse.Namespace) -> list[GridSpec]:
    """What main checks before it trains (SystemExit in one line): with --restate, the reports and the Markdown file's
    folder; else every run's settings (`specs`), which it returns."""
    if not args.restate:
        if args.extend and not os.path.isfile(args.extend):
            raise SystemExit(f"error: --extend {args.extend!r}: no such file; pass the grid report (JSON) to extend")
        return specs(args)
    missing = [path for path in args.restate if not os.path.isfile(path)]
    try:
        check_markdown_path(args.benchmarks_md)
        if missing:
            raise ValueError(f"--restate {', '.join(map(repr, missing))}: no such file; pass grid reports (JSON)")
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return []


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    found = check(args)
    if args.restate:
        return _restate_files(args.restate, args.benchmarks_md)
    out = args.out if args.out is not None else os.path.join(args.runs, "report")
    failed = []
    try:
        data_hash = data_identity(args.data)  # once: every preset reads the same data
    except ValueError as error:
        raise SystemExit(f"error: --data: {error}") from None
    extend = _earlier_report(args.extend, found, data_hash, args.price) if args.extend else None
    for spec in found:
        try:
            report = run_grid(spec, out, args.runs, price=args.price, report_only=args.report_only, extend=extend,
                              data_hash=data_hash)
        except GridError as error:
            raise SystemExit(f"error: {error}") from None
        text = markdown(report)
        if args.benchmarks_md is not None:
            write_section(args.benchmarks_md, report, text)
            logger.info("grid: section %s of %s written", spec.key, args.benchmarks_md)
        print(text)
        failed += [f"{spec.preset} {f['variant']} seed {f['seed']} (log {os.path.join(args.runs, f['log'])})"
                   for f in report["failed"]]
    if failed:
        raise SystemExit(f"error: {len(failed)} run(s) failed: {'; '.join(failed)}; the tables cover the others; "
                         "the same command retries them and keeps the finished runs")


if __name__ == "__main__":
    main()
