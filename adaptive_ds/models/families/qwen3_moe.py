"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k RMSNorm, an explicit head_dim, `attention_bias` on all
four projections or none) over MLPs of which every `decoder_sparse_step`-th is a mixture of `num_experts` SwiGLU
experts of width `moe_intermediate_size`, top `num_experts_per_tok` (the others dense, of width
`intermediate_size`). Imports as MoE with Qwen3-MoE's routing; a top-k MoE model with q/k norm exports to it.

Routing. Qwen3-MoE's router (`Qwen3MoeTopKRouter`) takes the softmax of the router logits in float32, its top-k,
and with `norm_topk_prob` renormalises the k weights to sum to 1; without it (transformers' default) the weights are
the softmax probabilities as they are. That is `moe.route` with `moe_norm_topk_prob` (and for k = 1,
`moe_renormalize_top1`: its one weight is exactly 1), dropless as Qwen3-MoE trains. Layer i holds experts when
(i + 1) % decoder_sparse_step == 0, the rule of `moe_layer_interval`; `mlp_only_layers` makes the layers it names
dense, which the model expresses only where they are dense by that rule already.

Weight names. The router, experts and dense MLPs of ours are Mixtral's (mixtral.py) and Llama's; Qwen3-MoE's are, in
transformers' in-memory layout, Mixtral's (`mlp.gate.weight`, `mlp.experts.gate_up_proj` (experts, 2 ffn, hidden),
`mlp.experts.down_proj`), and as save_pretrained writes them and the Hub checkpoints store them, one tensor per
expert: `mlp.experts.E.gate_proj / up_proj / down_proj.weight`. A dense layer's MLP has Llama's names.
"""

from __future__ import annotations

import re

import torch
from transformers import PreTrainedConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ..configuration import AdaptiveDSConfig
from ..upcycling import Reader
from .llama import attention_bias_fields, llama_feature_problems, llama_fields, stock_config_fields
from .mixtral import mixtral_reader, mixtral_state
from .qwen3 import qwen3_attention_mismatch
from .registry import Family

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\."
                     r"(\w+_proj)\.weight")


def qwen3_moe_fields(config: PreTrainedConfig) -> dict:
    """Llama's fields, Qwen3's attention, and a sliding window in every layer where `use_sliding_window` is set
    (Qwen3MoeConfig keeps `sliding_window` None otherwise)."""
    return {**llama_fields(config), **attention_bias_fields(config), "qk_norm": True,
            "sliding_window": config.sliding_window}


def qwen3_moe_routing(config: PreTrainedConfig) -> dict:
    """Qwen3-MoE's routing: its experts, their width and top-k, the k weights renormalised or not (`norm_topk_prob`,
    for k = 1 too), the MoE layers' interval (`decoder_sparse_step`), dropless in training as Qwen3-MoE trains
    (`--model moe_drop_tokens` may ask for the capacity limit)."""
    k, norm = config.num_experts_per_tok, bool(config.norm_topk_prob)
    return dict(num_local_experts=config.num_experts, num_experts_per_tok=k,
                moe_intermediate_size=config.moe_intermediate_size, moe_layer_interval=config.decoder_sparse_step,
                moe_norm_topk_prob=norm, moe_renormalize_top1=k == 1 and norm, moe_drop_tokens=False)


def _moe_layers(config: PreTrainedConfig) -> tuple[list[int], list[int]]:
    """The layers that hold experts in the Qwen3-MoE of `config`, and those that would by `decoder_sparse_step`
    alone (the rule of moe_layer_interval)."""
    by_step = [i for i in range(config.num_hidden_layers) if (i + 1) % config.decoder_sparse_step == 0]
    dense = set(config.mlp_only_layers or [])
    return ([i for i in by_step if i not in dense] if config.num_experts > 0 else []), by_step


def qwen3_moe_feature_problems(config: PreTrainedConfig) -> list[str]:
    """Llama's, and the MoE layers' placement where it is not every decoder_sparse_step-th layer."""
    found = llama_feature_problems(config)
    if config.decoder_sparse_step < 1:
        return [*found, f"has decoder_sparse_step {config.decoder_sparse_step}; it must be >= 1"]
    moe, by_step = _moe_layers(config)
    if config.num_experts < 1:
        found.append(f"has num_experts {config.num_experts}, no MoE layer; adaptive_ds imports Qwen3-MoE as moe")
    elif moe != by_step:
        found.append(f"has mlp_only_layers {sorted(config.mlp_only_layers)}, dense MLPs in MoE layers "
                     f"{sorted(set(by_step) - set(moe))} of decoder_sparse_step {config.decoder_sparse_step}; "
                     "adaptive_ds's MoE layers are every moe_layer_interval-th, with no exceptions")
    elif not moe:
        found.append(f"has decoder_sparse_step {config.decoder_sparse_step} over {config.num_hidden_layers} layers, "
                     "no MoE layer; adaptive_ds imports Qwen3-MoE as moe")
    return found


def qwen3_moe_reader(read: Reader, names: set[str]) -> Reader:
    """A reader by our MoE model's tensor names over a Qwen3-MoE folder's reader (`names`: the folder's tensor
    names, which tell its layout apart, expert by expert): an expert stored on its own is read by its name, the
    fused experts, the router and everything else as Mixtral's in-memory layout and Llama's names are."""
    fused = mixtral_reader(read, names)

    def read_ours(name: str, index: int | None = None) -> torch.Tensor:
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            layer, number, projection = expert.groups()
            stored = f"model.layers.{layer}.mlp.experts.{number}.{projection}.weight"
            if stored in names:
                return read(stored)
        return fused(name, index)

    return read_ours


def qwen3_moe_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model cannot be a stock Qwen3-MoE, or None if it can.

    Qwen3-MoE routes every token to its top-k experts, their softmax weights renormalised over the k or not
    (`norm_topk_prob`: our moe_norm_topk_prob, for k = 1 moe_renormalize_top1), in every decoder_sparse_step-th layer
    (our moe_layer_interval), the other layers' MLPs dense SwiGLU; fine-grained experts are Qwen3-MoE experts of
    their width. What it has no place for: MoD, an MLP of the architecture's own, PR-MoE's residual MLP, shared
    experts, a routing bias, and an attention other than Qwen3's (q/k norm, biases on all four projections or none).
    A capacity limit does not matter: it applies in training only, and inference is dropless (models/moe.py).
    """
    reasons = []
    if not config.uses_moe or config.uses_mod or config.arch_spec.mlp is not None:
        reasons.append(f"arch is {config.arch!r}, not 'moe'")
    attention = qwen3_attention_mismatch(config, "Qwen3-MoE")
    if attention:
        reasons.append(attention)
    if config.moe_use_residual:
        reasons.append("the residual (PR-MoE) MLP has no Qwen3-MoE equivalent")
    if config.moe_shared_experts:
        reasons.append("shared experts have no Qwen3-MoE equivalent")
    if config.moe_balancing == "bias":
        reasons.append("the routing bias (moe_balancing 'bias') has no Qwen3-MoE equivalent")
    return "; ".join(reasons) or None


