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
  where both have two or more seeds in common (`difference`), and a verdict (`verdict`): better or worse only
  beyond two standard deviations, else a tie.

It writes the report `grid_<preset>_<data>[_<name>].json` and loss-vs-FLOPs, -seconds and -tokens PNGs (mean over
the seeds, band min..max) into --out, and prints the Markdown tables; the tables go into a Markdown file between
``<!-- grid:<preset>:<data>[:<name>] -->`` markers only when --benchmarks_md names one. Nothing a user runs
writes into the repository's committed results unless asked: by default the report lands in the runs directory
(`runs/grid/report/`); publishing is `--out benchmarks --benchmarks_md BENCHMARKS.md`, with `--name` to keep a
grid's section apart from the others of its preset and data (recorded in the section's command, so the command
regenerates that section). Run directories are recorded relative to --runs, so a report names no path of the
machine that made it. The statistics, tables and plots are adaptive_ds/tools/grid_tables.py's.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .. import ds_config as ds_config_reader
from .. import pretrained
from ..data import EMBEDDED
from ..distributed import DISTRIBUTED_VARIABLES
from ..flops import training_flops_per_token
from ..hardware import DEVICES, detect_device
from ..markdown_sections import replace_section
from ..models.configuration import ARCHITECTURES, AdaptiveDSConfig
from ..presets import PRESETS, VARIANTS, variant_overrides
from .grid_tables import BUDGETS, PHASES, RUN_KEYS, aggregate, compare, markdown, plot
from .report import check_markdown_path, check_name, commit, machine, section_stem, write_report

logger = logging.getLogger(__name__)

PROVENANCE = "grid_provenance.json"  # written into a run's directory when it finishes


class GridError(RuntimeError):
    """The grid cannot report: no run finished, or a finished run's files cannot be read."""


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str
    model: dict = field(default_factory=dict)
    controller: dict = field(default_factory=dict)
    tokens: int | None = None  # this variant's own token budget (e.g. dense at a cheaper variant's FLOPs)
    # from random weights in a continuation grid ("init_from": null): the from-scratch arm beside the continuations
    scratch: bool = False
    warmup_steps: int | None = None  # this variant's own learning-rate warm-up (over the grid's --warmup_steps)


def parse_variant(text: str) -> Variant:
    """`NAME` of presets.VARIANTS, or `NAME+{JSON}`: the named variant with more model overrides (and "controller"
    settings, and "tokens": its own token budget, e.g. `dense+{"tokens": 278000}` trains dense on the training
    FLOPs a cheaper variant spends on the grid's budget: an iso-FLOP baseline with a complete schedule;
    `"init_from": null`: in a continuation grid, this variant trains from random weights, the from-scratch arm; and
    "warmup_steps": its own learning-rate warm-up, over the grid's --warmup_steps)."""
    base, plus, extra = text.partition("+")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {text!r}; valid: {', '.join(VARIANTS)}, or one of them followed by "
                         "+{JSON object of model overrides}, e.g. 'moe+{\"moe_drop_tokens\": false}'")
    entry = variant_overrides(base)  # what the training run's command line passes over the architecture's defaults
    model, controller = entry.model, entry.controller
    if plus:
        try:
            overrides = json.loads(extra)
        except json.JSONDecodeError as e:
            raise ValueError(f"variant {text!r}: what follows '+' is not JSON ({e})") from None
        if not isinstance(overrides, dict) or not isinstance(overrides.get("controller", {}), dict):
            raise ValueError(f"variant {text!r}: what follows '+' must be a JSON object of model overrides (and "
                             "an object under 'controller'), e.g. 'moe+{\"moe_drop_tokens\": false}'")
        controller.update(overrides.pop("controller", {}))
        tokens = overrides.pop("tokens", None)
        if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"variant {text!r}: 'tokens' must be a positive integer, got {tokens!r}")
        scratch = "init_from" in overrides
        if overrides.pop("init_from", None) is not None:
            raise ValueError(f"variant {text!r}: 'init_from' may only be null (this variant from random weights in a "
                             "continuation grid); the grid's --init_from names the weights")
        warmup = overrides.pop("warmup_steps", None)
        if warmup is not None and (not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0):
            raise ValueError(f"variant {text!r}: 'warmup_steps' must be a whole number of steps, got {warmup!r}")
        model.update(overrides)
        return Variant(text, entry.arch, model, controller, tokens, scratch, warmup)
    return Variant(text, entry.arch, model, controller)


