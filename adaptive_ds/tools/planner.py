"""The planner's model: does a preset fit a GPU, how fast can it run, what does it cost? (`python -m
adaptive_ds.tools.plan`, tools/plan.py, is its command and its tables; tools/plan_advice.py what runs instead of a plan
that does not.)

Everything here is a projection from a stated model, not a measurement:

- model states per GPU: bytes per parameter for weights and gradients in the training precision, and 16 for
  DeepSpeed's ZeRO optimizer (fp32 master copy, fp32 gradient partition, Adam's two moments), divided over
  the data-parallel ranks as the ZeRO stage partitions them (1: optimizer, 2: + gradients, 3: + weights);
  experts are split over `ep_size` first and their states partitioned over the remaining data-parallel ranks;
  offloaded optimizer states (ZeRO-Offload) sit in CPU RAM instead, beside the copy of the partition in the training
  precision that the offload stages the updated weights through, one gradient buffer of the largest parameter's
  size on each side, and with gradient accumulation a buffer per parameter (`state_bytes`, `largest_parameter`);
  pinned (`pin_memory`) on a GPU host, each pinned buffer as torch's CUDA pinned allocator takes it, the next power
  of two of its size (`planner_host`);
- activations per token and layer, counted from the block's saved tensors (half precision bytes): attention
  8h + 4kv (norm input and output, q/k/v, attention output; SDPA keeps no score matrix), SwiGLU 4h + 8f
  (norm input and output, gate, up, silu, product); an MoE MLP stores k expert passes; a MoD-routed block
  stores its routed share; with activation checkpointing each layer keeps its 2h input and one layer's full
  set is live during its recomputation; logits 6 bytes per vocabulary entry per token (half logits and the
  fp32 loss's upcast);
- FLOPs per token: `adaptive_ds.flops` (6 x active parameters + attention); tokens/s upper bound = peak
  dense TFLOP/s / FLOPs per token, and a projection at a stated MFU.

Whether a plan runs: its peak fits the GPU's memory, its offloaded optimizer states fit the CPU RAM per GPU of
the host (by default the usual instance with that GPU, `adaptive_ds/hardware.py`; or the machine's RAM a user gives,
shared by the GPUs on it: `HostRam`), and DeepSpeed takes the layout (no MoE under ZeRO-3,
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
from ..models.upcycling import SHAPE_FIELDS
from ..presets import PRESETS, VARIANTS, ParameterCounts, block_parameters, model_config, pad_vocab, parameter_counts
from .planner_host import offload_host_bytes

GIB = 2**30


@dataclass
class Layout:
    """What the DeepSpeed config says about memory."""

    micro_batch: int
    zero_stage: int
    offload_optimizer: bool
    half_precision: bool
    activation_checkpointing: bool
    accumulation: int = 1  # gradient_accumulation_steps
    pin_memory: bool = False  # the offloaded optimizer's host buffers are pinned (offload_optimizer.pin_memory)

    @classmethod
    def from_ds_config(cls, ds_config: dict, activation_checkpointing: bool, gpus: int | None = None) -> Layout:
        """`gpus`: the ranks, from which DeepSpeed derives the accumulation of a config that fixes train_batch_size
        but not gradient_accumulation_steps."""
        ds = ds_config_reader.read(ds_config)
        accumulation = ds.accumulation
        if "gradient_accumulation_steps" not in ds_config and ds.train_batch_size and gpus:
            accumulation = max(1, ds.train_batch_size // (ds.micro_batch * gpus))
        offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
        return cls(micro_batch=ds.micro_batch, zero_stage=ds.zero_stage,
                   offload_optimizer=ds.offload_optimizer != "none", half_precision=ds.half_precision,
                   activation_checkpointing=activation_checkpointing, accumulation=accumulation,
                   pin_memory=ds.offload_optimizer != "none" and bool(offload.get("pin_memory")))


def expert_parameters(config: AdaptiveDSConfig) -> int:
    """The parameters of every expert of every MoE layer: those expert parallelism splits."""
    return sum(block.experts * block.mlp for block in map(partial(block_parameters, config),
                                                          range(config.num_hidden_layers)))


@dataclass(frozen=True)
class StateBytes:
    """One rank's model states in bytes, by what holds them and from when."""

    weights: float  # the weights in the training precision (on the GPU)
    gradients: float  # their gradients (on the GPU)
    optimizer: float  # ZeRO's optimizer state from initialisation (in CPU RAM when offloaded)
    moments: float  # what the first optimizer step adds to it (Adam's moments; without offload, the grad partition)
    offloaded: bool  # the optimizer state sits in CPU RAM (ZeRO-Offload)
    accumulated: float = 0.0  # the offload's gradient accumulation buffers (in CPU RAM, from the first micro-step)


