"""Qwen3 (`Qwen3ForCausalLM`): Llama's blocks under Llama's names with RMSNorm over each head's queries and keys
(`q_norm`, `k_norm`), an explicit `head_dim` (0.6B: 128 for a hidden size of 1024 and 16 heads) and embeddings
tied in the small models; `attention_bias` sets biases on all four projections, as Llama's. Imports as a dense
model; a dense model with q/k norm exports to it. Its sliding window is Qwen2's (qwen2.py).
"""

from __future__ import annotations

from transformers import PreTrainedConfig, Qwen3Config, Qwen3ForCausalLM

from ..configuration import AdaptiveDSConfig
from .llama import (
    attention_bias_fields,
    dense_exporter,
    dense_incompatibility,
    feature_mismatch,
    llama_feature_problems,
    llama_fields,
    stock_config_fields,
)
from .qwen2 import qwen_sliding_fields, qwen_sliding_window
from .registry import Family


def qwen3_fields(config: PreTrainedConfig) -> dict:
    return {**llama_fields(config), **attention_bias_fields(config), "qk_norm": True,
            "sliding_window": qwen_sliding_window(config)}


def qwen3_attention_mismatch(config: AdaptiveDSConfig, family: str = "Qwen3") -> str | None:
    """Why a model's attention is not Qwen3's (and Qwen3-MoE's): it has q/k norm, and biases on all four
    projections or none."""
    if not config.qk_norm:
        return f"{family}'s attention normalises queries and keys (qk_norm), this model's does not"
    return feature_mismatch(config, family, qkv_bias=(False, True), out_bias=(False, True), qk_norm=(True,),
                            sliding_window=True, tied_biases=True)


def qwen3_incompatibility(config: AdaptiveDSConfig) -> str | None:
    return dense_incompatibility(config, "Qwen3") or qwen3_attention_mismatch(config)


def qwen3_config_fields(config: AdaptiveDSConfig) -> dict:
    return {**stock_config_fields(config), "attention_bias": config.attention_qkv_bias,
            **qwen_sliding_fields(config)}


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", Qwen3Config, "dense", qwen3_fields,
               feature_problems=llama_feature_problems,
               upcycled_model_type="qwen3_moe", export_problem=qwen3_incompatibility,
               to_stock=dense_exporter("qwen3", Qwen3ForCausalLM, Qwen3Config, qwen3_incompatibility,
                                       qwen3_config_fields))