@dataclass(frozen=True)
class GridSpec:
    """What a grid trains: the same preset, data, budget and ds_config for every variant x seed."""

    preset: str
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...]
    tokens: int
    ds_config: str
    data: str = EMBEDDED
    tokenizer: str | None = None
    warmup_steps: int | None = None
    baseline: str = "dense"
    eval_batches: int | None = None
    name: str | None = None  # the last part of the section key and of the report's file names
    # pretrained weights every run starts from (--init_from; "{seed}" in it is each run's seed): a continuation grid
    init_from: str | None = None
    # (variant, baseline) pairs compared apart from the baseline (--pair): a continuation against its from-scratch arm
    pairs: tuple[tuple[str, str], ...] = ()
    log_steps: int | None = None  # the curves' resolution: a short continuation needs more points than the default

    def source(self, seed: int) -> str | None:
        """The --init_from of the run of `seed`: the template with its seed, a glob of it matching one folder (a
        base grid's run directory, whose name ends in a digest: runs/base/debug-embedded-dense-seed{seed}-*/final).
        ValueError when a glob matches no folder or several."""
        if self.init_from is None:
            return None
        path = self.init_from.replace("{seed}", str(seed))
        if any(c in path for c in "*?["):
            matches = sorted(glob.glob(path))
            if len(matches) != 1:
                raise ValueError(f"init_from {path!r} matches {len(matches)} folders; it must match one")
            path = matches[0]
        return path

    @property
    def key(self) -> str:
        """The BENCHMARKS.md section key: grid:PRESET:DATA, or grid:PRESET:DATA:NAME."""
        return ":".join(["grid", self.preset, self.data_name, *([self.name] if self.name else [])])

    @property
    def data_name(self) -> str:
        """The data in a section key or file name: embedded:hard -> embedded-hard, /x/docs.json.gz -> docs."""
        name = self.data if "," in self.data else os.path.basename(self.data.rstrip("/")).split(".")[0]
        return re.sub(r"[^a-z0-9]+", "-", (name or self.data).lower()).strip("-")[:40]

    def starts_from(self, variant: Variant) -> bool:
        """Whether `variant`'s runs start from the --init_from weights (not a from-scratch arm)."""
        return self.init_from is not None and not variant.scratch

    def training_args(self, variant: Variant, seed: int) -> list[str]:
        """The training command line of one run, its --output_dir aside."""
        args = ["--ds_config", self.ds_config, "--preset", self.preset, "--arch", variant.arch, "--data", self.data,
                "--tokens", str(variant.tokens or self.tokens), "--seed", str(seed), "--resume", "never"]
        if self.tokenizer is not None:
            args += ["--tokenizer", self.tokenizer]
        if variant.model:
            args += ["--model", json.dumps(variant.model, sort_keys=True)]
        if variant.controller:
            args += ["--controller", json.dumps(variant.controller, sort_keys=True)]
        warmup = variant.warmup_steps if variant.warmup_steps is not None else self.warmup_steps
        if warmup is not None:
            args += ["--warmup_steps", str(warmup)]
        if self.log_steps is not None:
            args += ["--log_steps", str(self.log_steps)]
        if self.eval_batches is not None:
            args += ["--eval_batches", str(self.eval_batches)]
        if self.starts_from(variant):
            args += ["--init_from", self.source(seed)]
        return args

    def run_dir(self, runs_dir: str, variant: Variant, seed: int) -> str:
        """Named after everything that makes the run (its command line, the ds_config's text and the shipped
        settings of its architecture that its overrides leave standing), so that a grid re-run keeps exactly the
        runs it would train again and no others: a change of an architecture's entry in presets.VARIANTS trains anew
        what it changes."""
        with open(ds_config_reader.resolve(self.ds_config), "rb") as f:
            key = json.dumps(self.training_args(variant, seed)).encode() + f.read()
        defaults = {k: v for k, v in VARIANTS[variant.arch].model.items() if k not in variant.model}
        if defaults:  # absent, the key is what it was before the defaults existed: those runs are still kept
            key += json.dumps(defaults, sort_keys=True).encode()
        if self.starts_from(variant):  # the weights it starts from, by content: a retrained base trains anew
            key += pretrained.content_hash(pretrained.resolve(self.source(seed))).encode()
        slug = re.sub(r"[^a-z0-9]+", "-", variant.name.lower()).strip("-")[:40]
        digest = hashlib.sha256(key).hexdigest()[:10]
        return os.path.join(runs_dir, f"{self.preset}-{self.data_name}-{slug}-seed{seed}-{digest}")

    def command(self) -> str:
        parts = ["python", "-m", "adaptive_ds.tools.grid", "--preset", self.preset, "--tokens", str(self.tokens),
                 "--ds_config", self.ds_config, "--data", self.data]
        if self.tokenizer is not None:
            parts += ["--tokenizer", self.tokenizer]
        parts += ["--variants", *(v.name for v in self.variants), "--seeds", *map(str, self.seeds)]
        if self.baseline != "dense":
            parts += ["--baseline", self.baseline]
        if self.warmup_steps is not None:
            parts += ["--warmup_steps", str(self.warmup_steps)]
        if self.log_steps is not None:
            parts += ["--log_steps", str(self.log_steps)]
        if self.eval_batches is not None:
            parts += ["--eval_batches", str(self.eval_batches)]
        if self.name is not None:
            parts += ["--name", self.name]
        if self.init_from is not None:
            parts += ["--init_from", self.init_from]
        for variant, baseline in self.pairs:
            parts += ["--pair", variant, baseline]
        return shlex.join(parts)


