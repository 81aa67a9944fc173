"""Mixtral (`MixtralForCausalLM`): imports as MoE with Mixtral's routing; a top-k MoE model whose inference routing
is Mixtral's exports to it.

Weight names. Ours (an MoE layer at layer L, expert E of the layer's routed experts; `mlp.moe.deepspeed_moe.` is
the prefix DeepSpeed's layer gave the tensors in training):

    model.layers.L.mlp.moe.deepspeed_moe.gate.wg.weight                                   (experts, hidden)
    model.layers.L.mlp.moe.deepspeed_moe.experts.deepspeed_experts.E.{gate,up}_proj.weight (ffn, hidden)
    model.layers.L.mlp.moe.deepspeed_moe.experts.deepspeed_experts.E.down_proj.weight      (hidden, ffn)

Mixtral's, in transformers' in-memory layout (`mlp.gate.weight`, `mlp.experts.gate_up_proj` (experts, 2 ffn,
hidden): gate rows then up rows, `mlp.experts.down_proj` (experts, hidden, ffn)), or as checkpoints on the Hub
store them (`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.E.w1 / w3 / w2.weight`: gate, up, down).
Attention, norms, the embedding and the LM head have Llama's names in both.
"""

from __future__ import annotations

import re

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedConfig

from ..configuration import AdaptiveDSConfig
from ..upcycling import Reader
from .llama import feature_mismatch, llama_feature_problems, llama_fields, stock_config_fields
from .registry import Family

_OURS = r"model\.layers\.(\d+)\.mlp\.moe\.deepspeed_moe\."
_GATE = re.compile(_OURS + r"gate\.wg\.weight")
_EXPERT = re.compile(_OURS + r"experts\.deepspeed_experts\.(\d+)\.(\w+_proj)\.weight")
MIXTRAL_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # the Hub checkpoints' names


def mixtral_routing(config: PreTrainedConfig) -> dict:
    """Mixtral's routing: its experts and top-k, renormalised over the k (for k = 1 too), dropless in training as
    well, as Mixtral trains (`--model moe_drop_tokens` may ask for the capacity limit)."""
    return dict(num_local_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_renormalize_top1=config.num_experts_per_tok == 1, moe_drop_tokens=False)


def mixtral_reader(read: Reader, names: set[str]) -> Reader:
    """A reader by our MoE model's tensor names over a Mixtral folder's reader (`names`: the folder's tensor names,
    which tell its layout apart, layer by layer)."""

    def read_ours(name: str, index: int | None = None) -> torch.Tensor:
        gate, expert = _GATE.fullmatch(name), _EXPERT.fullmatch(name)
        if gate is None and expert is None:  # attention, norms, embedding, LM head: Llama's names
            return read(name, index)
        layer = (gate or expert).group(1)
        legacy = f"model.layers.{layer}.block_sparse_moe.gate.weight" in names
        if gate is not None:
            return read(f"model.layers.{layer}.block_sparse_moe.gate.weight" if legacy else
                        f"model.layers.{layer}.mlp.gate.weight")
        number, projection = int(expert.group(2)), expert.group(3)
        if legacy:
            return read(f"model.layers.{layer}.block_sparse_moe.experts.{number}."
                        f"{MIXTRAL_PROJECTIONS[projection]}.weight")
        if projection == "down_proj":
            return read(f"model.layers.{layer}.mlp.experts.down_proj", number)
        gate_up = read(f"model.layers.{layer}.mlp.experts.gate_up_proj", number)  # (2 ffn, hidden)
        half = gate_up.shape[0] // 2
        return gate_up[:half] if projection == "gate_proj" else gate_up[half:]

    return read_ours


