"""Training FLOPs per token from the model's dimensions, for MFU and MoD's FLOPs reduction.

Uses the PaLM appendix B accounting (Chowdhery et al. 2022): 6 FLOPs per parameter per token for the
matmuls (forward + backward) plus 12 * hidden * context per layer for attention scores and values.
A MoD block run on a fraction r of the tokens costs r of its matmuls and r^2 of its attention, since its
attention only spans the routed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from .models.configuration import AdaptiveDSConfig


def training_flops_per_token(config: AdaptiveDSConfig, seq_len: int,
                             routed_fractions: Sequence[float] | None = None) -> float:
    """FLOPs of one training token. `routed_fractions`: the share of tokens each MoD block ran on, in order;
    None uses the configured capacity. Embedding lookups are free; the LM head counts."""
    h, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    attention_params = 2 * h * h + 2 * h * kv
    mlp_params = 3 * h * f
    flops = 6.0 * config.vocab_size * h  # LM head
    mod_blocks = iter(routed_fractions or [])
    for i in range(config.num_hidden_layers):
        active_mlp = mlp_params * config.num_experts_per_tok + h * config.num_local_experts \
            if config.is_moe_layer(i) else mlp_params
        block = 6.0 * (attention_params + active_mlp) + 12.0 * h * seq_len
        if config.is_mod_layer(i):
            r = next(mod_blocks, config.mod_capacity)
            routing = h + (h + 1) * config.mod_predictor_hidden_size  # router + causal predictor, every token
            block = 6.0 * (attention_params + active_mlp) * r + 12.0 * h * seq_len * r * r + 6.0 * routing
        flops += block
    return flops
