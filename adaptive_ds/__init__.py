"""adaptive_ds: Dense, MoE, MoD and hybrid decoder-only language models trained through DeepSpeed.

Importing the package registers the models with `AutoConfig` / `AutoModelForCausalLM`.
"""

from .models import AdaptiveDSConfig, AdaptiveDSForCausalLM, AdaptiveDSModel

__version__ = "0.1.0"
__all__ = ["AdaptiveDSConfig", "AdaptiveDSForCausalLM", "AdaptiveDSModel", "__version__"]
