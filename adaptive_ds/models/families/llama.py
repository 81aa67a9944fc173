"""Llama (`LlamaForCausalLM`): imports as a dense model, whose blocks are Llama's parameter for parameter, under
the same tensor names; a dense model (or one retrofitted with MoD at capacity 1.0) exports to it.

Mixtral shares Llama's attention, norms and config fields, so its family reuses `llama_fields`,
`llama_feature_problems` and `llama_config_fields` from here.
"""

from __future__ import annotations

import re

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedConfig

from ..configuration import AdaptiveDSConfig
from .registry import NAMED_FIELDS, Family


def llama_fields(config: PreTrainedConfig) -> dict:
    """The AdaptiveDSConfig fields a Llama-style config fixes: its shape, norm epsilon, RoPE base and context
    (transformers keeps the RoPE base in `rope_parameters`)."""
    return {**{name: getattr(config, name) for name in NAMED_FIELDS},
            "rope_theta": float((config.rope_parameters or {}).get("rope_theta", 10000.0))}


def llama_feature_problems(config: PreTrainedConfig) -> list[str]:
    """The features of a Llama-style config that adaptive_ds's models do not have, one line each."""
    found = []
    rope = dict(config.rope_parameters or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":  # (transformers reads a config's legacy rope_scaling into rope_parameters)
        found.append(f"scales RoPE (rope_scaling / rope_parameters type {rope_type!r}); adaptive_ds's RoPE is the "
                     "default, unscaled one")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            found.append(f"has {flag} true; adaptive_ds's projections have no biases")
    if getattr(config, "sliding_window", None) is not None:
        found.append(f"has sliding_window {config.sliding_window}; adaptive_ds's attention is full causal attention")
    if getattr(config, "hidden_act", "silu") != "silu":
        found.append(f"has hidden_act {config.hidden_act!r}; adaptive_ds's MLPs are SwiGLU (silu)")
    head_dim = getattr(config, "head_dim", None)
    quotient = config.hidden_size // config.num_attention_heads
    if head_dim is not None and head_dim != quotient:
        found.append(f"has head_dim {head_dim}, not hidden_size / num_attention_heads {quotient}; adaptive_ds's "
                     "head_dim is that quotient")
    return found


def llama_config_fields(config: AdaptiveDSConfig) -> dict:
    """The LlamaConfig (and MixtralConfig) fields of an adaptive_ds model's config."""
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
                eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)


def llama_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model cannot be a stock Llama, or None if it can: a plain model (`ArchitectureSpec.plain`: dense) is
    one parameter for parameter, one with experts or an MLP of its own is not; a MoD
    model with the straight-through update scale (`mod_straight_through`: a dense model retrofitted with MoD) at
    `mod_capacity` 1.0 is one, its routers dropped: every token runs every block, scaled by exactly 1, as in its
    training. Below capacity 1.0 the Llama would compute a function the model never trained (its blocks saw only
    the routed share of the tokens), so it is refused."""
    spec = config.arch_spec
    if spec.plain:
        return None
    if spec.moe:
        return f"arch is {config.arch!r}: MoE layers have no Llama equivalent (--to mixtral exports MoE)"
    if spec.mlp is not None:
        return f"arch is {config.arch!r}: its MLP is its own, not a Llama's SwiGLU"
    if not config.mod_straight_through:
        return ("its MoD blocks scale their update by sigmoid(router logit), which a Llama has no place for "
                "(a model retrofitted with MoD, mod_straight_through, at mod_capacity 1.0 exports as a Llama)")
    if config.mod_capacity != 1.0:
        return (f"it trained at mod_capacity {config.mod_capacity}, and a Llama runs every token through every "
                "block, which is its function only at mod_capacity 1.0")
    return None


def llama_state(state: dict) -> dict:
    """A Llama's state dict from a dense (or retrofitted MoD) model's: a MoD block wraps the dense block as `block`,
    beside its router (and causal-routing predictor), which a Llama does not have."""
    return {re.sub(r"^(model\.layers\.\d+\.)block\.", r"\1", name): tensor
            for name, tensor in state.items() if not re.search(r"\.(router|predictor)\.", name)}


def to_llama(model) -> LlamaForCausalLM:
    """A stock LlamaForCausalLM with the same logits as `model` (an AdaptiveDSForCausalLM): our dense blocks are
    Llama's, parameter for parameter (a retrofitted MoD model at capacity 1.0: its logits, every token through every
    block; see `llama_incompatibility`)."""
    reason = llama_incompatibility(model.config)
    if reason:
        raise ValueError(f"--to llama needs a dense model (or a dense model retrofitted with MoD at capacity 1.0); "
                         f"this one: {reason}")
    llama = LlamaForCausalLM(LlamaConfig(**llama_config_fields(model.config)))
    llama.load_state_dict(llama_state(model.state_dict()), strict=True)
    return llama.to(model.dtype)


LLAMA = Family("llama", "LlamaForCausalLM", LlamaConfig, "dense", llama_fields,
               feature_problems=llama_feature_problems, export_problem=llama_incompatibility, to_stock=to_llama)
