"""The architectures of the adaptive_ds decoder, registered once each (spec.py says what a spec answers).

A new architecture is registered here, with its own MLP (if any) in a module of this folder that imports torch,
transformers and its siblings only, and gets its entry in `adaptive_ds.presets.VARIANTS`, which names what it ships
with; nothing outside models/ and presets.py names it.
"""

from __future__ import annotations

from .spec import ARCH_SPECS, ArchitectureSpec, architecture_spec, register_architecture

# DeepSpeed's MoE layer, which adaptive_ds's trainer trains the experts in (moe.py), refuses ZeRO stage 3.
_DEEPSPEED_MOE = "DeepSpeed MoE does not run under ZeRO-3"

register_architecture(ArchitectureSpec("dense", "every block is attention + SwiGLU MLP"))
register_architecture(ArchitectureSpec("moe", "every moe_layer_interval-th MLP is a routed mixture of SwiGLU experts",
                                       moe=True, zero3_problem=_DEEPSPEED_MOE))
register_architecture(ArchitectureSpec("mod", "every mod_layer_interval-th block is wrapped by a Mixture-of-Depths "
                                       "router", mod=True, unrouted="dense"))
register_architecture(ArchitectureSpec("hybrid", "both: MoD decides which tokens ever reach the experts", moe=True,
                                       mod=True, unrouted="moe", zero3_problem=_DEEPSPEED_MOE))

__all__ = ["ARCH_SPECS", "ArchitectureSpec", "architecture_spec", "register_architecture"]
