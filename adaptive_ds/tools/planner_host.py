"""ZeRO-Offload's host RAM buffer by buffer, and what torch's pinned-memory allocator makes of it (the planner's host
part of a GPU plan whose offload pins its buffers: `planner.plan`).

DeepSpeed 0.19's ZeRO-1/2 optimizer with `offload_optimizer` (runtime/zero/stage_1_and_2.py) keeps in host RAM, per
rank and per optimizer param group (`training/optim.py`'s: decay matrices, no-decay norms and biases, experts in groups
of whole MoE layers under DeepSpeed's cap), the fp32 master partition, its fp32 gradient and a copy in the training
precision (each one tensor of the group's partition); one gradient buffer the size of the largest parameter; with
gradient accumulation above 1, a buffer in the training precision for each whole parameter of the rank's partition
(`accumulated_grads_in_cpu`, made at the first micro-step and kept); and at the first step CPU Adam's two fp32 moments
per group. With `pin_memory` every one of them but the moments (`torch.zeros_like`: pageable) is pinned through
`get_accelerator().pin_memory`, which on CUDA is `tensor.pin_memory()`: torch's CachingHostAllocator
(ATen/core/CachingHostAllocator.h, torch 2.13) rounds each allocation up to the next power of two unless
PYTORCH_ALLOC_CONF sets a lower pinned round threshold, and page-locked memory is resident. DeepSpeed's CPU
accelerator pins nothing, so a CPU measurement never shows the rounding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

from ..models.configuration import AdaptiveDSConfig


@dataclass(frozen=True)
class ParameterTensor:
    numel: int
    expert: bool  # a routed expert's: split over the expert-parallel ranks, partitioned over the rest
    decay: bool  # in a decay group (a matrix), else in the no-decay one (norms, biases)


def pinned_bytes(nbytes: float) -> float:
    """What torch's CUDA pinned allocator takes for a request of `nbytes`: the next power of two."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 1 else float(nbytes)


@lru_cache(maxsize=128)
def _tensors(config_json: str) -> tuple[ParameterTensor, ...]:
    import torch

    from ..models import AdaptiveDSForCausalLM
    from ..models.moe import MoEFeedForward

    config = AdaptiveDSConfig(**json.loads(config_json))
    with torch.device("meta"):
        model = AdaptiveDSForCausalLM(config)
    experts = {id(p) for module in model.modules() if isinstance(module, MoEFeedForward)
               for p in module.moe.deepspeed_moe.experts.parameters()}
    return tuple(ParameterTensor(p.numel(), id(p) in experts, p.ndim >= 2 and not name.endswith(".bias"))
                 for name, p in model.named_parameters() if p.requires_grad)


def parameter_tensors(config: AdaptiveDSConfig) -> tuple[ParameterTensor, ...]:
    """The parameter tensors one rank's model holds (its local experts), in the model's order, from the model built on
    the meta device."""
    return _tensors(config.to_json_string(use_diff=False))


def _expert_group_cap(config: AdaptiveDSConfig, tensors: tuple[ParameterTensor, ...], cap: int | None) -> int:
    """The most expert elements in one param group (`training.optim.moe_group_size`): whole MoE layers up to the cap
    (default: DeepSpeed's), or the cap where one layer's local experts exceed it."""
    if cap is None:
        from ..training.optim import DEEPSPEED_MOE_GROUP_CAP as cap  # imports DeepSpeed: only for a model with experts

    local = sum(t.numel for t in tensors if t.expert) // config.num_moe_layers  # one layer's local experts
    if local > cap:
        return cap
    return local * max(1, cap // (local * config.expert_parallel_size))


def optimizer_groups(config: AdaptiveDSConfig, cap: int | None = None) -> list[tuple[int, bool]]:
    """(elements, expert) of each param group ZeRO flattens, as `training.optim.parameter_groups` makes them: the
    decay and no-decay groups of the non-expert parameters, then the experts split greedily in model order into groups
    of at most the cap (DeepSpeed's `split_params_into_different_moe_groups_for_optimizer`; `cap`: the MoE group
    cap, default DeepSpeed's)."""
    tensors = parameter_tensors(config)
    groups = [(sum(t.numel for t in tensors if not t.expert and t.decay), False),
              (sum(t.numel for t in tensors if not t.expert and not t.decay), False)]
    experts = [t.numel for t in tensors if t.expert]
    if experts:
        cap, current = _expert_group_cap(config, tensors, cap), 0
        for numel in experts:
            if current and current + numel > cap:
                groups.append((current, True))
                current = 0
            current += numel
        groups.append((current, True))
    return [group for group in groups if group[0]]


def offload_host_bytes(config: AdaptiveDSConfig, half_precision: bool, accumulation: int, gpus: int,
                       optimizer_step: bool, pinned: bool) -> float:
    """One rank's host RAM under ZeRO-Offload (stage 1 or 2), buffer by buffer as the module's docstring lists them;
    `pinned`: each pinned buffer as torch's CUDA pinned allocator takes it (`pinned_bytes`). A group's partition is its
    elements over its ZeRO ranks (the expert groups' over the data-parallel ranks beside expert parallelism); the
    accumulation buffers, whole parameters, count for a rank as its share of them all."""
    w = 2 if half_precision else 4
    take = pinned_bytes if pinned else float
    expert_ranks = max(1, gpus // config.expert_parallel_size)
    total = 0.0
    for elements, expert in optimizer_groups(config):
        part = elements / (expert_ranks if expert else gpus)
        total += 2 * take(4 * part) + take(w * part) + (8 * part if optimizer_step else 0)
    tensors = parameter_tensors(config)
    total += take(w * max(t.numel for t in tensors))  # the offload's gradient buffer
    if accumulation > 1:
        total += sum(take(w * t.numel) / (expert_ranks if t.expert else gpus) for t in tensors)
    return total