def state_bytes(total: int, experts: int, ep_size: int, layout: Layout, gpus: int) -> StateBytes:
    """One rank's model states, for `total` parameters of which `experts` are split over `ep_size` ranks.

    Per parameter: the weights and their gradients in the training precision; DeepSpeed's ZeRO optimizer then
    keeps an fp32 master copy from initialisation, and at the first step an fp32 gradient partition and Adam's two
    moments (16 bytes in all), whatever the precision. Offloaded (DeepSpeed's stage_1_and_2.py with `cpu_offload`),
    the gradient partition is made at initialisation too, beside a copy of the partition in the training precision
    through which the updated weights go back to the GPU (`param_buffer_of_bit16_for_cpu_offload_groups`): 18 bytes
    in half precision. Without ZeRO, fp32 training keeps only Adam's moments beside the weights, made at the step
    (torch's Adam makes its state lazily). Offloaded with gradient accumulation above 1, DeepSpeed also keeps a buffer
    in the training precision for each parameter of the rank's partition, from the first micro-step on
    (`accumulated_grads_in_cpu`, never freed; each straddling parameter whole): `w` bytes per parameter of the
    partition."""
    groups = [(total - experts, gpus), (experts / ep_size, max(1, gpus // ep_size))]  # (parameters, ZeRO ranks)
    w = g = 2 if layout.half_precision else 4
    if not (layout.zero_stage >= 1 or layout.half_precision):
        at_init, at_step = 0, 8
    elif layout.offload_optimizer:
        at_init, at_step = 4 + 4 + w, 8
    else:
        at_init, at_step = 4, 12
    # ZeRO-3's offload (stage3.py) accumulates into its fp32 gradient partition: no such buffers
    accumulating = layout.offload_optimizer and layout.accumulation > 1 and layout.zero_stage in (1, 2)
    weights = gradients = optimizer = moments = accumulated = 0.0
    for params, dp in groups:
        weights += params * w / (dp if layout.zero_stage >= 3 else 1)
        gradients += params * g / (dp if layout.zero_stage >= 2 else 1)
        share = params / (dp if layout.zero_stage >= 1 else 1)
        optimizer += share * at_init
        moments += share * at_step
        accumulated += share * w if accumulating else 0
    return StateBytes(weights, gradients, optimizer, moments, layout.offload_optimizer, accumulated)


def model_state_bytes(total: int, experts: int, ep_size: int, layout: Layout, gpus: int,
                      optimizer_step: bool = True) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) of weights, gradients and optimizer states on one rank (`state_bytes`).
    `optimizer_step` False: before the first step, when the optimizer holds only what initialisation and the first
    backward make."""
    states = state_bytes(total, experts, ep_size, layout, gpus)
    optimizer = states.optimizer + states.accumulated + (states.moments if optimizer_step else 0)
    gpu = states.weights + states.gradients
    return (gpu, optimizer) if states.offloaded else (gpu + optimizer, 0.0)


def largest_parameter(config: AdaptiveDSConfig) -> int:
    """The elements of the model's largest parameter tensor: an embedding, or one projection of a block (an expert
    is a module of its own). ZeRO-Offload keeps a gradient buffer of this size in the training precision in CPU RAM
    and another on the GPU (`temp_grad_buffer_for_cpu_offload`, `..._gpu_offload`)."""
    h = config.hidden_size
    widths = [config.intermediate_size, config.num_attention_heads * config.head_dim]
    if config.num_moe_layers:
        widths += [config.expert_intermediate_size, config.shared_intermediate_size]
    return max(config.vocab_size * h, *(h * width for width in widths))


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


def planned_config(preset: str | None, arch: str, vocab_size: int, overrides: dict) -> AdaptiveDSConfig:
    """The model of `preset` in `arch` with `overrides`; without a preset (a pretrained folder of no preset's shape),
    the model the overrides describe, which must then name its shape."""
    if preset is not None:
        return model_config(preset, arch, vocab_size, **overrides)
    missing = [name for name in SHAPE_FIELDS if name not in overrides]
    if missing:
        raise ValueError(f"a model of no preset needs its shape: {', '.join(missing)} missing")
    return AdaptiveDSConfig(**{"arch": arch, "vocab_size": pad_vocab(vocab_size), **VARIANTS[arch].model, **overrides})


@lru_cache(maxsize=512)
def _model_facts(preset: str | None, arch: str, vocab_size: int, overrides_json: str, seq_len: int) -> ModelFacts:
    config = planned_config(preset, arch, vocab_size, json.loads(overrides_json))
    return ModelFacts(config, parameter_counts(config), expert_parameters(config),
                      training_flops_per_token(config, seq_len))


def model_facts(preset: str | None, arch: str, vocab_size: int, overrides: dict | None = None,
                seq_len: int | None = None) -> ModelFacts:
    """`seq_len`: the sequence the FLOPs are counted at (default: the preset's)."""
    return _model_facts(preset, arch, vocab_size, json.dumps(overrides or {}, sort_keys=True),
                        _seq_len(preset, seq_len))


def _seq_len(preset: str | None, seq_len: int | None) -> int:
    if seq_len is not None:
        return seq_len
    if preset is None:
        raise ValueError("a model of no preset needs its seq_len")
    return PRESETS[preset].seq_len


@dataclass
class Plan:
    preset: str | None  # None: a pretrained model of no preset's shape (`plan`'s model_overrides hold its shape)
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
    host_memory_gib: float | None  # CPU RAM per GPU of the host (default: the usual one, adaptive_ds/hardware.py)
    host_label: str  # which host that is: the usual one with this GPU, the one a user gave, or an advised one
    host_detail: str | None  # what it is: the usual instance, or where the given figure comes from
    problems: list[str]  # what else stops it running as planned (DeepSpeed refuses the layout, the host is short)
    flops_per_token: float
    tokens_per_s_bound: float
    tokens_per_s_projected: float
    mfu: float
    tokens: int
    hours: float
    cost_usd: float
    price_per_gpu_hour: float
    seq_len: int
    optimizer_step: bool  # False: the peak of a forward and backward pass before any optimizer step
    # of the peak, what is host RAM: for a CPU process, the offloaded part of its peak phase (the backward's or the
    # step's, `_cpu_process_parts`); for a GPU plan 0 (its peak is the GPU's)
    peak_host_gib: float = 0.0
    accumulation: int = 1  # gradient_accumulation_steps, as DeepSpeed runs the config on `gpus`
    accumulation_buffers_gib: float = 0.0  # of cpu_states_gib: the offload's gradient accumulation buffers
    pinned_rounding_gib: float = 0.0  # of cpu_states_gib: torch's pinned allocator rounding pinned buffers up

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
         cpu_process: bool = False, host_memory_gib: float | None = None, seq_len: int | None = None,
         optimizer_step: bool = True, host_detail: str | None = None) -> Plan:
    """`cpu_process`: predict a CPU process's peak resident memory instead of a GPU allocator's peak
    (`_cpu_process_parts`); the offloaded states are then in the same memory, and `peak_gib` holds them too
    (`peak_host_gib` their part of it).
    `host_memory_gib`: the CPU RAM per GPU of the machine (default: the usual instance with that GPU,
    `adaptive_ds/hardware.py`); `host_detail`: where a given figure comes from, in words (the plan then names it
    "the host given", else "the host": an advised one). `preset` None: a model of no
    preset's shape, which `model_overrides` then describe, at `seq_len` (default: the preset's). `optimizer_step`
    False: the peak of a forward and backward pass before the first optimizer step (`model_state_bytes`)."""
    seq_len = _seq_len(preset, seq_len)
    model = model_facts(preset, arch, vocab_size, model_overrides, seq_len)
    config, counts = model.config, model.counts
    layout = Layout.from_ds_config(ds_config, activation_checkpointing, gpus)
    ep_size = config.expert_parallel_size
    states = state_bytes(counts.total, model.experts, ep_size, layout, gpus)
    states_gpu, states_cpu = model_state_bytes(counts.total, model.experts, ep_size, layout, gpus, optimizer_step)
    staging = largest_parameter(config) * (2 if layout.half_precision else 4) if layout.offload_optimizer else 0
    states_cpu += staging  # the offload's gradient buffer in CPU RAM (its GPU twin: `_cpu_process_parts`)
    rounding = 0.0 if cpu_process else _pinned_rounding(config, layout, gpus, optimizer_step)
    states_cpu += rounding
    without = activation_bytes(config, layout, seq_len, checkpointing=False)
    with_ckpt = activation_bytes(config, layout, seq_len, checkpointing=True)
    activations = with_ckpt if activation_checkpointing else without
    peak, peak_host = (states_gpu + activations) / GIB, 0.0
    if cpu_process:
        adam = (_torch_adam_step_bytes(counts.total, model.experts, ep_size, layout, gpus)
                if optimizer_step and not layout.offload_optimizer else 0)
        device_part, host_part = _cpu_process_parts(states, activations, staging, optimizer_step, adam)
        peak, peak_host = (device_part + host_part) / GIB, host_part / GIB
    device = DEVICES[gpu]
    host, host_label, host_detail = _host(gpu, host_memory_gib, host_detail)
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
                host_memory_gib=host, host_label=host_label, host_detail=host_detail,
                problems=_problems(config, layout, gpus, states_cpu / GIB, host,
                                   host_words(host, host_label, host_detail)),
                flops_per_token=model.flops_per_token,
                tokens_per_s_bound=bound, tokens_per_s_projected=projected, mfu=mfu, tokens=tokens, hours=hours,
                cost_usd=hours * gpus * price, price_per_gpu_hour=price, seq_len=seq_len,
                optimizer_step=optimizer_step, peak_host_gib=peak_host, accumulation=layout.accumulation,
                accumulation_buffers_gib=states.accumulated / GIB, pinned_rounding_gib=rounding / GIB)


def _pinned_rounding(config: AdaptiveDSConfig, layout: Layout, gpus: int, optimizer_step: bool) -> float:
    """What torch's CUDA pinned allocator adds to the host part of a ZeRO-1/2 offload that pins its buffers
    (`planner_host`; ZeRO-3's offload keeps other buffers, not modelled). A CPU process has none: DeepSpeed's CPU
    accelerator pins nothing."""
    if not (layout.offload_optimizer and layout.pin_memory and layout.zero_stage in (1, 2)):
        return 0.0
    host = partial(offload_host_bytes, config, layout.half_precision, layout.accumulation, gpus, optimizer_step)
    return host(pinned=True) - host(pinned=False)


def _host(gpu: str, host_memory_gib: float | None, detail: str | None) -> tuple[float | None, str, str | None]:
    """The host RAM per GPU a plan assumes, its name and its detail: the usual instance with that GPU unless
    given."""
    if host_memory_gib is not None:
        return host_memory_gib, "the host given" if detail else "the host", detail
    device = DEVICES[gpu]
    return device.host_memory_gib, f"the usual {gpu} host", device.host_instance


def _cpu_process_parts(states: StateBytes, activations: float, staging: float, optimizer_step: bool,
                       torch_adam_step: float) -> tuple[float, float]:
    """A CPU process's peak resident bytes, its "GPU" and its host one memory: (what a GPU would hold, what the
    offload holds in host RAM) in its peak phase.

    Without offload all of it would be the GPU's, and the states peak together: the weights, the gradients and the
    optimizer state, the temporaries of torch's AdamW step, the CPU's optimizer (`torch_adam_step` bytes), and the
    weights' originals that DeepSpeed frees once it has flattened them into its contiguous buffer
    (stage_1_and_2.py, `flatten_dense_tensors_aligned`).

    Offloaded (ZeRO-Offload, DeepSpeed's CPU Adam), the process holds from initialisation the weights and the offload's
    GPU-side gradient buffer (`staging` bytes), and on the host side the optimizer state, its gradient buffer and any
    accumulation buffers; then either the backward pass's gradients and activations (the GPU's: ZeRO copies each
    bucket of gradients into the fp32 partition and frees it, so none is left at the step) or the step's Adam moments
    (the host's), whichever phase is larger: CPU Adam updates the partition in place, and makes no temporaries.

    The flatten's originals are freed by the same code in both; whether their memory leaves the process is the C
    allocator's (glibc returns a block it mapped on its own, keeps a heap block for reuse), and the recorded engine
    phases differ on it: without offload (fp32, `benchmarks/realsize_cpu.json`) the engine phase holds a third copy
    of the fp32 weights beside the weights and the master copy; with offload (fp16, `realsize_b1_cpu.json`), where the
    originals are the fp32 weights and their fp16 cast, it holds neither. So they count without offload only."""
    if not states.offloaded:
        held = states.weights + states.gradients + states.optimizer + states.weights + activations
        return held + (states.moments + torch_adam_step if optimizer_step else 0), 0.0
    device, host = states.weights + staging, states.optimizer + staging + states.accumulated
    backward = (device + states.gradients + activations, host)
    step = (device, host + states.moments) if optimizer_step else (device, host)
    return backward if sum(backward) > sum(step) else step


def _problems(config: AdaptiveDSConfig, layout: Layout, gpus: int, cpu_gib: float, host: float | None,
              words: str) -> list[str]:
    """What stops a layout that fits the GPU: what DeepSpeed refuses, and a host too small for the offload."""
    found = []
    if config.zero3_problem is not None and layout.zero_stage == 3:
        split = " with expert parallelism" if config.num_moe_layers else ""
        found.append(f"{config.zero3_problem} (stage 1 or 2{split} does)")
    if gpus % config.expert_parallel_size:
        found.append(f"moe_ep_size {config.moe_ep_size} needs a multiple of {config.moe_ep_size} GPUs, not {gpus}")
    if host is not None and cpu_gib > host:
        found.append(f"the offloaded optimizer needs {cpu_gib:.1f} GiB of CPU RAM per GPU, more than the {words}")
    return found


def gib_text(value: float) -> str:
    """A host's GiB as a person states them: whole GiB without a decimal (16), else one decimal (12.7)."""
    return f"{round(value, 1):g}"


def host_words(host: float | None, label: str, detail: str | None) -> str:
    """A plan's host in words: "16 GiB per GPU of the usual t4 host, AWS g4dn.xlarge (1 GPU, 16 GiB)"."""
    if host is None:
        return f"{label}: none is known"
    return f"{gib_text(host)} GiB per GPU of {label}" + (f", {detail}" if detail else "")


def host_memory_text(p: Plan) -> str:
    """The CPU RAM a plan's offloaded optimizer needs, beside what its host has."""
    need = f"{p.cpu_states_gib:.1f} GiB of CPU RAM per GPU for the offloaded optimizer"
    if p.host_memory_gib is None:
        return f"{need} (no usual {p.gpu} host is known: compare with the machine's, or pass --host_ram_gib)"
    return f"{need}, of the {host_words(p.host_memory_gib, p.host_label, p.host_detail)}"


def host_parts_text(p: Plan) -> str | None:
    """What of a plan's offloaded host part comes from gradient accumulation and from pinning, and the assumption
    pinning rests on (None: neither)."""
    parts = []
    if p.accumulation_buffers_gib:
        parts.append(f"{p.accumulation_buffers_gib:.1f} GiB of gradient accumulation buffers (accumulation "
                     f"{p.accumulation}: DeepSpeed keeps one per parameter in the training precision)")
    if p.pinned_rounding_gib:
        parts.append(f"{p.pinned_rounding_gib:.1f} GiB of pinned-memory rounding (pin_memory: torch's CUDA pinned "
                     "allocator rounds each pinned buffer up to the next power of two)")
    return "of which " + "; ".join(parts) if parts else None


def host_line(p: Plan) -> str:
    """The host RAM a plan assumes, named whether or not it offloads to it (and how to give one's own, unless the
    text names the flag already)."""
    if p.cpu_states_gib:
        text = host_memory_text(p)
    else:
        text = "nothing offloaded to CPU RAM; host assumed: " + host_words(p.host_memory_gib, p.host_label,
                                                                            p.host_detail)
    yours = p.host_label == "the host given" or "--host_ram_gib" in text
    return f"host RAM: {text}" + ("" if yours else " (--host_ram_gib: yours)")


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
