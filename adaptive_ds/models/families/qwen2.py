"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama's blocks under Llama's names with biases on the q, k and v
projections (none on o), embeddings tied in the small models. Imports as a dense model; a dense model with exactly
those biases and no q/k norm exports to it.

Qwen's sliding window applies to the layers from `max_window_layers` on, where `use_sliding_window` is set; the
model keeps the window (`sliding_window`, accepted where no sequence of the run is longer, when the window changes
nothing) and exports it for every layer, which computes the same within the window.
"""

from __future__ import annotations

from transformers import PreTrainedConfig, Qwen2Config, Qwen2ForCausalLM

from ..configuration import AdaptiveDSConfig
from .llama import (
    dense_exporter,
    dense_incompatibility,
    feature_mismatch,
    llama_feature_problems,
    llama_fields,
    stock_config_fields,
)
from .registry import Family


def qwen_sliding_window(config: PreTrainedConfig) -> int | None:
    """The window of a Qwen config's sliding-window layers; None where no layer slides."""
    layer_types = getattr(config, "layer_types", None) or []
    return config.sliding_window if "sliding_attention" in layer_types else None


def qwen_sliding_fields(config: AdaptiveDSConfig) -> dict:
    """A Qwen config's window fields for a model's `sliding_window`: every layer slides, or none."""
    window = config.sliding_window
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0 if window is not None else config.num_hidden_layers}


def qwen2_fields(config: PreTrainedConfig) -> dict:
    return {**llama_fields(config), "attention_qkv_bias": True, "attention_out_bias": False,
            "sliding_window": qwen_sliding_window(config)}


def qwen2_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model cannot be a stock Qwen2: as a Llama (`dense_incompatibility`), and Qwen2's attention has biases
    on q, k and v, none on o, and no q/k norm."""
    return dense_incompatibility(config, "Qwen2") or feature_mismatch(
        config, "Qwen2", qkv_bias=(True,), sliding_window=True)


def qwen2_config_fields(config: AdaptiveDSConfig) -> dict:
    return {**stock_config_fields(config), **qwen_sliding_fields(config)}  # (Qwen2 reads a head_dim it is given)


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", Qwen2Config, "dense", qwen2_fields,
               feature_problems=llama_feature_problems, export_problem=qwen2_incompatibility,
               to_stock=dense_exporter("qwen2", Qwen2ForCausalLM, Qwen2Config, qwen2_incompatibility,
                                       qwen2_config_fields))
