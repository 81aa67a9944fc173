"""Benchmark grid: preset x architecture, trained side by side on the embedded corpus.

    python -m adaptive_ds.grid --preset debug --tokens 1000000 --out benchmarks
    python -m adaptive_ds.grid --preset debug debug_200m --ds_config ds_configs/debug_200m_t4.json   (on a GPU)

Each architecture is a separate training run of the full harness (`python -m adaptive_ds.training`, the
DeepSpeed engine, the given ds_config) on the same token budget and seed, one after another on the same
machine, each in its own process so that its peak memory and time breakdown are its own. The data is always
the embedded corpus (whatever the ds_config names), whose entropy floor makes the losses comparable. From each run's
summary.json and metrics.jsonl the grid reports the seed's per-preset table, measured:

- quality: validation loss (MoD and hybrid: causal routing, the honest figure; and with the train-time top-k),
  perplexity, loss minus the corpus's entropy floor, and the train loss reached at equal training FLOPs (the
  train-loss curve against the cumulative FLOPs of the tokens actually routed, interpolated at the smallest
  total any architecture spent);
- speed and cost: training tokens/s (data and train phases), MFU on a GPU of the hardware table (achieved
  TFLOP/s on a CPU, where no peak is agreed), peak memory, wall time, the time breakdown (setup, data, train,
  checkpoint, eval, other), the run's cost and the cost per 1B tokens at the device's $/hour
  (`adaptive_ds.hardware.DEVICES`, or --price);
- routing: expert utilisation, load balance and dropped share (MoE), skip rate and FLOPs reduction (MoD), as
  means over the run's logged windows.

It writes `grid_<preset>.json`, loss-vs-FLOPs, loss-vs-seconds and loss-vs-tokens PNGs, and the Markdown
tables into BENCHMARKS.md between ``<!-- grid:<preset> -->`` and ``<!-- /grid:<preset> -->``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time

import numpy as np

from . import ds_config as ds_config_reader
from .distributed import DISTRIBUTED_VARIABLES
from .flops import training_flops_per_token
from .hardware import DEVICES, detect_device
from .models.configuration import ARCHITECTURES, AdaptiveDSConfig
from .presets import PRESETS
from .report import commit, machine, replace_section
from .training.metrics import PhaseClock

logger = logging.getLogger(__name__)

PHASES = (*PhaseClock.PHASES, "other")


class GridError(RuntimeError):
    """A run of the grid failed; the message holds the end of its log."""


def _train(preset: str, arch: str, tokens: int, ds_config: str, seed: int, run_dir: str,
           warmup_steps: int | None) -> None:
    command = [sys.executable, "-m", "adaptive_ds.training", "--ds_config", ds_config, "--preset", preset,
               "--arch", arch, "--data", "embedded", "--tokens", str(tokens), "--seed", str(seed),
               "--output_dir", run_dir, "--resume", "never"]
    if warmup_steps is not None:
        command += ["--warmup_steps", str(warmup_steps)]
    logger.info("grid: %s", " ".join(command[1:]))
    # A process of its own: a fresh peak-memory mark and its own clock. It must not join this process's group.
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise GridError(f"the {arch} run failed (exit {result.returncode}): {result.stderr[-2000:]}")


def _flops_curve(metrics: list[dict], config: AdaptiveDSConfig, seq_len: int) -> list[tuple[float, float, int, float]]:
    """(cumulative training FLOPs, train loss, tokens, seconds) at each logged step of a run of `config`."""
    mod_blocks = sum(config.is_mod_layer(i) for i in range(config.num_hidden_layers))
    flops, previous, curve = 0.0, 0, []
    for m in metrics:
        routed = [1.0 - m["mod"]["skip_rate"]] * mod_blocks if "mod" in m else None  # share each block ran on
        flops += (m["tokens_seen"] - previous) * training_flops_per_token(config, seq_len, routed)
        previous = m["tokens_seen"]
        curve.append((flops, m["loss"], m["tokens_seen"], m["elapsed_s"]))
    return curve


def _mean(metrics: list[dict], group: str, key: str) -> float | None:
    values = [m[group][key] for m in metrics if group in m]
    return sum(values) / len(values) if values else None


def _peak_gib(summary: dict) -> float:
    peak = summary["peak_memory"]
    return peak.get("peak_allocated_bytes", peak.get("peak_rss_bytes", 0)) / 2**30


def run_grid(preset: str, tokens: int, out_dir: str, ds_config: str, runs_dir: str, seed: int = 1234,
             price: float | None = None, warmup_steps: int | None = None) -> dict:
    key = detect_device()  # None: a GPU the hardware table does not know (no peak, no price)
    device = DEVICES.get(key)
    gpu = key if key != "cpu" else None
    if price is None and device is not None:
        price = device.price_per_hour
    peak_tflops = device.peak_tflops if device else None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = {}
    for arch in ARCHITECTURES:
        run_dir = os.path.join(runs_dir, f"{preset}-{arch}-{stamp}")
        _train(preset, arch, tokens, ds_config, seed, run_dir, warmup_steps)
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
        config = AdaptiveDSConfig.from_pretrained(os.path.join(run_dir, "final"))  # the model the run trained
        runs[arch] = {"summary": summary, "metrics": metrics,
                      "curve": _flops_curve(metrics, config, summary["seq_len"])}
    floor = runs["dense"]["summary"]["entropy_floor"]
    budget = min(r["curve"][-1][0] for r in runs.values())
    table = {}
    for arch, r in runs.items():
        s, metrics, curve = r["summary"], r["metrics"], r["curve"]
        phases = s["time_breakdown_s"]
        busy = phases["data"] + phases["train"]  # the steady-state training time
        training_flops = curve[-1][0]
        achieved = training_flops / busy / 1e12
        tokens_per_s = s["tokens_seen"] / busy
        xs, ys = zip(*[(c[0], c[1]) for c in curve], strict=True)
        table[arch] = {
            "validation_loss": s["validation_loss"], "perplexity": math.exp(s["validation_loss"]),
            "loss_minus_floor": s["validation_loss"] - floor,
            "topk_routing_loss": s.get("validation_loss_topk_routing"),
            "topk_routing_loss_minus_floor": s.get("validation_loss_topk_routing", s["validation_loss"]) - floor,
            "train_loss_at_equal_flops": float(np.interp(budget, xs, ys)),
            "training_flops": training_flops, "tokens": s["tokens_seen"], "tokens_per_s": tokens_per_s,
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
        }
    report = {"preset": preset, "tokens": tokens, "entropy_floor": floor, "equal_flops_budget": budget,
              "machine": machine(), "gpu": gpu, "peak_tflops": peak_tflops, "price_per_hour": price,
              "commit": commit(), "date": time.strftime("%Y-%m-%d"), "ds_config": ds_config,
              "command": f"python -m adaptive_ds.grid --preset {preset} --tokens {tokens} --ds_config {ds_config}"
                         + (f" --warmup_steps {warmup_steps}" if warmup_steps is not None else ""),
              "results": table}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"grid_{preset}.json"), "w") as f:
        json.dump(report, f, indent=2)
    _plot(runs, floor, os.path.join(out_dir, f"grid_{preset}"))
    return report


def _plot(runs: dict, floor: float, prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for axis, name, label in ((0, "flops", "training FLOPs"), (3, "seconds", "wall time (s)"), (2, "tokens", "tokens")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for arch, r in runs.items():
            ax.plot([c[axis] for c in r["curve"]], [c[1] for c in r["curve"]], label=arch)
        ax.axhline(floor, color="gray", linestyle="--", label=f"entropy floor {floor:.3f}")
        ax.set_xlabel(label)
        ax.set_ylabel("train loss (nats/token)")
        ax.set_ylim(floor - 0.1, floor + 1.5)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{prefix}_loss_vs_{name}.png", dpi=110)
        plt.close(fig)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _money(value: float | None, spec: str) -> str:
    return "-" if value is None else f"${value:{spec}}"


def markdown(report: dict) -> str:
    results = report["results"]
    gpu = report["peak_tflops"] is not None
    price = report["price_per_hour"]
    lines = [
        f"Measured {report['date']} on {report['machine']}, commit {report['commit']}: `{report['command']}` "
        f"({report['tokens']:,} tokens per architecture, one process each, seed 1234; entropy floor "
        f"{report['entropy_floor']:.4f} nats/token). "
        + (f"Costs at ${price:.2f}/hour (`adaptive_ds/hardware.py`; `--price` to change). " if price is not None
           else "No price is known for this device, so no costs: pass `--price`. ")
        + "'-' marks a figure that does not apply.",
        "",
        "| arch | params (total / active) | validation loss | perplexity | loss - floor | top-k routing loss - floor "
        "| train loss at equal FLOPs | tokens/s | " + ("MFU" if gpu else "achieved TFLOP/s") +
        " | peak memory | wall time | cost | $ per 1B tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arch, r in results.items():
        speed = _fmt(r["mfu"] and 100 * r["mfu"], ".1f", "%") if gpu else _fmt(r["achieved_tflops"], ".3f")
        topk = _fmt(r["topk_routing_loss_minus_floor"], ".4f") if r["topk_routing_loss"] is not None else "-"
        lines.append(
            f"| {arch} | {r['total_parameters']:,} / {r['active_parameters']:,} | {r['validation_loss']:.4f} | "
            f"{r['perplexity']:.3f} | {r['loss_minus_floor']:.4f} | {topk} | {r['train_loss_at_equal_flops']:.4f} | "
            f"{r['tokens_per_s']:,.0f} | {speed} | {r['peak_memory_gib']:.2f} GiB | {r['wall_time_s']:.0f} s | "
            f"{_money(r['cost_usd'], '.4f')} | {_money(r['cost_per_1b_tokens_usd'], ',.2f')} |")
    lines += [
        "",
        "| arch | expert utilisation | load balance | dropped | skip rate | FLOPs reduction | training FLOPs | "
        "setup | data | train | checkpoint | eval | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arch, r in results.items():
        t = r["time_breakdown_s"]
        lines.append(
            f"| {arch} | {_fmt(r['expert_utilisation'] and 100 * r['expert_utilisation'], '.1f', '%')} | "
            f"{_fmt(r['load_balance'], '.3f')} | {_fmt(r['dropped_fraction'], '.1%')} | "
            f"{_fmt(r['skip_rate'], '.1%')} | {_fmt(r['flops_reduction'], '.1%')} | {r['training_flops']:.3g} | "
            + " | ".join(f"{t[p]:.1f} s" for p in PHASES) + " |")
    return "\n".join(lines)


def write_section(path: str, preset: str, text: str) -> None:
    """Replace (or append) the grid section for `preset` in BENCHMARKS.md."""
    replace_section(path, f"grid:{preset}", text, f"Benchmark grid, {preset} (measured)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train the four architectures side by side and report the tables.")
    p.add_argument("--preset", nargs="+", default=["debug"], choices=list(PRESETS),
                   help="one or more presets; each gets its own section")
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--ds_config", default="ds_configs/debug_cpu.json")
    p.add_argument("--warmup_steps", type=int,
                   help="learning-rate warm-up of every run (default: the ds_config's; a GPU config's 2000 steps "
                        "are meant for its 20000)")
    p.add_argument("--price", type=float, help="$ per device-hour (default: adaptive_ds/hardware.py's table)")
    p.add_argument("--out", default="benchmarks", help="the JSON report and PNG figures")
    p.add_argument("--runs", default="runs/grid", help="the training runs themselves")
    p.add_argument("--benchmarks_md", default="BENCHMARKS.md")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:  # a broken config fails here, in one line, not in the first of the runs
        ds_config_reader.read(ds_config_reader.load(args.ds_config))
    except ds_config_reader.ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    for preset in args.preset:
        try:
            report = run_grid(preset, args.tokens, args.out, args.ds_config, args.runs, price=args.price,
                              warmup_steps=args.warmup_steps)
        except GridError as error:
            raise SystemExit(f"error: {error}") from None
        text = markdown(report)
        write_section(args.benchmarks_md, preset, text)
        print(text)


if __name__ == "__main__":
    main()
