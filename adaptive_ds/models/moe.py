"""Mixture-of-Experts feed-forward: a DeepSpeed MoE layer whose experts are SwiGLU MLPs.

The expert parameters are created by `deepspeed.moe.layer.MoE`, so they carry the `allreduce=False` and
`group_name` marks that DeepSpeed's ZeRO optimizer, gradient all-reduce and MoE checkpoint layout expect.
"""

from __future__ import annotations

import torch
from deepspeed.moe.layer import MoE
from torch import nn

from .configuration import AdaptiveDSConfig


class SwiGLU(nn.Module):
    """SwiGLU feed-forward, down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts through `deepspeed.moe.layer.MoE` (GShard-style gating and all-to-all).

    Returns the layer output, DeepSpeed's load-balancing loss for this layer (Lepikhin et al. 2020, eq. 4:
    E^2 * mean_e(mean gate prob_e * fraction routed_e), 1.0 when balanced) and the tokens assigned per expert.
    """

    def __init__(self, config: AdaptiveDSConfig):
        super().__init__()
        self.moe = MoE(
            hidden_size=config.hidden_size,
            expert=SwiGLU(config.hidden_size, config.intermediate_size),
            num_experts=config.num_local_experts,
            ep_size=config.moe_ep_size,
            k=config.num_experts_per_tok,
            capacity_factor=config.moe_capacity_factor,
            eval_capacity_factor=config.moe_eval_capacity_factor,
            min_capacity=config.moe_min_capacity,
            drop_tokens=config.moe_drop_tokens,
            use_rts=False,  # random token selection would make routing depend on the RNG, not the input
            top2_2nd_expert_sampling=False,  # deterministic top-2, as in Mixtral
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden_states: (batch, seq, hidden); DeepSpeed flattens to tokens internally.
        output, aux_loss, expert_counts = self.moe(hidden_states)
        return output, aux_loss, expert_counts
