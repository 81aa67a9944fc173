"""Quality grid: the four architectures trained side by side on the embedded corpus, at equal tokens.

    python -m adaptive_ds.grid --preset debug --tokens 1000000 --out benchmarks

Each architecture is trained through the full harness (`adaptive_ds.training.train`, the DeepSpeed engine,
`ds_configs/debug_cpu.json`) on the same token budget and seed, one after another in one process. From each
run's metrics the grid reports the final validation loss minus the corpus's entropy floor (for MoD and hybrid
with causal routing, the honest figure, and with the train-time top-k), wall time, tokens/s, and the loss
reached at equal training FLOPs (the train-loss curve against cumulative FLOPs of the tokens actually
routed, interpolated at the smallest total any architecture spent). It writes `grid_<preset>.json`,
loss-vs-FLOPs and loss-vs-seconds PNGs, and the Markdown table into BENCHMARKS.md between the markers
`<!-- grid:<preset> -->` and `<!-- /grid:<preset> -->`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import time

import numpy as np

from .data.tokenizer import embedded_tokenizer
from .flops import training_flops_per_token
from .models.configuration import ARCHITECTURES
from .presets import PRESETS, model_config
from .training import train

logger = logging.getLogger(__name__)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_grid(preset: str, tokens: int, out_dir: str, ds_config: str, runs_dir: str, seed: int = 1234) -> dict:
    results = {}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for arch in ARCHITECTURES:
        run_dir = os.path.join(runs_dir, f"{preset}-{arch}-{stamp}")
        started = time.time()
        summary = train(["--ds_config", ds_config, "--preset", preset, "--arch", arch, "--tokens", str(tokens),
                         "--seed", str(seed), "--output_dir", run_dir, "--resume", "never"])
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f]
        config = model_config(preset, arch, len(embedded_tokenizer()))
        seq_len = PRESETS[preset].seq_len
        flops, curve = 0.0, []
        previous_tokens = 0
        for m in metrics:
            routed = None
            if "mod" in m:  # share of tokens each routed block ran on
                routed = [1.0 - m["mod"]["skip_rate"]] * sum(config.is_mod_layer(i)
                                                               for i in range(config.num_hidden_layers))
            flops += (m["tokens_seen"] - previous_tokens) * training_flops_per_token(config, seq_len, routed)
            previous_tokens = m["tokens_seen"]
            curve.append((flops, m["loss"], m["tokens_seen"]))
        results[arch] = {"summary": summary, "curve": curve, "seconds": time.time() - started}
    floor = results["dense"]["summary"]["entropy_floor"]
    budget = min(r["curve"][-1][0] for r in results.values())
    table = {}
    for arch, r in results.items():
        s = r["summary"]
        xs, ys = zip(*[(c[0], c[1]) for c in r["curve"]], strict=True)
        table[arch] = {
            "validation_loss": s["validation_loss"], "loss_minus_floor": s["validation_loss"] - floor,
            "topk_routing_loss_minus_floor": s.get("validation_loss_topk_routing", s["validation_loss"]) - floor,
            "train_loss_at_equal_flops": float(np.interp(budget, xs, ys)),
            "training_flops": r["curve"][-1][0], "wall_time_s": s["wall_time_s"],
            "tokens_per_s": s["tokens_seen"] / s["wall_time_s"], "total_parameters": s["total_parameters"],
            "active_parameters": s["active_parameters"], "tokens": s["tokens_seen"],
        }
    report = {"preset": preset, "tokens": tokens, "entropy_floor": floor, "equal_flops_budget": budget,
              "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "commit": _commit(),
              "command": f"python -m adaptive_ds.grid --preset {preset} --tokens {tokens} --out {out_dir}",
              "results": table}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"grid_{preset}.json"), "w") as f:
        json.dump(report, f, indent=2)
    _plot(results, floor, os.path.join(out_dir, f"grid_{preset}"))
    return report


def _plot(results: dict, floor: float, prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for axis, name in ((0, "flops"), (2, "tokens")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for arch, r in results.items():
            ax.plot([c[axis] for c in r["curve"]], [c[1] for c in r["curve"]], label=arch)
        ax.axhline(floor, color="gray", linestyle="--", label=f"entropy floor {floor:.3f}")
        ax.set_xlabel("training FLOPs" if name == "flops" else "tokens")
        ax.set_ylabel("train loss (nats/token)")
        ax.set_ylim(floor - 0.1, floor + 1.5)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{prefix}_loss_vs_{name}.png", dpi=110)
        plt.close(fig)


def markdown(report: dict) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {report['machine']}, commit {report['commit']}: "
        f"`{report['command']}` ({report['tokens']:,} tokens each, entropy floor {report['entropy_floor']:.4f}).",
        "",
        "| arch | params (total / active) | validation loss - floor | top-k routing loss - floor | "
        "train loss at equal FLOPs | training FLOPs | wall time | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arch, r in report["results"].items():
        lines.append(f"| {arch} | {r['total_parameters']:,} / {r['active_parameters']:,} | "
                     f"{r['loss_minus_floor']:.4f} | {r['topk_routing_loss_minus_floor']:.4f} | "
                     f"{r['train_loss_at_equal_flops']:.4f} | {r['training_flops']:.3g} | {r['wall_time_s']:.0f} s | "
                     f"{r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def write_section(path: str, preset: str, text: str) -> None:
    """Replace (or append) the grid section for `preset` in BENCHMARKS.md."""
    start, end = f"<!-- grid:{preset} -->", f"<!-- /grid:{preset} -->"
    with open(path) as f:
        content = f.read()
    block = f"{start}\n{text}\n{end}"
    if start in content:
        content = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, content, flags=re.S)
    else:
        content = content.rstrip("\n") + f"\n\n## Quality on the embedded corpus, {preset}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(content)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train the four architectures side by side and report quality.")
    p.add_argument("--preset", default="debug", choices=list(PRESETS))
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--ds_config", default="ds_configs/debug_cpu.json")
    p.add_argument("--out", default="benchmarks", help="the JSON report and PNG figures")
    p.add_argument("--runs", default="runs/grid", help="the training runs themselves")
    p.add_argument("--benchmarks_md", default="BENCHMARKS.md")
    args = p.parse_args(argv)
    report = run_grid(args.preset, args.tokens, args.out, args.ds_config, args.runs)
    text = markdown(report)
    write_section(args.benchmarks_md, args.preset, text)
    print(text)


if __name__ == "__main__":
    main()
