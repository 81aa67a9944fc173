"""Memory and throughput planner: does a preset fit a GPU, how fast can it run, what does it cost?

    python -m adaptive_ds.tools.plan --preset b1 --arch moe --gpu t4 [--ds_config F] [--gpus N] [--tokens N]

The command and its tables; the projection itself (what is counted, and how) is tools/planner.py, and what runs
instead of a plan that does not, tools/plan_advice.py.

`validation_table()` compares predicted peaks with measured ones (BENCHMARKS.md records the table): the GPU rows an
external reference (an independent model, its figures and provenance in benchmarks/external/), the CPU rows this
project's models.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import asdict
from pathlib import Path

from .. import ds_config as ds_config_reader
from ..hardware import DEVICES, GPUS
from ..presets import ARCHITECTURES, PRESETS, model_config, parameter_counts
from .plan_advice import advise
from .planner import Plan, host_line, host_parts_text, plan, plan_config, plan_ds_config

# the planner's entry points stay importable from here, the module the command and the docs name
__all__ = ["SCENARIOS", "Plan", "main", "plan", "plan_config", "plan_ds_config", "projections_markdown",
           "validation_markdown", "validation_table", "write_benchmarks"]

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
EXTERNAL = BENCHMARKS_DIR / "external"
EXTERNAL_LABEL = "external reference: an independent 1.1B Llama, not this project's code"
# The least --host_ram_gib taken: the smallest figure one decimal states (a machine's RAM, printed with one decimal)
MIN_HOST_RAM_GIB = 0.1


def cpu_measurements() -> list[dict]:
    """The CPU rows, from the committed peak-memory reports of this project's models."""
    rows = []
    for path in sorted(BENCHMARKS_DIR.glob("memory_*_cpu_*.json")):
        with open(path) as f:
            report = json.load(f)
        rows.append({"device": "cpu", "hardware": f"{report['machine']} (peak RSS over the RSS before the model)",
                     "preset": report["preset"], "arch": report["arch"], "vocab_size": report["vocab_size"],
                     "checkpointing": report["activation_checkpointing"], "model": report["model"],
                     "gib": report["measured_gib"],
                     "ds_config": {"train_micro_batch_size_per_gpu": report["micro_batch"],
                                   "zero_optimization": {"stage": report["zero_stage"]}},
                     "source": f"{report['command']} (`benchmarks/{path.name}`, {report['date']}, commit "
                               f"{report['commit']})"})
    return rows


def _preset_of(model: dict, seq_len: int) -> str:
    """The preset with an external model's dimensions."""
    dimensions = (model["hidden_size"], model["num_hidden_layers"], model["num_attention_heads"],
                  model["num_key_value_heads"], model["intermediate_size"], seq_len)
    for name, p in PRESETS.items():
        if (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads, p.intermediate_size,
                p.seq_len) == dimensions:
            return name
    raise ValueError(f"no preset has the external model's dimensions {dimensions} (adaptive_ds/presets.py)")


def external_measurements() -> list[dict]:
    """The GPU rows, from their files in benchmarks/external/ (figures as measured, provenance in words)."""
    paths = sorted(EXTERNAL.glob("t4_fit_mb*.json"))
    if not paths:
        raise FileNotFoundError(f"no external reference figures (t4_fit_mb*.json) in {EXTERNAL}; the planner's "
                                "validation reads them from a checkout of the repository")
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        figures, provenance = data["figures"], data["provenance"]
        rows.append({"device": "cuda", "hardware": f"{provenance['hardware']} (a T4's memory)",
                     "preset": _preset_of(provenance["model"], provenance["seq_len"]), "arch": "dense",
                     "vocab_size": provenance["model"]["vocab_size"],
                     "checkpointing": provenance["activation_checkpointing"], "gib": figures["peak_alloc_GiB"],
                     "ds_config": provenance["ds_config"],
                     "source": f"{EXTERNAL_LABEL} (`benchmarks/external/{path.name}`)"})
    return rows


def measurements() -> list[dict]:
    return external_measurements() + cpu_measurements()


