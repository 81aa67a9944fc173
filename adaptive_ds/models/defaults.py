"""What each architecture ships with, and what a configuration written before that meant: the defaults of the fields
a config leaves unset (`AdaptiveDSConfig`).

Plain Python, no imports: `adaptive_ds.presets` reads this table (the plain entries of its VARIANTS) before torch and
transformers are imported, and a final/ folder carries it beside the model code.
"""

# The meaning of a config's unset fields. A config dict without `config_version` was written before version 2 and
# reads as it always did (UNVERSIONED_DEFAULTS); one of version 2 or built now gets its architecture's defaults.
CONFIG_VERSION = 2

# Each architecture's defaults (MoD: the paper's setting, 12.5% capacity in every other block, measured in
# BENCHMARKS.md; hybrid: that around MoE blocks that route top-1, dropless). An architecture not listed: none.
ARCHITECTURE_DEFAULTS = {
    "dense": {},
    "moe": {},
    "mod": {"mod_capacity": 0.125, "mod_layer_interval": 2},
    "hybrid": {"mod_capacity": 0.125, "mod_layer_interval": 2, "num_experts_per_tok": 1, "moe_drop_tokens": False},
}

# The fields' defaults for every architecture that sets none of its own, and for every config without
# `config_version` (version 1: these were then the field defaults of every architecture).
UNVERSIONED_DEFAULTS = {"mod_capacity": 0.5, "mod_layer_interval": 1, "num_experts_per_tok": 2, "moe_drop_tokens": True}

# Fields older configs carry that no field reads any more: dropped when a config dict is read.
REMOVED_FIELDS = ("moe_eval_capacity_factor",)