def _log_tail(path: str, size: int = 3000) -> str:
    """The end of a log, read from its end (a long run's log is not read whole)."""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read().decode(errors="replace")


def _set_aside(path: str) -> None:
    """An unfinished attempt's files move to PATH.failed (replacing an older one), kept for reading."""
    if os.path.exists(path):
        aside = f"{path}.failed"
        if os.path.isdir(aside):
            shutil.rmtree(aside)
        os.replace(path, aside)


def execute(args: list[str], run_dir: str) -> dict | None:
    """Train one run into `run_dir` unless it finished earlier. None when its summary.json exists, else the
    failure: exit status, log path and the end of the log."""
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        logger.info("grid: %s finished earlier: kept", run_dir)
        return None
    log = f"{run_dir}.log"  # beside the run: the trainer wants a new or empty directory
    _set_aside(run_dir)
    _set_aside(log)
    command = [sys.executable, "-m", "adaptive_ds.training", *args, "--output_dir", run_dir]
    logger.info("grid: %s", shlex.join(command[1:]))
    # A process of its own: a fresh peak-memory mark and its own clock. It must not join this process's group.
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
    with open(log, "w") as f:
        returncode = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if returncode == 0 and os.path.exists(os.path.join(run_dir, "summary.json")):
        # where and from what code it was trained: a kept run may come from an earlier commit
        with open(os.path.join(run_dir, PROVENANCE), "w") as f:
            json.dump({"commit": commit(), "machine": machine(), "date": time.strftime("%Y-%m-%d")}, f)
        return None
    return {"exit": returncode, "log": log, "log_tail": _log_tail(log)}


