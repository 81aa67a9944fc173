"""Mistral (`MistralForCausalLM`): Llama's blocks under Llama's names, with an explicit `head_dim` and a sliding
window (Mistral-7B v0.1: 4096; v0.3: none). Imports as a dense model; the window is kept and accepted where no
sequence of the run is longer (models/configuration.py); a dense model without biases or q/k norm exports to it."""

from __future__ import annotations

from transformers import MistralConfig, MistralForCausalLM, PreTrainedConfig

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


def mistral_fields(config: PreTrainedConfig) -> dict:
    return {**llama_fields(config), "sliding_window": config.sliding_window}


def mistral_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model cannot be a stock Mistral: as a Llama (`dense_incompatibility`), and Mistral's attention has no
    biases and no q/k norm."""
    return dense_incompatibility(config, "Mistral") or feature_mismatch(config, "Mistral", sliding_window=True)


def mistral_config_fields(config: AdaptiveDSConfig) -> dict:
    return {**stock_config_fields(config), "sliding_window": config.sliding_window}


MISTRAL = Family("mistral", "MistralForCausalLM", MistralConfig, "dense", mistral_fields,
                 feature_problems=llama_feature_problems,
               upcycled_model_type="mixtral", export_problem=mistral_incompatibility,
                 to_stock=dense_exporter("mistral", MistralForCausalLM, MistralConfig, mistral_incompatibility,
                                         mistral_config_fields))
