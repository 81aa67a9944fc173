"""DeepSpeed's MoE layer around the models' MoE MLPs: the one place where training meets DeepSpeed's MoE internals.

The models hold plain modules under the parameter names of `deepspeed.moe.layer.MoE` (models/moe.py). Before the
optimizer and the engine are built, `prepare` swaps each MoE MLP's `moe` container for a real `deepspeed.moe.layer.MoE`
that holds the same Parameter objects (no copy; a model built with `moe_ep_size` n holds this rank's experts). The
swap gives DeepSpeed what it needs from its own layer:

- its marks on the experts' parameters (`allreduce=False`, `group_name`), by which
  `split_params_into_different_moe_groups_for_optimizer` puts them in MoE param groups and ZeRO reduces and
  partitions them over the expert-data-parallel group;
- the expert-parallel group, which the engine creates and sets on the layer (`deepspeed_moe.ep_group`), where the
  indexed dispatch's all-to-all reads it;
- its MoE checkpoint layout (one file per expert, numbered globally);
- its stock dispatch, which `moe_dispatch="deepspeed"` trains through (the layer's `forward`).

The layer is built on the meta device, then given the model's parameters with DeepSpeed's marks copied onto them, so
the swap allocates nothing and draws no random numbers: a seed trains the same run as before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from torch import nn

from ..models import AdaptiveDSConfig
from ..models.expert_layout import pack
from ..models.moe import MoEFeedForward, SwiGLU

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's MoE MLPs, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def prepare(model: nn.Module) -> None:
    """Before an optimizer is built on `model` (an AdaptiveDSForCausalLM): swap in DeepSpeed's MoE layers
    (`to_deepspeed`) and pack each layer's experts for it (`pack_for_optimizer`). Idempotent."""
    for layer in moe_layers(model):
        to_deepspeed(layer, model.config)
        pack_for_optimizer(layer)


def to_deepspeed(layer: MoEFeedForward, config: AdaptiveDSConfig) -> None:
    """Replace `layer.moe` by a `deepspeed.moe.layer.MoE` of `config`'s settings holding the same parameters
    (names, Parameter objects and order unchanged); a layer already swapped is left as it is."""
    if isinstance(layer.moe, MoE):
        return
    plain = layer.moe
    with torch.device("meta"):
        stock = MoE(
            hidden_size=config.hidden_size,
            expert=SwiGLU(config.hidden_size, config.expert_intermediate_size),
            num_experts=config.num_routed_experts,
            ep_size=config.moe_ep_size,
            k=config.num_routed_experts_per_tok,  # only its own dispatch reads it, which the config allows for k <= 2
            capacity_factor=config.moe_capacity_factor,
            min_capacity=config.moe_min_capacity,
            use_residual=config.moe_use_residual,
            noisy_gate_policy="Jitter" if config.moe_jitter else None,
            drop_tokens=config.moe_drop_tokens,
            use_rts=False,  # random token selection would make routing depend on the RNG, not the input
            top2_2nd_expert_sampling=False,  # deterministic top-2, as in Mixtral
        )
    params = dict(plain.named_parameters())
    names = [name for name, _ in stock.named_parameters()]
    assert names == list(params) and not list(stock.buffers()), (names, list(params))
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = stock.get_submodule(owner)
        param = params[name]
        param.__dict__.update(vars(getattr(module, leaf)))  # DeepSpeed's marks on the parameter
        setattr(module, leaf, param)
    layer.moe = stock.train(plain.training)


def pack_for_optimizer(layer: MoEFeedForward) -> None:
    """Pack the layer's local experts' weights (each projection one buffer, for the grouped GEMM's view) and never
    move them again: DeepSpeed's optimizers flatten each param group into one buffer and point the parameters into
    it, where a weight alone in its group would look as if it owned its storage
    (see `models.expert_layout.stacked_weights`)."""
    for name in PROJECTIONS:
        pack(layer.expert_weights(name))
    layer.may_pack = False


def expert_parallel_group(model: nn.Module) -> dist.ProcessGroup:
    """The process group the model's experts are split over, as DeepSpeed's engine set it on its MoE layers."""
    group = moe_layers(model)[0].moe.deepspeed_moe.ep_group
    assert group is not None, "the engine sets the expert-parallel group at deepspeed.initialize"
    return group