def _flops_curve(metrics: list[dict], config: AdaptiveDSConfig, seq_len: int,
                 setup_s: float) -> list[tuple[float, float, int, float]]:
    """(cumulative training FLOPs, train loss, tokens, training seconds) at each logged step of a run of
    `config`. Seconds count from the end of the setup (interpreter start, imports, model build), which does not
    depend on the architecture and varies with the machine's load."""
    mod_blocks = sum(config.is_mod_layer(i) for i in range(config.num_hidden_layers))
    flops, previous, curve = 0.0, 0, []
    for m in metrics:
        routed = [1.0 - m["mod"]["skip_rate"]] * mod_blocks if "mod" in m else None  # share each block ran on
        flops += (m["tokens_seen"] - previous) * training_flops_per_token(config, seq_len, routed)
        previous = m["tokens_seen"]
        curve.append((flops, m["loss"], m["tokens_seen"], m["elapsed_s"] - setup_s))
    return curve


def load_run(run_dir: str) -> dict:
    """A finished run's summary, metrics and loss curve."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            # the logged steps: a step that only validated (eval_steps off the logging cadence) has no train loss
            metrics = [m for m in map(json.loads, filter(str.strip, f)) if "loss" in m]
        config = AdaptiveDSConfig.from_pretrained(os.path.join(run_dir, "final"))  # the model the run trained
        provenance = os.path.join(run_dir, PROVENANCE)
        trained = dict.fromkeys(("commit", "machine", "date"), "unknown")  # the grid stopped before writing it
        if os.path.exists(provenance):
            with open(provenance) as f:
                trained = json.load(f)
    except (OSError, ValueError) as e:
        raise GridError(f"the finished run {run_dir} cannot be read ({e}); move it away to train it again") from None
    if not metrics:
        raise GridError(f"the finished run {run_dir} logged no steps; move it away to train it again")
    curve = _flops_curve(metrics, config, summary["seq_len"], summary["time_breakdown_s"]["setup"])
    return {"summary": summary, "metrics": metrics, "curve": curve, "trained": trained,
            "base_flops": _base_flops(summary)}


def _base_flops(summary: dict) -> float | None:
    """The training FLOPs of the run whose weights a run started from (--init_from): that run's own, where the
    source is a run's final/ folder beside its summary and metrics; None for a run from random weights or another
    source. A run's curve counts its own FLOPs only: the continuation's additional FLOPs."""
    source = summary.get("base_model")
    if not source or os.path.basename(os.path.normpath(source)) != "final":
        return None
    base = os.path.dirname(os.path.normpath(source))
    if not os.path.isfile(os.path.join(base, "summary.json")):
        return None
    return load_run(base)["curve"][-1][0]


def _mean(metrics: list[dict], group: str, key: str) -> float | None:
    values = [m[group][key] for m in metrics if group in m]
    return sum(values) / len(values) if values else None


def _peak_gib(summary: dict) -> float:
    peak = summary["peak_memory"]
    return peak.get("peak_allocated_bytes", peak.get("peak_rss_bytes", 0)) / 2**30


def budgets(runs: list[dict]) -> dict[str, float]:
    """The smallest total of training FLOPs, tokens and seconds that any run reached: every run's curve reaches
    it, so each is compared there without extrapolating."""
    return {name: min(r["curve"][-1][axis] for r in runs) for name, axis, _ in BUDGETS}


def run_row(run: dict, at: dict[str, float], peak_tflops: float | None, price: float | None) -> dict:
    """One run's figures; `at`: the budgets the train losses are read at."""
    s, metrics, curve = run["summary"], run["metrics"], run["curve"]
    phases = s["time_breakdown_s"]
    busy = phases["data"] + phases["train"]  # the steady-state training time
    achieved = curve[-1][0] / busy / 1e12
    tokens_per_s = s["tokens_seen"] / busy
    floor = s.get("entropy_floor")
    topk = s.get("validation_loss_topk_routing")
    row = {
        "validation_loss": s["validation_loss"], "validation_loss_se": s.get("validation_loss_se"),
        "perplexity": math.exp(s["validation_loss"]),
        "loss_minus_floor": s["validation_loss"] - floor if floor is not None else None,
        "topk_routing_loss": topk, "topk_routing_loss_se": s.get("validation_loss_topk_routing_se"),
        "topk_routing_loss_minus_floor": topk - floor if topk is not None and floor is not None else None,
        "entropy_floor": floor,
    }
    for name, axis, _ in BUDGETS:
        xs, ys = zip(*[(c[axis], c[1]) for c in curve], strict=True)
        # a budget before the run's first logged step or after its last (a variant with a smaller budget of its
        # own) is not on its curve: no figure, rather than its first or its final loss
        on_curve = xs[0] <= at[name] <= xs[-1]
        row[f"train_loss_at_equal_{name}"] = float(np.interp(at[name], xs, ys)) if on_curve else None
    base = run.get("base_flops")
    row.update({
        "training_flops": curve[-1][0], "tokens": s["tokens_seen"], "tokens_per_s": tokens_per_s,
        # a continuation (--init_from a grid run's final/): the base run's FLOPs, and the total with this run's
        "base_training_flops": base, "total_training_flops": curve[-1][0] + base if base is not None else None,
        "achieved_tflops": achieved, "mfu": achieved / peak_tflops if peak_tflops else None,
        "peak_memory_gib": _peak_gib(s), "wall_time_s": s["wall_time_s"],
        "time_breakdown_s": {p: phases[p] for p in PHASES},
        "cost_usd": s["wall_time_s"] / 3600 * price if price is not None else None,
        "cost_per_1b_tokens_usd": price / (tokens_per_s * 3600) * 1e9 if price is not None else None,
        "total_parameters": s["total_parameters"], "active_parameters": s["active_parameters"],
        "expert_utilisation": _mean(metrics, "moe", "expert_utilisation"),
        "load_balance": _mean(metrics, "moe", "load_balance"),
        "dropped_fraction": _mean(metrics, "moe", "dropped_fraction"),
        "skip_rate": _mean(metrics, "mod", "skip_rate"),
        "flops_reduction": _mean(metrics, "mod", "flops_reduction"),
    })
    return row


