"""DeepSpeed's MoE layer around the models' MoE MLPs: the one place where training meets DeepSpeed's MoE internals.

The models hold plain modules under the parameter names of `deepspeed.moe.layer.MoE` (models/moe.py). `prepare`, the
step that makes a model DeepSpeed's to train (called where the engine is built, before its param groups and
optimizer), swaps each MoE MLP's `moe` container for a real `deepspeed.moe.layer.MoE` that holds the model's own
modules (no copy; a model built with `moe_ep_size` n holds this rank's experts). The swap gives DeepSpeed what it needs
from its own layer:

- its marks on the experts' parameters (`allreduce=False`, `group_name`), by which
  `split_params_into_different_moe_groups_for_optimizer` puts them in MoE param groups and ZeRO reduces and
  partitions them over the expert-data-parallel group;
- the expert-parallel group, which the engine creates and sets on the layer (`deepspeed_moe.ep_group`), where the
  layer's dispatcher reads it;
- its MoE checkpoint layout (one file per expert, numbered globally).

With `moe_dispatch="deepspeed"` it also installs `DeepSpeedDispatcher`, DeepSpeed's stock dispatch behind the models'
token-dispatcher interface, and runs the experts as DeepSpeed's `Experts` does, one matmul per expert, so that the
baseline stays DeepSpeed's layer.

The layer is built on the meta device, then given the model's modules with DeepSpeed's marks copied onto their
parameters, so the swap allocates nothing and draws no random numbers: a seed trains the same run as before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import _AllToAll, _route_slots, _sparse_decode, _sparse_encode, top1gating, top2gating
from torch import nn

from ..models import AdaptiveDSConfig
from ..models.expert_layout import pack
from ..models.moe import (
    Dispatched,
    MoEFeedForward,
    MoERouting,
    Routing,
    SwiGLU,
    TokenDispatcher,
    dropped_assignments,
    router_z_loss,
)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's MoE MLPs, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def prepare(model: nn.Module) -> None:
    """Make `model` (an AdaptiveDSForCausalLM) DeepSpeed's to train, before its param groups and optimizer are built:
    swap in DeepSpeed's MoE layers (`to_deepspeed`) and pack each layer's experts for it (`pack_for_optimizer`).
    Idempotent; a model without MoE layers is left as it is."""
    for layer in moe_layers(model):
        to_deepspeed(layer, model.config)
        pack_for_optimizer(layer)


def is_prepared(layer: MoEFeedForward) -> bool:
    """Whether `prepare` swapped in DeepSpeed's layer and packed the experts."""
    return isinstance(layer.moe, MoE) and not layer.experts.may_pack


def to_deepspeed(layer: MoEFeedForward, config: AdaptiveDSConfig) -> None:
    """Replace `layer.moe` by a `deepspeed.moe.layer.MoE` of `config`'s settings holding the same parameters
    (names, modules, Parameter objects and order unchanged); a layer already swapped is left as it is."""
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
    names = [name for name, _ in plain.named_parameters()]
    marks = {name: vars(param) for name, param in stock.named_parameters()}
    assert list(marks) == names and not list(stock.buffers()), (list(marks), names)
    # The stock layer holds the model's own modules, so the layer's router weight and `LocalExperts` stay theirs.
    stock.deepspeed_moe.gate.wg = plain.deepspeed_moe.gate.wg
    stock.deepspeed_moe.experts.deepspeed_experts = plain.deepspeed_moe.experts.deepspeed_experts
    if plain.use_residual:
        stock.mlp, stock.coefficient = plain.mlp, plain.coefficient
    for name, param in stock.named_parameters():
        param.__dict__.update(marks[name])  # DeepSpeed's marks on the parameter
    layer.moe = stock.train(plain.training)
    if config.moe_dispatch == "deepspeed":  # the baseline: DeepSpeed's dispatch, and its experts one matmul each
        layer.dispatcher = DeepSpeedDispatcher(config)
        layer.experts.grouped_gemm = "never"


