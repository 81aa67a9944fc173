"""Optimizer parameter groups and the learning-rate schedule handed to the DeepSpeed engine."""

from __future__ import annotations

import math

from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from . import moe_adapter

# split_params_into_different_moe_groups_for_optimizer's default cap on an MoE param group, in elements
DEEPSPEED_MOE_GROUP_CAP = 178_956_971


def parameter_groups(model: nn.Module, weight_decay: float, moe_group_cap: int = DEEPSPEED_MOE_GROUP_CAP,
                     ) -> list[dict]:
    """Decay for matrices; none for norms and biases (1-D parameters); MoE experts in DeepSpeed's MoE groups.

    DeepSpeed's ZeRO optimizer reduces expert gradients over the expert-data-parallel group only if the
    experts sit in param groups marked `moe` (made by `split_params_into_different_moe_groups_for_optimizer`
    from the marks DeepSpeed's MoE layer puts on them). So `model` must have been prepared for DeepSpeed first
    (`moe_adapter.prepare`, which `engine.build_engine` calls): its MoE MLPs in DeepSpeed's layer, their experts
    packed. Those groups hold whole MoE layers (see `moe_group_size`). Reads the model, changes nothing in it.
    """
    unprepared = [layer for layer in moe_adapter.moe_layers(model) if not moe_adapter.is_prepared(layer)]
    assert not unprepared, "prepare the model for DeepSpeed (moe_adapter.prepare) before building its param groups"
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    groups = split_params_into_different_moe_groups_for_optimizer(groups, moe_group_size(model, moe_group_cap))
    return [g for g in groups if g["params"]]


def moe_group_size(model: nn.Module, cap: int = DEEPSPEED_MOE_GROUP_CAP) -> int:
    """The most expert-parameter elements per optimizer param group: a whole number of MoE layers under `cap`.

    ZeRO flattens each param group into one buffer, so the experts of a layer that no group boundary cuts lie at
    one stride there, and the grouped GEMM reads them as a view instead of stacking a copy on every forward
    (models/moe.py, `stacked_weights`). DeepSpeed's own cap cuts layers wherever it falls (4 of debug_200m's 12,
    all of b1's at `moe_ep_size` 1). A layer's local experts larger than `cap` keep DeepSpeed's cut (and the copy)
    rather than a group past the cap DeepSpeed chose; there the number of groups depends on `moe_ep_size`, and a
    resume on another ep_size is refused (checkpoint.restore) rather than loaded into the wrong groups.
    """
    layers = moe_adapter.moe_layers(model)
    if not layers:
        return cap
    local = sum(p.numel() for p in layers[0].moe.deepspeed_moe.experts.parameters())
    whole = local * layers[0].moe.ep_size  # the layer's experts on all ranks
    if local > cap:
        return cap
    # As many layers a group as fit the cap with every expert of a layer in one place, at every ep_size alike: the
    # number of groups must not change with ep_size, since DeepSpeed's universal loader pairs groups by position.
    return local * max(1, cap // whole)


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """lr multiplier: linear warmup from 0 to 1 over `warmup_steps`, then cosine decay to `min_ratio` at the end."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def scheduler_factory(warmup_steps: int, total_steps: int, min_ratio: float):
    """A callable DeepSpeed applies to the optimizer it builds (DeepSpeedSchedulerCallable)."""
    return lambda optimizer: LambdaLR(optimizer, warmup_cosine(warmup_steps, total_steps, min_ratio))
