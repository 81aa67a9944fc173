"""The runs of a benchmark grid (tools/grid.py): each trained in a process of its own (`execute`, kept when it
finished earlier), then read back (`load_run`: summary, metrics and its loss curve against training FLOPs, tokens and
seconds) into one row of figures (`run_row`) at the grid's equal budgets (`budgets`)."""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

from ..distributed import DISTRIBUTED_VARIABLES
from ..flops import training_flops_per_token
from ..models.configuration import AdaptiveDSConfig
from .grid_tables import BUDGETS, PHASES
from .report import commit, machine

logger = logging.getLogger(__name__)

PROVENANCE = "grid_provenance.json"  # written into a run's directory when it finishes


class GridError(RuntimeError):
    """The grid cannot report: no run finished, or a finished run's files cannot be read."""


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
