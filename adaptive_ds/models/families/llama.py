"""Llama (`LlamaForCausalLM`, its 3.x and SmolLM2 configs included): imports as a dense model, whose blocks are
Llama's parameter for parameter, under the same tensor names; a dense model (or one retrofitted with MoD at capacity
1.0) exports to it.

Every Llama-style family (Mistral, Qwen2, Qwen3 and the MoE ones, Mixtral and Qwen3-MoE) shares these blocks' names,
norms and config fields, so their families reuse `llama_fields`, `llama_feature_problems`, `stock_config_fields`,
`feature_mismatch`, `dense_incompatibility` and `dense_exporter` from here, and say only how their attention
differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedConfig, PreTrainedModel

from ..configuration import ROPE_SCALING_KEYS, AdaptiveDSConfig
from .registry import NAMED_FIELDS, Family


def rope_scaling(config: PreTrainedConfig) -> dict | None:
    """A stock config's RoPE scaling as AdaptiveDSConfig's `rope_scaling_parameters` hold it: transformers'
    `rope_parameters` less the base (None: plain RoPE; transformers reads a legacy `rope_scaling` into them)."""
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        return None
    return {key: value for key, value in rope.items() if key not in ("rope_theta", "type")} | {
        "rope_type": rope.get("rope_type", rope.get("type"))}


def llama_fields(config: PreTrainedConfig) -> dict:
    """The AdaptiveDSConfig fields a Llama-style config fixes: its shape, norm epsilon, RoPE base, scaling and
    context, head width and embedding tying (transformers keeps the RoPE base in `rope_parameters`)."""
    quotient = config.hidden_size // config.num_attention_heads
    return {**{name: getattr(config, name) for name in NAMED_FIELDS},
            "rope_theta": float((config.rope_parameters or {}).get("rope_theta", 10000.0)),
            "rope_scaling_parameters": rope_scaling(config), "head_dim": getattr(config, "head_dim", None) or quotient,
            "tie_word_embeddings": bool(config.tie_word_embeddings)}


def attention_bias_fields(config: PreTrainedConfig) -> dict:
    """Llama's (and Qwen3's) `attention_bias`: biases on all four attention projections, or none."""
    bias = bool(getattr(config, "attention_bias", False))
    return {"attention_qkv_bias": bias, "attention_out_bias": bias}


def llama_feature_problems(config: PreTrainedConfig) -> list[str]:
    """The features of a Llama-style config that adaptive_ds's models do not have, one line each."""
    found = []
    rope = dict(config.rope_parameters or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", *ROPE_SCALING_KEYS):
        found.append(f"scales RoPE by rope_type {rope_type!r}; adaptive_ds's RoPE scalings: "
                     f"{', '.join(ROPE_SCALING_KEYS)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        found.append(f"rotates {rope['partial_rotary_factor']} of each head (partial_rotary_factor); adaptive_ds's "
                     "RoPE rotates the whole head")
    if getattr(config, "mlp_bias", False):
        found.append("has mlp_bias true; adaptive_ds's MLPs have no biases")
    if getattr(config, "hidden_act", "silu") != "silu":
        found.append(f"has hidden_act {config.hidden_act!r}; adaptive_ds's MLPs are SwiGLU (silu)")
    return found


def stock_config_fields(config: AdaptiveDSConfig) -> dict:
    """The fields every Llama-style stock config (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) takes from an
    adaptive_ds model's config."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling_parameters is not None:
        rope = {**config.rope_scaling_parameters, "rope_theta": config.rope_theta}
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                rms_norm_eps=config.rms_norm_eps, rope_parameters=rope, tie_word_embeddings=config.tie_word_embeddings,
                bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)


def llama_config_fields(config: AdaptiveDSConfig) -> dict:
    """The LlamaConfig fields of an adaptive_ds model's config."""
    return {**stock_config_fields(config), "attention_bias": config.attention_qkv_bias}


def feature_mismatch(config: AdaptiveDSConfig, family: str, *, qkv_bias=(False,), out_bias=(False,),
                     qk_norm=(False,), sliding_window: bool = False, tied_biases: bool = False) -> str | None:
    """Why the attention of a model of `config` is not one `family`'s stock class computes (None: it is): the
    values each feature may take there, `tied_biases` where one flag sets all four biases."""
    found = []
    for field, allowed in (("attention_qkv_bias", qkv_bias), ("attention_out_bias", out_bias), ("qk_norm", qk_norm)):
        if getattr(config, field) not in allowed:
            found.append(f"{field} {getattr(config, field)}")
    if tied_biases and config.attention_qkv_bias != config.attention_out_bias:
        found.append("biases on q/k/v but not on o, or the other way round (one attention_bias sets all four)")
    if config.sliding_window is not None and not sliding_window:
        found.append(f"sliding_window {config.sliding_window}")
    return f"{family} has no {', '.join(found)}" if found else None


def dense_incompatibility(config: AdaptiveDSConfig, family: str) -> str | None:
    """Why a model cannot be a dense stock model of `family`, for its architecture, or None if it can: see
    `llama_incompatibility`."""
    spec = config.arch_spec
    if spec.plain:
        return None
    if spec.moe:
        return f"arch is {config.arch!r}: MoE layers have no {family} equivalent (an MoE family's class may hold them)"
    if spec.mlp is not None:
        return f"arch is {config.arch!r}: its MLP is its own, not a {family}'s SwiGLU"
    if not config.mod_straight_through:
        return (f"its MoD blocks scale their update by sigmoid(router logit), which a {family} has no place for "
                f"(a model retrofitted with MoD, mod_straight_through, at mod_capacity 1.0 exports as a {family})")
    if config.mod_capacity != 1.0:
        return (f"it trained at mod_capacity {config.mod_capacity}, and a {family} runs every token through every "
                "block, which is its function only at mod_capacity 1.0")
    return None


def llama_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model cannot be a stock Llama, or None if it can: a plain model (`ArchitectureSpec.plain`: dense) is
    one parameter for parameter, one with experts or an MLP of its own is not; a MoD model with the straight-through
    update scale (`mod_straight_through`: a dense model retrofitted with MoD) at `mod_capacity` 1.0 is one, its
    routers dropped: every token runs every block, scaled by exactly 1, as in its training. Below capacity 1.0 the
    Llama would compute a function the model never trained (its blocks saw only the routed share of the tokens), so
    it is refused. Its attention must be Llama's: biases on all four projections or none, no q/k norm, no sliding
    window."""
    return dense_incompatibility(config, "Llama") or feature_mismatch(
        config, "Llama", qkv_bias=(False, True), out_bias=(False, True), tied_biases=True)


def llama_state(state: dict) -> dict:
    """A Llama's state dict from a dense (or retrofitted MoD) model's: a MoD block wraps the dense block as `block`,
    beside its router (and causal-routing predictor), which a Llama does not have."""
    return {re.sub(r"^(model\.layers\.\d+\.)block\.", r"\1", name): tensor
            for name, tensor in state.items() if not re.search(r"\.(router|predictor)\.", name)}


def dense_exporter(model_type: str, stock_class: type, config_class: type,
                   incompatibility: Callable[[AdaptiveDSConfig], str | None],
                   config_fields: Callable[[AdaptiveDSConfig], dict]) -> Callable[[PreTrainedModel], PreTrainedModel]:
    """`Family.to_stock` of a dense Llama-style family: our dense blocks are its blocks, parameter for parameter
    under the same names (a retrofitted MoD model at capacity 1.0: its logits, every token through every block)."""

    def to_stock(model: PreTrainedModel) -> PreTrainedModel:
        reason = incompatibility(model.config)
        if reason:
            raise ValueError(f"--to {model_type} needs a dense model (or a dense model retrofitted with MoD at "
                             f"capacity 1.0) of its attention; this one: {reason}")
        stock = stock_class(config_class(**config_fields(model.config)))
        stock.load_state_dict(llama_state(model.state_dict()), strict=True)
        return stock.to(model.dtype)

    return to_stock


to_llama = dense_exporter("llama", LlamaForCausalLM, LlamaConfig, llama_incompatibility, llama_config_fields)


def _llama_import_fields(config: PreTrainedConfig) -> dict:
    return {**llama_fields(config), **attention_bias_fields(config)}


LLAMA = Family("llama", "LlamaForCausalLM", LlamaConfig, "dense", _llama_import_fields,
               feature_problems=llama_feature_problems,
               upcycled_model_type="mixtral", export_problem=llama_incompatibility, to_stock=to_llama)
