"""adaptive_ds's own folders (`AdaptiveDSForCausalLM`, a run's final/ or an export): each imports as the
architecture its config names, under its own tensor names; a model of that architecture takes its whole config, and
a dense one starts any architecture (upcycled, models/upcycling.py). Exporting one of ours is
`export.final.save_with_code`, not a conversion."""

from __future__ import annotations

from ..configuration import AdaptiveDSConfig
from ..upcycling import FEATURE_FIELDS
from .registry import NAMED_FIELDS, Family

# what a folder's config holds that the model a run builds from it does not take over: the expert-parallel split
# is the run's, the special tokens its tokenizer's
RUN_FIELDS = ("moe_ep_size", "bos_token_id", "eos_token_id", "pad_token_id")


def own_fields(config: AdaptiveDSConfig) -> dict:
    """The fields every architecture started from one of our folders keeps: shape, norm epsilon, RoPE (base and
    scaling), context and the family features (tied embeddings, head width, attention biases, q/k norm, window)."""
    kept = (*NAMED_FIELDS, "rope_theta", "rope_scaling_parameters", "sliding_window", *FEATURE_FIELDS)
    return {name: getattr(config, name) for name in kept}


def own_settings(config: AdaptiveDSConfig) -> dict:
    """The folder's whole configuration, less the run's own fields (`RUN_FIELDS`)."""
    return {name: getattr(config, name) for name in vars(AdaptiveDSConfig)["__annotations__"]
            if name not in RUN_FIELDS}


ADAPTIVE_DS = Family(AdaptiveDSConfig.model_type, "AdaptiveDSForCausalLM", AdaptiveDSConfig, None, own_fields,
                     own_settings=own_settings)
