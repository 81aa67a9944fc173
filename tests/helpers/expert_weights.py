"""An MoE layer's expert weights as DeepSpeed's MoE layer holds them: per expert, per projection, and where their
storage lives (the grouped GEMM's stacked-weight tests, with and without the engine)."""

import torch

from adaptive_ds.models.moe import MoEFeedForward

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_modules(layer: MoEFeedForward):
    return layer.moe.deepspeed_moe.experts.deepspeed_experts


def projection_weights(layer: MoEFeedForward, name: str) -> list[torch.nn.Parameter]:
    return [getattr(e, name).weight for e in expert_modules(layer)]


def weight_storages(layer: MoEFeedForward) -> list[int]:
    return [w.untyped_storage().data_ptr() for name in PROJECTIONS for w in projection_weights(layer, name)]
