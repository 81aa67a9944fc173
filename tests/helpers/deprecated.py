"""The package's deprecated module paths (CHANGELOG.md: deprecated in 0.2, removed in 0.3) and what each stands for."""

# The tools' module paths before adaptive_ds.tools, which the commands of committed reports cite: each runs its tool.
TOOL_ALIASES = {
    "adaptive_ds.acceptance": "adaptive_ds.tools.acceptance",
    "adaptive_ds.benchmark": "adaptive_ds.tools.benchmark",
    "adaptive_ds.grid": "adaptive_ds.tools.grid",
    "adaptive_ds.loss_breakdown": "adaptive_ds.tools.loss_breakdown",
    "adaptive_ds.plan": "adaptive_ds.tools.plan",
    "adaptive_ds.data.benchmark": "adaptive_ds.tools.data_benchmark",
}
# What the zero_to_fp32.py copied into checkpoints of earlier versions imports.
MODULE_ALIASES = {"adaptive_ds.training.consolidate": "adaptive_ds.training.checkpoint.consolidate"}