def _device(price: float | None) -> tuple[str | None, float | None, float | None]:
    """(GPU key or None, peak TFLOP/s or None, $/hour or None) of this machine."""
    key = detect_device()  # None: a GPU the hardware table does not know (no peak, no price)
    device = DEVICES.get(key)
    if price is None and device is not None:
        price = device.price_per_hour
    return (key if key != "cpu" else None), (device.peak_tflops if device else None), price


def run_grid(spec: GridSpec, out_dir: str, runs_dir: str, price: float | None = None,
             report_only: bool = False) -> dict:
    """Train (or keep) every variant x seed of `spec`, then write the JSON report and the plots into `out_dir`;
    returns the report. Failed runs are listed in it; GridError when none finished. `report_only`: train nothing,
    report the runs that finished and list the others as not run. Run directories and logs are recorded relative to
    `runs_dir`."""
    finished, failed, not_run = [], [], []
    for variant in spec.variants:
        for seed in spec.seeds:
            run_dir = spec.run_dir(runs_dir, variant, seed)
            kept = os.path.exists(os.path.join(run_dir, "summary.json"))
            if report_only and not kept:
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
    if not finished:
        raise GridError("no run finished; the first failure's log ends:\n" + failed[0]["log_tail"] if failed else
                        f"no run of this grid has finished in {runs_dir} (--report_only trains nothing)")
    report = {**assemble(spec, finished, failed, *_device(price)), "not_run": not_run}
    path = write_report(out_dir, spec.key, report)
    logger.info("grid: report %s", path)
    prefix = os.path.join(out_dir, section_stem(spec.key))
    curves = {}
    scratch = {v.name for v in spec.variants if spec.init_from is not None and v.scratch}
    for r in finished:  # a continuation grid's figures show the continuations: a from-scratch curve starts elsewhere
        if r["variant"] not in scratch:
            curves.setdefault(r["variant"], []).append(r["curve"])
    if curves:  # none when every continuation failed: the report and its tables still stand
        plot(curves, report["entropy_floor"], prefix)
    return report