def pack_for_optimizer(layer: MoEFeedForward) -> None:
    """Pack the layer's local experts' weights (each projection one buffer, for the grouped GEMM's view) and never
    move them again: DeepSpeed's optimizers flatten each param group into one buffer and point the parameters into
    it, where a weight alone in its group would look as if it owned its storage
    (see `models.expert_layout.stacked_weights`)."""
    for name in PROJECTIONS:
        pack(layer.experts.weights(name))
    layer.experts.may_pack = False


def expert_parallel_group(model: nn.Module) -> dist.ProcessGroup:
    """The process group the model's experts are split over, as DeepSpeed's engine set it on its MoE layers."""
    group = moe_layers(model)[0].moe.deepspeed_moe.ep_group
    assert group is not None, "the engine sets the expert-parallel group at deepspeed.initialize"
    return group


class DeepSpeedDispatcher(TokenDispatcher):
    """DeepSpeed's stock dispatch (`MOELayer.forward`, without tutel or tensor parallelism, which adaptive_ds does not
    use), kept as the baseline: DeepSpeed's GShard gating (`top1gating` / `top2gating`) of the router's logits, the
    tokens scattered into an (experts, capacity, hidden) buffer padded to capacity, a fixed-size all-to-all, and the
    gate-weighted gather back. The router's logits are those DeepSpeed's gate computes (the same jitter draws), so
    this routes as DeepSpeed's layer does. It reads neither the router's top-k nor its statistics: the layer reports
    the loss and counts of DeepSpeed's gating, with the z-loss of the logits without jitter, as the layer did when it
    ran DeepSpeed's `MoE` forward; and it reads back from the device only the capacity, as `MOELayer.forward` does
    (the experts' row counts follow from it)."""

    def __init__(self, config: AdaptiveDSConfig):
        self.k = config.num_routed_experts_per_tok  # the config allows 1 or 2 with this dispatcher
        self.capacity_factor = config.moe_capacity_factor
        self.min_capacity = config.moe_min_capacity
        self.drop_tokens = config.moe_drop_tokens
        self.ep_size = config.moe_ep_size
        self.num_local_experts = config.num_routed_experts // config.moe_ep_size

    def _gating(self, logits: torch.Tensor, group) -> tuple:
        if self.k == 1:
            return top1gating(logits, self.capacity_factor, self.min_capacity, None, None, self.drop_tokens,
                              False, group, True)  # no random token selection; sparse routes
        return top2gating(logits, self.capacity_factor, self.min_capacity, self.drop_tokens, group, False, True)

    def dispatch(self, tokens: torch.Tensor, routing: Routing, group) -> Dispatched:
        aux_loss, capacity, num_experts, indices, locations, gates, demand = self._gating(routing.logits, group)
        # DeepSpeed's gating's loss and counts; the z-loss of the logits without the jitter, as before the split
        # (DeepSpeed's gate keeps its logits to itself, so the layer recomputed them without it)
        demand = demand.detach()
        routing.report(MoERouting(aux_loss, router_z_loss(routing.plain_logits), demand,
                                  dropped_assignments(demand, routing.capacity)))
        capacity = int(capacity)  # the one read from the device, as in MOELayer.forward
        slots = _route_slots(indices, locations, num_experts, capacity)
        buffer = _sparse_encode(tokens, slots, num_experts, capacity)  # (experts, capacity, hidden)
        buffer = _AllToAll.apply(group, buffer) if self.ep_size > 1 else buffer.contiguous()
        # (ranks, local experts, capacity, hidden) as received -> rows grouped by local expert
        rows = buffer.reshape(self.ep_size, self.num_local_experts, capacity, -1).transpose(0, 1)
        counts = [self.ep_size * capacity] * self.num_local_experts  # Python ints: no read of the device
        return Dispatched(rows.reshape(-1, tokens.shape[-1]), counts,
                          (slots, gates, tokens.shape[0], num_experts, capacity, group))

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        slots, gates, num_tokens, num_experts, capacity, group = dispatched.context
        hidden = expert_output.shape[-1]
        out = expert_output.reshape(self.num_local_experts, self.ep_size, capacity, hidden).transpose(0, 1)
        out = out.reshape(num_experts, capacity, hidden)
        out = _AllToAll.apply(group, out) if self.ep_size > 1 else out.contiguous()
        return _sparse_decode(out.view(num_experts * capacity, hidden), slots, gates, num_tokens)
