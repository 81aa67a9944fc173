"""Mixture-of-Depths routing around a whole decoder block (Raposo et al. 2024, arXiv 2404.02258)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .configuration import AdaptiveDSConfig


def routed_token_count(seq_len: int, capacity: float) -> int:
    """Tokens of each sequence that pass through a routed block: ceil(capacity * seq_len), at least one."""
    return max(1, math.ceil(capacity * seq_len - 1e-9))


class MixtureOfDepths(nn.Module):
    """Routes the top `capacity * seq_len` tokens of each sequence through `block`; the rest skip it.

    Implements eq. (1) of Raposo et al.: x_{l+1} = r * f(x~) + x for routed tokens and x_{l+1} = x otherwise,
    where f(x~) is the block's residual update computed on the routed tokens alone. The scale r is the
    sigmoid of the router logit (a bounded stand-in for the raw logit, with the same top-k order) so the
    router receives gradient through the LM loss. Top-k is taken per sequence, never across the batch, and the
    routed tokens keep their original RoPE positions and causal order, so compute drops to the routed share.
    """

    def __init__(self, config: AdaptiveDSConfig, block: nn.Module):
        super().__init__()
        self.capacity = config.mod_capacity
        self.router = nn.Linear(config.hidden_size, 1, bias=False)
        self.block = block

    def forward(self, hidden_states, position_embeddings, key_padding_mask=None, cache=None):
        batch, seq_len, hidden = hidden_states.shape
        k = routed_token_count(seq_len, self.capacity)
        scores = self.router(hidden_states).squeeze(-1).float()  # (batch, seq)
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask[:, -seq_len:], float("-inf"))
        selected = scores.topk(k, dim=1).indices.sort(dim=1).values  # (batch, k), in sequence order
        gather_hidden = selected.unsqueeze(-1).expand(-1, -1, hidden)
        routed = hidden_states.gather(1, gather_hidden)  # (batch, k, hidden)

        cos, sin = position_embeddings  # (1 or batch, seq, head_dim)
        gather_rope = selected.unsqueeze(-1).expand(-1, -1, cos.shape[-1])
        routed_rope = (cos.expand(batch, -1, -1).gather(1, gather_rope),
                       sin.expand(batch, -1, -1).gather(1, gather_rope))
        routed_mask = None if key_padding_mask is None else key_padding_mask.gather(1, selected)

        out = self.block(routed, routed_rope, routed_mask, cache=None)
        weight = torch.sigmoid(scores.gather(1, selected)).unsqueeze(-1).to(hidden_states.dtype)
        update = (out.hidden_states - routed) * weight  # (batch, k, hidden)
        return out._replace(hidden_states=hidden_states.scatter_add(1, gather_hidden, update), mod_selected=selected)
