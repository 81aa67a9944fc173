"""Configuration and modeling of the adaptive_ds decoder, registered with the transformers Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import ARCHITECTURES, AdaptiveDSConfig
from .modeling import (
    AdaptiveDSCausalLMOutput,
    AdaptiveDSForCausalLM,
    AdaptiveDSModel,
    AdaptiveDSPreTrainedModel,
    RoutingStatistics,
)
from .spec import ARCH_SPECS, ArchitectureSpec, architecture_spec, register_architecture

AutoConfig.register(AdaptiveDSConfig.model_type, AdaptiveDSConfig, exist_ok=True)
AutoModel.register(AdaptiveDSConfig, AdaptiveDSModel, exist_ok=True)
AutoModelForCausalLM.register(AdaptiveDSConfig, AdaptiveDSForCausalLM, exist_ok=True)

__all__ = [
    "ARCHITECTURES",
    "ARCH_SPECS",
    "ArchitectureSpec",
    "AdaptiveDSConfig",
    "AdaptiveDSCausalLMOutput",
    "AdaptiveDSForCausalLM",
    "AdaptiveDSModel",
    "AdaptiveDSPreTrainedModel",
    "RoutingStatistics",
    "architecture_spec",
    "register_architecture",
]