def mixtral_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model's routing cannot be expressed as Mixtral's, or None if it can.

    Mixtral routes every token to its top-k experts with softmax weights renormalised over the k, and never
    drops a token. That is our inference routing exactly when the model is top-k MoE (k >= 2, or top-1 renormalised
    by moe_renormalize_top1; counting the fine-grained experts as Mixtral experts of their width) in every layer
    without DeepSpeed's residual MLP, shared experts or a routing bias. A capacity limit (`moe_drop_tokens`) does not
    matter: it applies in training only, and inference is dropless (see models/moe.py).
    """
    reasons = []
    attention = feature_mismatch(config, "Mixtral", sliding_window=True)
    if attention:
        reasons.append(attention)
    if not config.uses_moe or config.uses_mod:
        reasons.append(f"arch is {config.arch!r}, not 'moe'")
    if config.num_routed_experts_per_tok == 1 and not config.moe_renormalize_top1:
        reasons.append("top-1 weights are raw gate probabilities, Mixtral renormalises over the top-k "
                       "(moe_renormalize_top1 does too)")
    if config.moe_layer_interval != 1:
        reasons.append("MoE is not in every layer")
    if config.moe_use_residual:
        reasons.append("the residual (PR-MoE) MLP has no Mixtral equivalent")
    if config.moe_shared_experts:
        reasons.append("shared experts have no Mixtral equivalent")
    if config.moe_balancing == "bias":
        reasons.append("the routing bias (moe_balancing 'bias') has no Mixtral equivalent")
    if not config.moe_norm_topk_prob:
        reasons.append("the top-k weights are not renormalised (moe_norm_topk_prob false), Mixtral's are")
    if config.moe_intermediate_size not in (None, config.intermediate_size):
        reasons.append("the experts' width is not intermediate_size (moe_intermediate_size), Mixtral's is")
    return "; ".join(reasons) or None


def mixtral_state(config: AdaptiveDSConfig, state: dict) -> dict:
    """A Mixtral's state dict (transformers' in-memory layout) from an MoE model's that holds all its experts (and
    Qwen3-MoE's, whose layers without experts keep their dense MLP's names)."""
    mixtral = {name: tensor for name, tensor in state.items() if ".mlp.moe." not in name}
    for layer in filter(config.is_moe_layer, range(config.num_hidden_layers)):
        ours = f"model.layers.{layer}.mlp.moe.deepspeed_moe."
        experts = [f"{ours}experts.deepspeed_experts.{e}." for e in range(config.num_routed_experts)]
        mixtral[f"model.layers.{layer}.mlp.gate.weight"] = state[f"{ours}gate.wg.weight"]
        mixtral[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state[e + "gate_proj.weight"], state[e + "up_proj.weight"]]) for e in experts])
        mixtral[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [state[e + "down_proj.weight"] for e in experts])
    return mixtral


def to_mixtral(model) -> MixtralForCausalLM:
    """A stock MixtralForCausalLM with the same logits as `model` (an AdaptiveDSForCausalLM; see
    `mixtral_incompatibility`); the fine-grained experts are Mixtral experts of their width."""
    reason = mixtral_incompatibility(model.config)
    if reason:
        raise ValueError(f"--to mixtral: routing semantics differ: {reason}")
    config = model.config
    fields = {**stock_config_fields(config), "intermediate_size": config.expert_intermediate_size,
              "sliding_window": config.sliding_window}
    mixtral = MixtralForCausalLM(MixtralConfig(**fields, num_local_experts=config.num_routed_experts,
                                               num_experts_per_tok=config.num_routed_experts_per_tok))
    mixtral.load_state_dict(mixtral_state(config, model.state_dict()), strict=True)
    return mixtral.to(model.dtype)


def mixtral_fields(config: PreTrainedConfig) -> dict:
    """Llama's fields and Mistral's sliding window."""
    return {**llama_fields(config), "sliding_window": config.sliding_window}


MIXTRAL = Family("mixtral", "MixtralForCausalLM", MixtralConfig, "moe", mixtral_fields, routing=mixtral_routing,
                 feature_problems=llama_feature_problems, reader=mixtral_reader,
                 export_problem=mixtral_incompatibility, to_stock=to_mixtral)
