"""Memory and throughput planner: does a preset fit a GPU, how fast can it run, what does it cost?

    python -m adaptive_ds.plan --preset b1 --arch moe --gpu t4 [--ds_config F] [--gpus N] [--tokens N]

Everything here is a projection from a stated model, not a measurement:

- model states per GPU: bytes per parameter for weights and gradients in the training precision, and 16 for
  DeepSpeed's ZeRO optimizer (fp32 master copy, fp32 gradient partition, Adam's two moments), divided over
  the data-parallel ranks as the ZeRO stage partitions them (1: optimizer, 2: + gradients, 3: + weights);
  experts are split over `ep_size` first and their states partitioned over the remaining data-parallel ranks;
  offloaded optimizer states (ZeRO-Offload) sit in CPU RAM instead;
- activations per token and layer, counted from the block's saved tensors (half precision bytes): attention
  8h + 4kv (norm input and output, q/k/v, attention output; SDPA keeps no score matrix), SwiGLU 4h + 8f
  (norm input and output, gate, up, silu, product); an MoE MLP stores k expert passes; a MoD-routed block
  stores its routed share; with activation checkpointing each layer keeps its 2h input and one layer's full
  set is live during its recomputation; logits 6 bytes per vocabulary entry per token (half logits and the
  fp32 loss's upcast);
- FLOPs per token: `adaptive_ds.flops` (6 x active parameters + attention); tokens/s upper bound = peak
  dense TFLOP/s / FLOPs per token, and a projection at a stated MFU.

Whether a plan runs: its peak fits the GPU's memory, its offloaded optimizer states fit the CPU RAM per GPU of
the usual instance with that GPU (`adaptive_ds/hardware.py`), and DeepSpeed takes the layout (no MoE under ZeRO-3,
an expert-parallel group that divides the GPUs). What runs instead of one that does not:
`adaptive_ds.tools.plan_advice`.

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
from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from pathlib import Path

from .. import ds_config as ds_config_reader
from ..ds_config import ConfigError
from ..flops import training_flops_per_token
from ..hardware import DEVICES, GPUS
from ..models.configuration import AdaptiveDSConfig
from ..presets import PRESETS, ParameterCounts, block_parameters, model_config, parameter_counts

GIB = 2**30


@dataclass
class Layout:
    """What the DeepSpeed config says about memory."""

    micro_batch: int
    zero_stage: int
    offload_optimizer: bool
    half_precision: bool
    activation_checkpointing: bool

    @classmethod
    def from_ds_config(cls, ds_config: dict, activation_checkpointing: bool) -> Layout:
        ds = ds_config_reader.read(ds_config)
        return cls(micro_batch=ds.micro_batch, zero_stage=ds.zero_stage,
                   offload_optimizer=ds.offload_optimizer != "none", half_precision=ds.half_precision,
                   activation_checkpointing=activation_checkpointing)


def expert_parameters(config: AdaptiveDSConfig) -> int:
    """The parameters of every expert of every MoE layer: those expert parallelism splits."""
    return sum(block.experts * block.mlp for block in map(partial(block_parameters, config),
                                                          range(config.num_hidden_layers)))


def model_state_bytes(total: int, experts: int, ep_size: int, layout: Layout, gpus: int) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) of weights, gradients and optimizer states on one rank, for `total` parameters of which
    `experts` are split over `ep_size` ranks.

    Per parameter: the weights and their gradients in the training precision; DeepSpeed's ZeRO optimizer then
    keeps an fp32 master copy, an fp32 gradient partition and Adam's two moments (16 bytes), whatever the
    precision. Without ZeRO, fp32 training keeps only Adam's moments beside the weights.
    """
    # (parameters on this rank, ranks sharing their ZeRO partitions)
    groups = [(total - experts, gpus), (experts / ep_size, max(1, gpus // ep_size))]
    w = g = 2 if layout.half_precision else 4
    opt = 16 if layout.zero_stage >= 1 or layout.half_precision else 8
    gpu = cpu = 0.0
    for params, dp in groups:
        gpu += params * w / (dp if layout.zero_stage >= 3 else 1)
        gpu += params * g / (dp if layout.zero_stage >= 2 else 1)
        optimizer = params * opt / (dp if layout.zero_stage >= 1 else 1)
        if layout.offload_optimizer:
            cpu += optimizer
        else:
            gpu += optimizer
    return gpu, cpu


def _torch_adam_step_bytes(total: int, experts: int, ep_size: int, layout: Layout, gpus: int) -> float:
    """The transient of torch's AdamW step (the CPU measurements' optimizer, `torch_adam`) on one rank: its
    single-tensor path computes each parameter's denominator, sqrt(v) / bias correction, through two temporaries
    of the parameter's size, and under ZeRO a "parameter" is a param group's whole flat fp32 partition. The largest
    group counts: the non-expert decay group, or one of DeepSpeed's expert groups (at most its element cap)."""
    from ..training.optim import DEEPSPEED_MOE_GROUP_CAP  # imports DeepSpeed: only for a CPU process's peak

    dp = gpus if layout.zero_stage >= 1 else 1
    largest = max((total - experts) / dp, min(experts / ep_size, DEEPSPEED_MOE_GROUP_CAP) / max(1, gpus // ep_size))
    return 2 * 4 * largest


def activation_bytes(config: AdaptiveDSConfig, layout: Layout, seq_len: int, checkpointing: bool) -> float:
    """Activation memory of one micro-batch on one rank, at its peak."""
    h, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    scale = 1 if layout.half_precision else 2  # bytes counted for half precision
    tokens = layout.micro_batch * seq_len
    per_layer = []
    for i in range(config.num_hidden_layers):
        mlp = 4 * h + 8 * f
        if config.is_moe_layer(i):  # the top-k routed experts' and the shared experts' widths
            mlp = 4 * h + 8 * (config.expert_intermediate_size * config.num_routed_experts_per_tok
                               + config.shared_intermediate_size)
        full = 8 * h + 4 * kv + mlp
        if config.is_mod_layer(i):
            full = full * config.mod_capacity + 2 * h  # routed share, plus the skipped tokens' residual
        per_layer.append(full * tokens * scale)
    logits = tokens * config.vocab_size * 6 * scale
    if checkpointing:
        return config.num_hidden_layers * 2 * h * tokens * scale + max(per_layer) + logits
    return sum(per_layer) + logits


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs of a model, computed once per model (the advice plans many layouts of one model)."""

    config: AdaptiveDSConfig
    counts: ParameterCounts
    experts: int  # expert_parameters(config)
    flops_per_token: float


@lru_cache(maxsize=512)
def _model_facts(preset: str, arch: str, vocab_size: int, overrides_json: str) -> ModelFacts:
    config = model_config(preset, arch, vocab_size, **json.loads(overrides_json))
    return ModelFacts(config, parameter_counts(config), expert_parameters(config),
                      training_flops_per_token(config, PRESETS[preset].seq_len))


def model_facts(preset: str, arch: str, vocab_size: int, overrides: dict | None = None) -> ModelFacts:
    return _model_facts(preset, arch, vocab_size, json.dumps(overrides or {}, sort_keys=True))


@dataclass
class Plan:
    preset: str
    arch: str
    gpu: str
    gpus: int
    total_parameters: int
    active_parameters: int
    model_states_gib: float
    cpu_states_gib: float  # per GPU: the optimizer states ZeRO-Offload keeps in CPU RAM for each rank
    activations_gib: float
    activations_without_checkpointing_gib: float
    activations_with_checkpointing_gib: float
    peak_gib: float
    gpu_memory_gib: float
    fits: bool  # the predicted peak fits the GPU's memory
    host_memory_gib: float | None  # CPU RAM per GPU of the usual instance with this GPU (adaptive_ds/hardware.py)
    problems: list[str]  # what else stops it running as planned (DeepSpeed refuses the layout, the host is short)
    flops_per_token: float
    tokens_per_s_bound: float
    tokens_per_s_projected: float
    mfu: float
    tokens: int
    hours: float
    cost_usd: float
    price_per_gpu_hour: float

    @property
    def runs(self) -> bool:
        return self.fits and not self.problems

    @property
    def verdict(self) -> str:
        if not self.fits:
            return "; ".join([f"does not fit ({self.peak_gib:.1f} > {self.gpu_memory_gib:.0f} GiB)", *self.problems])
        return "fits" if not self.problems else "fits the GPU, but " + "; ".join(self.problems)


def plan(preset: str, arch: str, gpu: str, ds_config: dict, gpus: int = 1, tokens: int | None = None,
         mfu: float = 0.35, price: float | None = None, vocab_size: int = 32000,
         activation_checkpointing: bool = False, model_overrides: dict | None = None,
         cpu_process: bool = False, host_memory_gib: float | None = None) -> Plan:
    """`cpu_process`: predict a CPU process's peak resident memory instead of a GPU allocator's peak. It adds the
    copy of the weights that exists while DeepSpeed flattens them into its contiguous buffer (a GPU allocator frees
    it before the training peak, but the C allocator keeps it in the process) and the temporaries of torch's AdamW
    step, the CPU's optimizer (`_torch_adam_step_bytes`). `host_memory_gib`: the CPU RAM
    per GPU of the machine (default: the usual instance with that GPU, `adaptive_ds/hardware.py`)."""
    seq_len = PRESETS[preset].seq_len
    model = model_facts(preset, arch, vocab_size, model_overrides)
    config, counts = model.config, model.counts
    layout = Layout.from_ds_config(ds_config, activation_checkpointing)
    ep_size = config.moe_ep_size if config.uses_moe else 1
    states_gpu, states_cpu = model_state_bytes(counts.total, model.experts, ep_size, layout, gpus)
    if cpu_process:
        states_gpu += counts.total * (2 if layout.half_precision else 4) + _torch_adam_step_bytes(
            counts.total, model.experts, ep_size, layout, gpus)
    without = activation_bytes(config, layout, seq_len, checkpointing=False)
    with_ckpt = activation_bytes(config, layout, seq_len, checkpointing=True)
    activations = with_ckpt if activation_checkpointing else without
    peak = (states_gpu + activations) / GIB
    device = DEVICES[gpu]
    host = host_memory_gib if host_memory_gib is not None else device.host_memory_gib
    price = price if price is not None else device.price_per_hour
    if price is None:
        raise ConfigError(f"no $/hour is known for {gpu} (adaptive_ds/hardware.py); pass --price")
    bound = gpus * device.peak_tflops * 1e12 / model.flops_per_token
    projected = bound * mfu
    tokens = tokens if tokens is not None else 20 * counts.total  # Chinchilla (Hoffmann et al. 2022)
    hours = tokens / projected / 3600
    return Plan(preset=preset, arch=arch, gpu=gpu, gpus=gpus, total_parameters=counts.total,
                active_parameters=counts.active, model_states_gib=states_gpu / GIB, cpu_states_gib=states_cpu / GIB,
                activations_gib=activations / GIB, activations_without_checkpointing_gib=without / GIB,
                activations_with_checkpointing_gib=with_ckpt / GIB, peak_gib=peak,
                gpu_memory_gib=device.memory_gib, fits=peak <= device.memory_gib,
                host_memory_gib=host, problems=_problems(config, layout, gpus, gpu, states_cpu / GIB, host),
                flops_per_token=model.flops_per_token,
                tokens_per_s_bound=bound, tokens_per_s_projected=projected, mfu=mfu, tokens=tokens, hours=hours,
                cost_usd=hours * gpus * price, price_per_gpu_hour=price)


def _problems(config: AdaptiveDSConfig, layout: Layout, gpus: int, gpu: str, cpu_gib: float,
              host: float | None) -> list[str]:
    """What stops a layout that fits the GPU: what DeepSpeed refuses, and a host too small for the offload."""
    found = []
    if config.uses_moe and layout.zero_stage == 3:
        found.append("DeepSpeed MoE does not run under ZeRO stage 3 (stage 1 or 2 with expert parallelism does)")
    if config.uses_moe and gpus % config.moe_ep_size:
        found.append(f"moe_ep_size {config.moe_ep_size} needs a multiple of {config.moe_ep_size} GPUs, not {gpus}")
    if host is not None and cpu_gib > host:
        found.append(f"the offloaded optimizer needs {cpu_gib:.1f} GiB of CPU RAM per GPU, more than the "
                     f"{_host_words(gpu, host)}")
    return found


def _host_words(gpu: str, host: float) -> str:
    device = DEVICES[gpu]
    if host == device.host_memory_gib:
        return f"{host:.0f} GiB per GPU of the usual {gpu} host, {device.host_instance}"
    return f"{host:.0f} GiB per GPU of the host"


def host_memory_text(p: Plan) -> str:
    """The CPU RAM a plan's offloaded optimizer needs, beside what its host has."""
    need = f"{p.cpu_states_gib:.1f} GiB of CPU RAM per GPU for the offloaded optimizer"
    if p.host_memory_gib is None:
        return f"{need} (no usual {p.gpu} host is known: compare with the machine's)"
    return f"{need}, of the {_host_words(p.gpu, p.host_memory_gib)}"


# Measured peaks. The GPU rows are an external reference (EXTERNAL_LABEL): an independent 1.10B Llama with b1's
# dimensions, measured by a script outside this project; their raw figures and provenance are the files in
# benchmarks/external/. The CPU rows measure this project's models, each a committed report of `python -m
# adaptive_ds.benchmark --memory ... --out benchmarks` (benchmarks/memory_*.json: the command, commit, machine and
# date with the figure; fp32, ZeRO-1, the embedded vocabulary; peak RSS minus the RSS before the model was built).
BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
EXTERNAL = BENCHMARKS_DIR / "external"
EXTERNAL_LABEL = "external reference: an independent 1.1B Llama, not this project's code"


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


def plan_ds_config(preset: str, arch: str, gpu: str, ds_config: dict, gpus: int | None = None, **options) -> Plan:
    """The plan for a ds_config as training would run it: activation checkpointing and model overrides from its
    adaptive_ds block; without `gpus`, the GPU count its batch sizes imply. `options`: those of `plan`."""
    block = ds_config.get("adaptive_ds", {})
    if gpus is None:
        gpus = ds_config_reader.read(ds_config).implied_world_size() or 1
    return plan(preset, arch, gpu, ds_config, gpus, model_overrides=block.get("model"),
                activation_checkpointing=bool(block.get("activation_checkpointing")), **options)


def plan_config(preset: str, arch: str, gpu: str, path: str, mfu: float = 0.35, price: float | None = None,
                tokens: int | None = None) -> Plan:
    """`plan_ds_config` for a ds_config file."""
    return plan_ds_config(preset, arch, gpu, ds_config_reader.load(path), mfu=mfu, price=price, tokens=tokens)


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
    from .plan_advice import advise  # it plans through this module

    lines = [
        f"Projected by `python -m adaptive_ds.plan --write BENCHMARKS.md` (the planner's model, not measurements): "
        f"vocabulary 32,000, one token budget per preset for every architecture (Chinchilla for the dense model: 20 "
        f"tokens per parameter), {100 * mfu:.0f}% MFU assumed, "
        "prices from `adaptive_ds/hardware.py`. Loss, perplexity and routing statistics are not projected: only a "
        "training run measures them, and none has run at these scales yet. CPU RAM is per GPU, beside the RAM per "
        "GPU of the usual cloud instance with that GPU (`adaptive_ds/hardware.py`). Under each table, what runs "
        "instead of a row that does not: the planner's advice, each advised config planned again.",
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


def format_plan(p: Plan, advice: list = ()) -> str:
    """The CLI's report of a plan and, when it does not run, the advice (`plan_advice.Advice`) of what does."""
    lines = [
        f"{p.preset} {p.arch} on {p.gpus} x {p.gpu} (projection from the planner's model, not a measurement)",
        f"  parameters: {p.total_parameters:,} total, {p.active_parameters:,} active",
        f"  model states per GPU: {p.model_states_gib:.2f} GiB; in CPU RAM (offload): {p.cpu_states_gib:.2f} GiB",
        f"  activations per GPU: {p.activations_without_checkpointing_gib:.2f} GiB without checkpointing, "
        f"{p.activations_with_checkpointing_gib:.2f} GiB with",
        f"  predicted peak: {p.peak_gib:.2f} GiB of {p.gpu_memory_gib:.0f} GiB -> {p.verdict}",
    ]
    if p.cpu_states_gib and p.runs:
        lines.append(f"  {host_memory_text(p)}")
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Project memory, speed and cost of a preset on a GPU.")
    p.add_argument("--preset", choices=list(PRESETS))
    p.add_argument("--arch", default="dense", choices=["dense", "moe", "mod", "hybrid"])
    p.add_argument("--gpu", choices=GPUS)
    p.add_argument("--gpus", type=int, help="GPUs (default: what the ds_config's batch sizes imply, else 1)")
    p.add_argument("--ds_config", help="DeepSpeed config: a path, or the name of a shipped config (b1_t4.json) "
                                       "(default: fp16, ZeRO-2, micro-batch 1)")
    p.add_argument("--tokens", type=int, help="token budget (default: 20 x total parameters)")
    p.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation assumed for the projection")
    p.add_argument("--price", type=float, help="$ per GPU-hour (default: the table in adaptive_ds/hardware.py)")
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--init_from", help="plan the model a run --init_from this folder (or Hub id) trains: its shape's "
                                       "preset (--preset, if given, must agree), its vocabulary, and what --arch "
                                       "makes of it (a dense model upcycled, a Mixtral's experts)")
    p.add_argument("--validate", action="store_true", help="print predicted vs measured peaks")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", metavar="BENCHMARKS_MD",
                   help="rewrite the validation and projection tables of this Markdown file and stop")
    args = p.parse_args(argv)
    from .plan_advice import advise  # it plans through this module

    try:  # both read the measured peaks in the repository's benchmarks/
        if args.write:
            if not os.path.isfile(args.write):
                raise SystemExit(f"error: {args.write!r} not found; pass the path of BENCHMARKS.md")
            write_benchmarks(args.write)
            return
        if args.validate:
            print(json.dumps(validation_table(), indent=2))
            return
    except FileNotFoundError as error:
        raise SystemExit(f"error: {error}") from None
    if args.init_from and args.gpu:
        args.preset, args.vocab_size, init_model = _init_from(args.init_from, args.arch, args.preset)
    if not args.preset or not args.gpu:
        p.error("--preset (or --init_from) and --gpu are required (or --validate)")
    try:
        raw = ds_config_reader.load(args.ds_config) if args.ds_config else {
            "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}
        if args.init_from:  # what the folder fixes, under the block's own model overrides
            block = raw.get("adaptive_ds", {})
            raw = {**raw, "adaptive_ds": {**block, "model": {**init_model, **block.get("model", {})}}}
        options = dict(tokens=args.tokens, mfu=args.mfu, price=args.price, vocab_size=args.vocab_size)
        result = plan_ds_config(args.preset, args.arch, args.gpu, raw, args.gpus, **options)
        advice = advise(args.preset, args.arch, args.gpu, raw, args.gpus, **options)
    except ValueError as error:  # a ConfigError, or a model configuration the preset cannot take
        raise SystemExit(f"error: {error}") from None
    if args.json:
        print(json.dumps({**asdict(result), "runs": result.runs, "advice": [
            {"text": item.text, "gpus": item.gpus, "ds_config": item.ds_config} for item in advice]}, indent=2))
    else:
        print(format_plan(result, advice))
    if not math.isfinite(result.peak_gib):
        raise SystemExit("error: the plan is not finite")


def _init_from(name: str, arch: str, preset: str | None) -> tuple[str, int, dict]:
    """The preset, vocabulary and model overrides of the model a run --init_from `name` as `arch` trains."""
    from .. import pretrained

    try:
        source = pretrained.Source.open(name, weights=False)  # the config is all a plan reads
        problems = source.arch_problems(arch, {})
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    preset = preset or source.matching_preset()
    if preset is None:
        raise SystemExit(f"error: init_from {name!r} has the shape of no preset ({source.shape()}); the planner plans "
                         f"a preset's shape: {', '.join(PRESETS)}")
    problems += [f"preset {preset} contradicts init_from {name!r} on {', '.join(source.preset_conflicts(preset))}"
                 ] if source.preset_conflicts(preset) else []
    if problems:
        raise SystemExit(f"error: {'; '.join(problems)}")
    config = source.model_config(arch, preset, source.config.vocab_size)
    fixed = [k for k in pretrained.STRUCTURAL_FIELDS if k not in (*pretrained.SHAPE_FIELDS, "vocab_size")]
    return preset, source.config.vocab_size, {k: getattr(config, k) for k in fixed}


if __name__ == "__main__":
    main()