def assemble(spec: GridSpec, finished: list[dict], failed: list[dict], gpu: str | None, peak_tflops: float | None,
             price: float | None) -> dict:
    """The report of a grid: `finished` holds each finished run's name (RUN_KEYS) and `load_run` record,
    `failed` each failure of `execute` with the variant and seed."""
    # Equal-budget figures are read at what every run on the grid's own budget reached: a variant with a smaller
    # budget of its own (an iso-FLOP baseline) is compared by its validation loss, not by moving that point.
    # A from-scratch arm of a continuation grid is never read at them: its curve starts from random weights, the
    # continuations' from the base model; its validation loss compares.
    scratch = {v.name for v in spec.variants if spec.init_from is not None and v.scratch}
    own_budget = {v.name for v in spec.variants if v.tokens is not None} | scratch
    at = budgets([r for r in finished if r["variant"] not in own_budget]
                 or [r for r in finished if r["variant"] not in scratch] or finished)
    rows = [{**{k: r[k] for k in RUN_KEYS}, **run_row(r, at, peak_tflops, price)} for r in finished]
    for row in rows:
        if row["variant"] in scratch:
            row.update({f"train_loss_at_equal_{name}": None for name, _, _ in BUDGETS})
    trained = {k: sorted({r["trained"][k] for r in rows}) for k in ("commit", "machine", "date")}
    floors = [r["entropy_floor"] for r in rows]
    names = [v.name for v in spec.variants if any(r["variant"] == v.name for r in rows)]
    return {
        "preset": spec.preset, "data": spec.data, "data_name": spec.data_name, "name": spec.name, "tokens": spec.tokens,
        "seeds": list(spec.seeds), "baseline": spec.baseline,
        "variants": {v.name: {"arch": v.arch, "model": v.model, "controller": v.controller} for v in spec.variants},
        "entropy_floor": None if None in floors else sum(floors) / len(floors), "budgets": at,
        "machine": "; ".join(trained["machine"]), "gpu": gpu, "peak_tflops": peak_tflops, "price_per_hour": price,
        "commit": ", ".join(trained["commit"]),
        "date": " to ".join(dict.fromkeys([trained["date"][0], trained["date"][-1]])),  # one date, or a range
        "ds_config": spec.ds_config, "init_from": spec.init_from, "command": spec.command(), "runs": rows,
        "failed": failed,
        "results": {name: aggregate([r for r in rows if r["variant"] == name]) for name in names},
        "comparisons": compare(rows, spec.baseline),
        "pairs": [_pair(rows, v, b) for v, b in spec.pairs],
    }


def _pair(rows: list[dict], variant: str, baseline: str) -> dict:
    """`variant` against `baseline` (--pair), as `compare` has it; "missing" names a side without a finished run."""
    missing = [name for name in (variant, baseline) if not any(r["variant"] == name for r in rows)]
    if missing:
        return {"variant": variant, "baseline": baseline, "missing": missing}
    both = [r for r in rows if r["variant"] in (variant, baseline)]
    return {"variant": variant, "baseline": baseline, **compare(both, baseline)[variant]}


def section_key(report: dict) -> str:
    """The section key of a grid report: grid:PRESET:DATA[:NAME] (reports before --name have none)."""
    return ":".join(["grid", report["preset"], report["data_name"], *([report["name"]] if report.get("name") else [])])


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


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out if args.out is not None else os.path.join(args.runs, "report")
    failed = []
    for spec in specs(args):
        try:
            report = run_grid(spec, out, args.runs, price=args.price, report_only=args.report_only)
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