def validation_table() -> list[dict]:
    """Predicted against measured peak memory for every measured configuration."""
    rows = []
    for m in measurements():
        p = plan(m["preset"], m["arch"], "h200", m["ds_config"], vocab_size=m["vocab_size"],
                 activation_checkpointing=m["checkpointing"],
                 model_overrides={"moe_drop_tokens": False, **m.get("model", {})},
                 cpu_process=m["device"] == "cpu")
        rows.append({"device": m["device"], "preset": m["preset"], "arch": m["arch"],
                     "micro_batch": ds_config_reader.read(m["ds_config"]).micro_batch,
                     "checkpointing": m["checkpointing"], "predicted_gib": round(p.peak_gib, 2),
                     "measured_gib": m["gib"], "error": round(p.peak_gib / m["gib"] - 1, 3), "source": m["source"]})
    return rows


# The configurations BENCHMARKS.md projects, from ds_configs/: (preset, architectures, GPU). The number of GPUs
# is the config's train_batch_size / (micro-batch x accumulation); its adaptive_ds block supplies activation
# checkpointing and model overrides (expert parallelism).
SCENARIOS = [
    ("debug_200m", ("dense", "moe", "mod", "hybrid"), "t4", "debug_200m_t4.json"),
    ("b1", ("dense", "moe", "mod", "hybrid"), "t4", "b1_t4.json"),
    ("b1", ("dense", "moe", "mod", "hybrid"), "a100", "b1_a100.json"),
    ("b1", ("dense", "moe", "mod", "hybrid"), "h100", "b1_h100.json"),
    ("b7", ("dense", "mod"), "a100_40gb", "b7_a100_40gb_offload.json"),
    ("b7", ("dense", "mod"), "h100", "b7_8gpu.json"),
    ("b7", ("moe", "hybrid"), "h100", "b7_moe_8gpu.json"),
]


def _hours(hours: float) -> str:
    return f"{hours * 60:,.0f} min" if hours < 1 else f"{hours:,.0f} h" if hours < 48 else f"{hours / 24:,.0f} days"


def _host_column(p: Plan) -> str:
    """CPU RAM per GPU for the offloaded optimizer, beside the usual host's RAM per GPU."""
    if not p.cpu_states_gib or p.host_memory_gib is None:
        return f"{p.cpu_states_gib:.1f} GiB"
    over = ", **more than the usual host**" if p.cpu_states_gib > p.host_memory_gib else ""
    return f"{p.cpu_states_gib:.1f} of {p.host_memory_gib:.0f} GiB{over}"


