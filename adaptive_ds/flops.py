"""Training FLOPs per token from the model's dimensions, for MFU and MoD's FLOPs reduction.

Uses the PaLM appendix B accounting (Chowdhery et al. 2022): 6 FLOPs per parameter per token for the
matmuls (forward + backward) plus 12 * heads * head_dim * context per layer for attention scores and values
(12 * hidden * context where head_dim is hidden / heads).
A MoD block run on a fraction r of the tokens costs r of its matmuls and r^2 of its attention, since its
attention only spans the routed tokens. Its router runs on every token, as does a causal-routing predictor;
the predictor's input is detached, so the backward of its first layer computes no input gradient (4 FLOPs per
parameter there, not 6).
"""

from __future__ import annotations

from collections.abc import Sequence

from .models.configuration import AdaptiveDSConfig
from .presets import block_parameters


def training_flops_per_token(config: AdaptiveDSConfig, seq_len: int,
                             routed_fractions: Sequence[float] | None = None) -> float:
    """FLOPs of one training token. `routed_fractions`: the share of tokens each MoD block ran on, in order;
    None uses the configured capacity. Embedding lookups are free; the LM head counts."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim  # the width attention's scores and values span
    flops = 6.0 * config.vocab_size * h  # LM head (tied to the embedding or not, it is a matmul)
    mod_blocks = iter(routed_fractions or [])
    for i in range(config.num_hidden_layers):
        params = block_parameters(config, i)
        matmuls = params.attention + params.mlp_active  # norms are not matmuls
        if config.is_mod_layer(i):
            r = next(mod_blocks, config.mod_capacity)
            # the routed share runs the block; router and predictor run on every token
            flops += 6.0 * matmuls * r + 12.0 * q * seq_len * r * r + 6.0 * params.mod_router
            if params.mod_predictor:  # (h + 1) * p parameters: h * p in the first layer, p in the second
                flops += 4.0 * params.mod_predictor + 2.0 * config.mod_predictor_hidden_size
        else:
            flops += 6.0 * matmuls + 12.0 * q * seq_len
    return flops