def qwen3_moe_config_fields(config: AdaptiveDSConfig) -> dict:
    """The Qwen3MoeConfig fields of an MoE model's config (see `qwen3_moe_incompatibility`)."""
    k = config.num_routed_experts_per_tok
    window = config.sliding_window
    return {**stock_config_fields(config), "attention_bias": config.attention_qkv_bias,
            "use_sliding_window": window is not None, "sliding_window": window,
            "num_experts": config.num_routed_experts, "num_experts_per_tok": k,
            "moe_intermediate_size": config.expert_intermediate_size, "decoder_sparse_step": config.moe_layer_interval,
            "mlp_only_layers": [],
            "norm_topk_prob": config.moe_renormalize_top1 if k == 1 else config.moe_norm_topk_prob}


def to_qwen3_moe(model) -> Qwen3MoeForCausalLM:
    """A stock Qwen3MoeForCausalLM with the same logits as `model` (an AdaptiveDSForCausalLM; see
    `qwen3_moe_incompatibility`), its weights in transformers' in-memory layout."""
    reason = qwen3_moe_incompatibility(model.config)
    if reason:
        raise ValueError(f"--to qwen3_moe needs a top-k MoE model with Qwen3's attention; this one: {reason}")
    stock = Qwen3MoeForCausalLM(Qwen3MoeConfig(**qwen3_moe_config_fields(model.config)))
    stock.load_state_dict(mixtral_state(model.config, model.state_dict()), strict=True)
    return stock.to(model.dtype)


QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", Qwen3MoeConfig, "moe", qwen3_moe_fields,
                   routing=qwen3_moe_routing, feature_problems=qwen3_moe_feature_problems, reader=qwen3_moe_reader,
                   export_problem=qwen3_moe_incompatibility, to_stock=to_qwen3_moe)
