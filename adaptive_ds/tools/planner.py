"""The planner's model: does a preset fit a GPU, how fast can it run, what does it cost? (`python -m
adaptive_ds.tools.plan`, tools/plan.py, is its command and its tables; tools/plan_advice.py what runs instead of a plan
that does not.)

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache, partial

from .. import ds_config as ds_config_reader
from ..ds_config import ConfigError
from ..flops import training_flops_per_token
from ..hardware import DEVICES
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
    q = config.num_attention_heads * config.head_dim
    qk_norm = (2 * q + 2 * kv) * config.qk_norm  # the normalised queries and keys
    scale = 1 if layout.half_precision else 2  # bytes counted for half precision
    tokens = layout.micro_batch * seq_len
    per_layer = []
    for i in range(config.num_hidden_layers):
        mlp = 4 * h + 8 * f
        if config.is_moe_layer(i):  # the top-k routed experts' and the shared experts' widths
            mlp = 4 * h + 8 * (config.expert_intermediate_size * config.num_routed_experts_per_tok
                               + config.shared_intermediate_size)
        full = 6 * h + 2 * q + 4 * kv + qk_norm + mlp
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
    ep_size = config.expert_parallel_size
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
    if config.zero3_problem is not None and layout.zero_stage == 3:
        split = " with expert parallelism" if config.num_moe_layers else ""
        found.append(f"{config.zero3_problem} (stage 1 or 2{split} does)")
    if gpus % config.expert_parallel_size:
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