def projections_markdown(config_dir: str = ds_config_reader.SHIPPED_DIR, mfu: float = 0.35) -> str:
    """The projected tables of BENCHMARKS.md, one per preset, each followed by what runs instead of its rows that
    do not."""
    lines = [
        "Projected by `python -m adaptive_ds.tools.plan --write BENCHMARKS.md` "
        f"(the planner's model, not measurements): "
        f"vocabulary 32,000, one token budget per preset for every architecture (Chinchilla for the dense model: 20 "
        f"tokens per parameter), {100 * mfu:.0f}% MFU assumed, "
        "prices from `adaptive_ds/hardware.py`. Loss, perplexity and routing statistics are not projected: only a "
        "training run measures them, and none has run at these scales yet. CPU RAM is per GPU, beside the RAM per "
        "GPU of the usual cloud instance with that GPU (`adaptive_ds/hardware.py`): ZeRO-Offload's buffers as "
        "DeepSpeed allocates them at the config's gradient accumulation (one buffer per parameter in the training "
        "precision above 1), and where the config pins them (`pin_memory`) each pinned buffer rounded up to the "
        "next power of two, as torch's CUDA pinned allocator takes it (read from torch's source, not measured). "
        "Under each table, what runs instead of a row that does not: the planner's advice, each advised config "
        "planned again.",
    ]
    for preset in dict.fromkeys(s[0] for s in SCENARIOS):
        budget = 20 * parameter_counts(model_config(preset, "dense", 32000)).total
        lines += ["", f"**{preset}**", "",
                  "| arch | params (total / active) | hardware, config | predicted peak per GPU | CPU RAM (offload) "
                  "| GFLOP per token | tokens/s bound | projected tokens/s | tokens | time | cost | $ per 1B tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        instead = []
        for name, archs, gpu, config in SCENARIOS:
            if name != preset:
                continue
            for arch in archs:
                p = plan_config(preset, arch, gpu, os.path.join(config_dir, config), mfu, tokens=budget)
                fits = "fits" if p.fits else "**does not fit**"
                lines.append(
                    f"| {arch} | {p.total_parameters / 1e6:,.0f}M / {p.active_parameters / 1e6:,.0f}M | "
                    f"{p.gpus} x {gpu}, `{config}` | {p.peak_gib:.1f} of {p.gpu_memory_gib:.0f} GiB, {fits} | "
                    f"{_host_column(p)} | {p.flops_per_token / 1e9:.2f} | {p.tokens_per_s_bound:,.0f} | "
                    f"{p.tokens_per_s_projected:,.0f} | {p.tokens / 1e9:,.1f}B | {_hours(p.hours)} | "
                    f"${p.cost_usd:,.0f} | ${p.cost_usd / p.tokens * 1e9:,.2f} |")
                if not p.runs:
                    advice = advise(preset, arch, gpu, ds_config_reader.load(os.path.join(config_dir, config)),
                                    mfu=mfu, tokens=budget)
                    instead.append(f"- {arch} on {p.gpus} x {gpu}, `{config}`:"
                                   + ("" if advice else " nothing the planner can change runs"))
                    instead += [f"  - {'; '.join(a.changes)}: {a.plan.peak_gib:.1f} GiB per GPU"
                                + (f", {a.plan.cpu_states_gib:.1f} GiB of CPU RAM per GPU" if a.plan.cpu_states_gib
                                   else "") for a in advice]
        if instead:
            lines += [""] + instead
    return "\n".join(lines)


def validation_markdown() -> str:
    """Predicted against measured peak memory, as BENCHMARKS.md shows it."""
    lines = [f"GPU rows: {EXTERNAL_LABEL}, with b1's dimensions, measured by a script outside this project (its "
             "figures and provenance: `benchmarks/external/`). CPU rows: this project's models, measured by the "
             "command beside each.", "",
             "| device | run | measured peak | predicted | error | measured by |", "|---|---|---|---|---|---|"]
    for m, row in zip(measurements(), validation_table(), strict=True):
        ds = ds_config_reader.read(m["ds_config"])
        offload = f" + {ds.offload_optimizer.upper()} Adam" if ds.offload_optimizer != "none" else ""
        model = m.get("model", {})
        details = f", {model['num_local_experts']} experts" if "num_local_experts" in model else ""
        if "mod_capacity" in model:
            details += (f", MoD capacity {model['mod_capacity']} in every "
                        f"{'other ' if model['mod_layer_interval'] == 2 else ''}block")
        run = (f"{m['preset']} {m['arch']} (vocab {m['vocab_size']:,}{details}), {ds.precision}, "
               f"ZeRO-{ds.zero_stage}{offload}, micro {row['micro_batch']}, "
               f"seq {PRESETS[m['preset']].seq_len}{', checkpointing' if m['checkpointing'] else ''}")
        source = re.sub(r"^(python [^(]*?) \(", r"`\1` (", m["source"])  # the command as code
        lines.append(f"| {m['hardware']} | {run} | {m['gib']:.2f} GiB | {row['predicted_gib']:.2f} GiB | "
                     f"{100 * row['error']:+.1f}% | {source} |")
    return "\n".join(lines)


def write_benchmarks(path: str) -> None:
    from ..markdown_sections import replace_section

    replace_section(path, "plan:validation", validation_markdown(), "Peak memory: planner against measurement")
    replace_section(path, "plan:projections", projections_markdown(), "Projections (planner, not measurements)")


def format_plan(p: Plan, advice: list = (), init_from: str | None = None) -> str:
    """The CLI's report of a plan and, when it does not run, the advice (`plan_advice.Advice`) of what does
    (`init_from`: the pretrained folder the model starts from)."""
    model = p.preset if init_from is None else f"{init_from} (preset {p.preset or 'none'})"
    lines = [
        f"{model} {p.arch} on {p.gpus} x {p.gpu}, seq {p.seq_len} (projection from the planner's model, not a "
        "measurement)",
        f"  parameters: {p.total_parameters:,} total, {p.active_parameters:,} active",
        f"  model states per GPU: {p.model_states_gib:.2f} GiB; in CPU RAM (offload): {p.cpu_states_gib:.2f} GiB",
        f"  activations per GPU: {p.activations_without_checkpointing_gib:.2f} GiB without checkpointing, "
        f"{p.activations_with_checkpointing_gib:.2f} GiB with",
        f"  predicted peak: {p.peak_gib:.2f} GiB of {p.gpu_memory_gib:.0f} GiB -> {p.verdict}",
    ]
    lines.append(f"  {host_line(p)}")
    if host_parts_text(p):
        lines.append(f"    {host_parts_text(p)}")
    if not p.runs:
        lines.append("  what runs instead (each planned again; --json prints its ds_config):" if advice else
                     "  nothing this planner can change runs: use a GPU with more memory")
        lines += [f"    - {item.text}" for item in advice]
    lines += [
        f"  training FLOPs per token: {p.flops_per_token / 1e9:.2f} GFLOP",
        f"  tokens/s: at most {p.tokens_per_s_bound:,.0f} (peak {DEVICES[p.gpu].peak_tflops:.0f} TFLOP/s per GPU); "
        f"projected {p.tokens_per_s_projected:,.0f} at {100 * p.mfu:.0f}% MFU",
        f"  {p.tokens:,} tokens: {p.hours:,.1f} h, ${p.cost_usd:,.0f} at ${p.price_per_gpu_hour:.2f}/GPU-hour; "
        f"${p.cost_usd / p.tokens * 1e9:,.2f} per 1B tokens",
    ]
    return "\n".join(lines)


def check(args: argparse.Namespace) -> None:
    """What main checks before it plans: the file --write rewrites, what a plan needs, the ds_config as the training
    run reads it, and an --init_from that is a folder that exists or a Hub id; ValueError in one line."""
    from .. import pretrained

    if args.write or args.validate:
        ignored = [f"--{name}" for name in ("host_ram_gib", "gpus_per_host") if getattr(args, name) is not None]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} plan one configuration; --validate and --write plan the "
                             "measured and the shipped ones with their usual hosts: pass one or the other")
    if args.write:
        if not os.path.isfile(args.write):
            raise ValueError(f"{args.write!r} not found; pass the path of BENCHMARKS.md")
        return
    if args.validate:
        return
    host_options(args.host_ram_gib, args.gpus_per_host, 1)  # its figures, before anything is planned
    if not args.gpu or not (args.preset or args.init_from):
        raise ValueError("--preset (or --init_from) and --gpu are required (or --validate, or --write)")
    if args.ds_config:
        ds_config_reader.read(ds_config_reader.load(args.ds_config))
    if args.init_from:
        pretrained.check_name(args.init_from)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Project memory, speed and cost of a preset on a GPU.")
    p.add_argument("--preset", choices=list(PRESETS))
    p.add_argument("--arch", default="dense", choices=ARCHITECTURES)
    p.add_argument("--gpu", choices=GPUS)
    p.add_argument("--gpus", type=int, help="GPUs (default: what the ds_config's batch sizes imply, else 1)")
    p.add_argument("--ds_config", help="DeepSpeed config: a path, or the name of a shipped config (b1_t4.json) "
                                       "(default: fp16, ZeRO-2, micro-batch 1)")
    p.add_argument("--tokens", type=int, help="token budget (default: 20 x total parameters)")
    p.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation assumed for the projection")
    p.add_argument("--price", type=float, help="$ per GPU-hour (default: the table in adaptive_ds/hardware.py)")
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--host_ram_gib", type=float, help="CPU RAM of each machine, in GiB, shared by the GPUs on it, "
                                                      "where an offloaded optimizer goes (default: the usual cloud "
                                                      "instance with --gpu, adaptive_ds/hardware.py)")
    p.add_argument("--gpus_per_host", type=int, help="GPUs on each machine, sharing its --host_ram_gib (default: "
                                                     "all the plan's GPUs on one machine)")
    p.add_argument("--init_from", help="plan the model a run --init_from this folder (or Hub id) trains: its shape's "
                                       "preset (--preset, if given, must agree), its vocabulary, and what --arch "
                                       "makes of it (a dense model upcycled, a Mixtral's experts)")
    p.add_argument("--validate", action="store_true", help="print predicted vs measured peaks")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", metavar="BENCHMARKS_MD",
                   help="rewrite the validation and projection tables of this Markdown file and stop")
    return p


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as error:  # a ConfigError among them
        raise SystemExit(f"error: {error}") from None
    try:  # both read the measured peaks in the repository's benchmarks/
        if args.write:
            write_benchmarks(args.write)
            return
        if args.validate:
            print(json.dumps(validation_table(), indent=2))
            return
    except FileNotFoundError as error:
        raise SystemExit(f"error: {error}") from None
    seq_len = None  # the preset's
    if args.init_from and args.gpu:
        args.preset, args.vocab_size, init_model, seq_len = init_from_model(args.init_from, args.arch, args.preset)
    try:
        raw = ds_config_reader.load(args.ds_config) if args.ds_config else {
            "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}
        if args.init_from:  # what the folder fixes, under the block's own model overrides
            block = raw.get("adaptive_ds", {})
            raw = {**raw, "adaptive_ds": {**block, "model": {**init_model, **block.get("model", {})}}}
        gpus = args.gpus or ds_config_reader.read(raw).implied_world_size() or 1  # as plan_ds_config counts them
        options = dict(tokens=args.tokens, mfu=args.mfu, price=args.price, vocab_size=args.vocab_size,
                       seq_len=seq_len, **host_options(args.host_ram_gib, args.gpus_per_host, gpus))
        result = plan_ds_config(args.preset, args.arch, args.gpu, raw, args.gpus, **options)
        advice = advise(args.preset, args.arch, args.gpu, raw, args.gpus, **options)
    except ValueError as error:  # a ConfigError, or a model configuration the preset cannot take
        raise SystemExit(f"error: {error}") from None
    if args.json:
        print(json.dumps({**asdict(result), "runs": result.runs, "advice": [
            {"text": item.text, "gpus": item.gpus, "ds_config": item.ds_config} for item in advice]}, indent=2))
    else:
        print(format_plan(result, advice, args.init_from))
    if not math.isfinite(result.peak_gib):
        raise SystemExit("error: the plan is not finite")


def host_options(host_ram_gib: float | None, gpus_per_host: int | None, gpus: int) -> dict:
    """The plan's host RAM per GPU from a machine's RAM a user gives (`--host_ram_gib`), shared by the GPUs on it
    (`--gpus_per_host`, default: all the plan's `gpus` on one machine); none given: the usual host's (no options).
    Bad figures are refused in one line."""
    if gpus_per_host is not None and host_ram_gib is None:
        raise ValueError("--gpus_per_host divides --host_ram_gib among a machine's GPUs: pass --host_ram_gib too")
    if gpus_per_host is not None and gpus_per_host < 1:
        raise ValueError(f"--gpus_per_host {gpus_per_host}: the GPUs on each machine, a positive count")
    if host_ram_gib is None:
        return {}
    if not (math.isfinite(host_ram_gib) and host_ram_gib >= MIN_HOST_RAM_GIB):
        raise ValueError(f"--host_ram_gib {host_ram_gib:g}: the CPU RAM of each machine in GiB, a finite number of "
                         f"at least {MIN_HOST_RAM_GIB} (e.g. 12.7)")
    sharing = gpus_per_host or gpus
    # more GPUs (the advice's) are more such machines: each keeps its share
    return {"host_memory_gib": host_ram_gib / sharing,
            "host_detail": f"--host_ram_gib {host_ram_gib:.1f} on each machine of {sharing} GPU{'s' * (sharing > 1)}"}


def init_from_model(name: str, arch: str, preset: str | None) -> tuple[str | None, int, dict, int]:
    """The preset (None where no preset has the folder's shape and none is named), vocabulary, model overrides and
    sequence length of the model a run --init_from `name` as `arch` trains: the model comes from the folder, through
    its family (`pretrained.Source`), whatever its shape."""
    from .. import pretrained
    from ..models.upcycling import STRUCTURAL_FIELDS

    try:
        source = pretrained.Source.open(name, weights=False)  # the config is all a plan reads
        problems = source.arch_problems(arch, {})
        preset = preset or source.matching_preset()
        if preset is not None and source.preset_conflicts(preset):
            problems.append(f"preset {preset} contradicts init_from {name!r} on "
                            f"{', '.join(source.preset_conflicts(preset))}")
        if problems:
            raise ValueError("; ".join(problems))
        config = source.model_config(arch, preset, source.config.vocab_size)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    fixed = {*source.fields, *STRUCTURAL_FIELDS} - {"vocab_size"}
    return preset, source.config.vocab_size, {k: getattr(config, k) for k in sorted(fixed)}, source.seq_len(preset)

if __name__ == "__main__":
    main()
