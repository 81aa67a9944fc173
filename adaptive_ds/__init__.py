"""adaptive_ds: Dense, MoE, MoD and hybrid decoder-only language models trained through DeepSpeed.

Importing the package imports no torch, so that a command's arguments are checked in a second (the training run's
`preflight`); the model classes below are imported on first use. Importing `adaptive_ds.models` (which any use of
a model class does) registers the models with `AutoConfig` / `AutoModelForCausalLM`: `import adaptive_ds.models`,
then `AutoModelForCausalLM.from_pretrained(folder)` without `trust_remote_code`.
"""

import importlib

__version__ = "0.2.0"  # setup.cfg reads it (attr:); CHANGELOG.md heads its entries with it
__all__ = ["AdaptiveDSConfig", "AdaptiveDSForCausalLM", "AdaptiveDSModel", "__version__"]
_MODELS = ("AdaptiveDSConfig", "AdaptiveDSForCausalLM", "AdaptiveDSModel")


def __getattr__(name: str):
    """`adaptive_ds.AdaptiveDSForCausalLM` and the like, from adaptive_ds.models on first use (PEP 562)."""
    if name in _MODELS:
        return getattr(importlib.import_module(".models", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
