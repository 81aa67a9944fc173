"""What an architecture is to the rest of adaptive_ds: one `ArchitectureSpec` each, in one registry.

The trainer, the planner and the tools never branch on an architecture's name; they ask the model, its configuration
or its spec (torchtitan's `TrainSpec` plays this part there):

- what it is made of: `moe` (Mixture-of-Experts MLPs, moe.py), `mod` (Mixture-of-Depths blocks, mod.py) and `mlp`,
  the feed-forward of its other layers (SwiGLU where None), which `modeling.DecoderLayer` builds, with its parameter
  count `mlp_parameters`;
- `unrouted`: the architecture of the same weights with every block run on every token, against which a MoD
  model's FLOPs reduction is measured (`AdaptiveDSConfig.unrouted`);
- `zero3_problem`: why it does not train under ZeRO-3, or None where it does (`AdaptiveDSConfig.zero3_problem`);
- `plain`: whether it is the plain decoder (SwiGLU MLPs, no experts, every block on every token), which starts any
  architecture that keeps SwiGLU MLPs (models/upcycling.py) and is what a stock Llama is;
- `upcycles_into`: whether its MLPs may be copied into another's experts (sparse upcycling).

The model answers the rest at run time (modeling.py): its default and applied knobs (`default_knobs`,
`apply_knobs`), the routing statistics of a forward (`routing_statistics`), what follows an optimizer step
(`after_optimizer_step`) and how it validates (`validation_routings`).

Adding an architecture is a `register_architecture` call in architectures.py (with its own MLP, if any, in a module
of this folder) and its entry in `adaptive_ds.presets.VARIANTS`, which names what it ships with.

This module imports neither torch nor another module of this package: the configuration reads it, and a final/
folder's copy of the model code carries it (export/final.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchitectureSpec:
    """One architecture of the adaptive_ds decoder, as `AdaptiveDSConfig.arch` names it."""

    name: str
    about: str = ""  # one line
    moe: bool = False  # every moe_layer_interval-th MLP is a Mixture-of-Experts layer (moe.py)
    mod: bool = False  # every mod_layer_interval-th block is MoD-routed (mod.py)
    # The MLP of the layers without experts: called with the configuration, returns an nn.Module that maps
    # (batch, seq, hidden) to the same shape; None: SwiGLU of width intermediate_size (modeling.py).
    mlp: Callable[[Any], Any] | None = None
    # the parameters of one such MLP, from the configuration (None: SwiGLU's 3 x hidden x intermediate): parameter
    # counts, FLOPs and the planner's memory start from it (adaptive_ds.presets.block_parameters)
    mlp_parameters: Callable[[Any], int] | None = None
    unrouted: str | None = None  # the architecture with every block run on every token (None: this one)
    # why its training does not run under DeepSpeed's ZeRO stage 3, one clause (None: it does)
    zero3_problem: str | None = None

    @property
    def plain(self) -> bool:
        """The plain decoder: attention + SwiGLU MLP in every block, every block on every token (a stock Llama).
        The one rule of which architecture starts another (models/upcycling.py) and exports as a Llama."""
        return not self.moe and not self.mod and self.mlp is None

    def upcycles_into(self, target: ArchitectureSpec) -> bool:
        """Whether a model of this architecture can start `target`'s experts (sparse upcycling, Komatsuzaki et al.
        2022, arXiv 2212.05055): a plain SwiGLU model, every block on every token, into one with experts."""
        return self.plain and target.moe


ARCH_SPECS: dict[str, ArchitectureSpec] = {}


def register_architecture(spec: ArchitectureSpec) -> ArchitectureSpec:
    """Add `spec` to `ARCH_SPECS` (in the order of the tables); a name registered twice is a mistake."""
    if spec.name in ARCH_SPECS:
        raise ValueError(f"architecture {spec.name!r} is registered already")
    ARCH_SPECS[spec.name] = spec
    return spec


def architecture_spec(name: str) -> ArchitectureSpec:
    """The spec of architecture `name`; ValueError naming the valid ones for an unknown name."""
    if name not in ARCH_SPECS:
        raise ValueError(f"unknown arch {name!r}; valid choices: {', '.join(ARCH_SPECS)}")
    return ARCH_SPECS[name]
