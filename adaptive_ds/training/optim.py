"""Optimizer parameter groups and the learning-rate schedule handed to the DeepSpeed engine."""

from __future__ import annotations

import math

from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay for matrices; none for norms and biases (1-D parameters); MoE experts in DeepSpeed's MoE groups.

    DeepSpeed's ZeRO optimizer reduces expert gradients over the expert-data-parallel group only if the
    experts sit in param groups marked `moe` (made by `split_params_into_different_moe_groups_for_optimizer`).
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in groups if g["params"]]


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
