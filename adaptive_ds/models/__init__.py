"""Configuration and modeling of the adaptive_ds decoder, registered with the transformers Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import AdaptiveDSConfig
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


def __getattr__(name: str):
    """`ARCHITECTURES`: the registered architectures' names, in the order of the tables, read from the registry when
    asked (a tuple made at import would miss an architecture registered after it)."""
    if name == "ARCHITECTURES":
        return tuple(ARCH_SPECS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
