"""Mixture-of-Experts feed-forward in torch alone: route -> dispatch -> experts -> combine, one object each, as
Megatron-Core's MoE layer reads.

- `TopKRouter`: router logits (float32, multiplicative jitter in training), top-k with capacity, the routing bias,
  the load-balancing and z-losses.
- A token dispatcher (`TokenDispatcher`): `dispatch` hands this process's experts their rows, grouped by expert;
  `combine` brings the experts' output back to the tokens, weighted by the gates. `IndexedDispatcher` (the default,
  `moe_dispatch="indexed"`) sorts the token-expert assignments by expert and sends exactly those rows across the
  expert-parallel group with one variable-size all-to-all. `moe_dispatch="deepspeed"` is DeepSpeed's stock dispatch,
  kept as the baseline: its gating scatters tokens into an (experts, capacity, hidden) buffer padded to capacity.
  That dispatcher is DeepSpeed's code, so it lives on the training side (`adaptive_ds.training.moe_adapter`), which
  installs it; a model without it refuses to train so rather than silently run the other path.
- `LocalExperts`: this process's experts on their rows, each projection of all local experts as one grouped GEMM
  (`torch._grouped_mm`) or, where that is unavailable, one matmul per expert on its contiguous slice. The grouped
  GEMM reads the experts' weights through an (experts, out, in) view of the buffer they lie in, not a copy per
  forward (`stacked_weights`).

The parameters keep the names of DeepSpeed's MoE layer (`deepspeed.moe.layer.MoE`): the router is
`moe.deepspeed_moe.gate.wg`, expert e is `moe.deepspeed_moe.experts.deepspeed_experts.<e>`, and PR-MoE's dense MLP and
mixing coefficient are `moe.mlp` and `moe.coefficient` (`ExpertMixture`, which holds parameters only). Checkpoints,
final/ folders and the Mixtral export name their tensors so. adaptive_ds's trainer swaps each `moe` container for a
real `deepspeed.moe.layer.MoE` holding the same modules before it builds the engine (`training.moe_adapter`), for
DeepSpeed's expert-parallel groups, its marks on expert parameters (ZeRO reduces and partitions them over the
expert-data-parallel group) and its per-expert checkpoint files. The forward reads only what both containers hold:
these parameters, `use_residual` and `ep_group` (the expert-parallel group DeepSpeed's engine sets; None: the
default group).

Anywhere else (inference, a user's own loop, transformers' Trainer with its DeepSpeed integration) the experts are
plain modules, all of them in this process (`moe_ep_size` 1), and DeepSpeed's engine sees a dense model. That is
the route taken for the Trainer, rather than the model handing DeepSpeed its MoE parameter groups through a hook:
a model loaded from the Hub has no deepspeed to import, and at `moe_ep_size` 1 the expert-data-parallel group is the
data-parallel group, so DeepSpeed's MoE groups would reduce and partition the experts exactly as a dense model's
parameters are.

Routing semantics follow DeepSpeed's `top1gating` / `top2gating` (GShard, Lepikhin et al. 2020): softmax
gates in float32; capacity ceil(k * tokens / experts * capacity_factor), at least min_capacity; when an expert
overflows, earlier tokens win and every first choice outranks every second choice; a token's gate weights are
renormalised over the choices it kept (top-2) or left as the gate probability (top-1).

Inference is dropless. Capacity is a training-time device for balanced expert batches; applied in eval it lets
a later token (or another sequence of the batch) take an earlier token's slot, so validation loss would see
the future, a served prompt would depend on its batch-mates and cached generation would differ from the full
forward. In eval mode the router sets no capacity and every layer dispatches through its `IndexedDispatcher`,
whichever dispatcher trains it. Not through DeepSpeed's own `drop_tokens=False` gating: that gating still asserts
tokens >= min_capacity in top-1 (a one-token decoding step fails) and pads every expert's buffer to the busiest
expert's count; the indexed path is tested equal to DeepSpeed's dropless layer. In training, `moe_drop_tokens=False`
is dropless with either dispatcher (DeepSpeed's gating with its capacity raised to the busiest expert, the indexed
path without a limit).

DeepSeekMoE options (Dai et al. 2024, arXiv 2401.06066): fine-grained experts (`moe_expert_granularity` g: g times
as many experts, each 1/g as wide, top-k x g routed) are simply more, narrower experts in the same layer; shared
experts (`moe_shared_experts`) are one dense SwiGLU outside it, run on every token and added to the
routed output. Top-k beyond 2 is routed by the indexed dispatcher only (`route` handles any k with the same
priorities). The load-balancing loss is DeepSpeed's for every k: first choices for k <= 2 (GShard), all k
choices over k for k > 2 (its `topkgating`, which is DeepSeekMoE's expert-level balance loss, eq. 12-13).

Auxiliary-loss-free balancing (`moe_balancing="bias"`; DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2): a per-expert
bias is added to the gate probabilities for the top-k choice only; the gate weights stay the unbiased
probabilities. After each optimizer step the training loop passes the step's expert loads (every micro-batch,
summed over the data-parallel ranks by one all-reduce) to `update_routing_bias`, which moves each bias by
gamma * sign(mean load - load). The bias is kept as an integer tally of those +-1 moves (a persistent buffer, so
it is in checkpoints and `final/`): it stays exact when the engine casts the module to bf16 or fp16, where a
1e-3 step would round away once the bias grows.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .configuration import AdaptiveDSConfig
from .expert_layout import stacked_weights


class SwiGLU(nn.Module):
    """SwiGLU feed-forward, down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


@dataclass
class MoERouting:
    """One MoE layer's routing of one forward pass."""

    aux_loss: torch.Tensor  # load-balancing loss, E * sum_e(mean gate prob_e * share of first choices_e)
    z_loss: torch.Tensor  # router z-loss, mean(logsumexp(logits)^2) (Zoph et al. 2022, ST-MoE eq. 5)
    expert_counts: torch.Tensor  # (experts,) assignments each expert was chosen for, before capacity
    dropped: torch.Tensor  # assignments dropped by the capacity limit


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, choices_per_token: int = 1) -> torch.Tensor:
    """Auxiliary load-balancing loss, E / c * sum_e(mean_s p_se * counts_e / tokens), `counts` (experts,) the
    choices of each expert among each token's first `choices_per_token` = c. With c = 1 (first choices) it is the
    GShard / Switch loss (Fedus et al. 2021, eq. 4); with all k choices, DeepSeekMoE's expert-level balance loss
    (Dai et al. 2024, eq. 12-13). 1.0 when routing is uniform."""
    num_tokens, num_experts = probs.shape
    share = counts.float() / num_tokens
    return num_experts / choices_per_token * (probs.mean(0) * share).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): keeps router logits small for numerical stability."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times a factor drawn uniformly from [1 - epsilon, 1 + epsilon] for each element: the router input's
    jitter noise of Switch Transformer (Fedus et al. 2021), as Mesh TensorFlow and DeepSpeed draw it."""
    low = torch.tensor(1.0 - epsilon, device=x.device)
    high = torch.tensor(1.0 + epsilon, device=x.device)
    return x * (low + torch.rand(x.shape, device=x.device) * (high - low))


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert, as DeepSpeed computes them: ceil(k * tokens / experts * factor), at least min_capacity."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)


@dataclass
class Assignments:
    """Kept token-expert assignments, sorted by expert (stable, so by priority within an expert)."""

    token: torch.Tensor  # (n,) index of the token in the flattened batch
    weight: torch.Tensor  # (n,) gate weight applied to the expert's output
    counts: torch.Tensor  # (experts,) kept assignments per expert


def route(logits: torch.Tensor, k: int, capacity: int | None, bias: torch.Tensor | None = None,
          renormalize_top1: bool = False,
          renormalize: bool = True) -> tuple[Assignments, torch.Tensor, torch.Tensor]:
    """Top-k routing of `logits` (tokens, experts) with DeepSpeed's priorities; `capacity` None is dropless.

    `bias` (experts,): added to the gate probabilities to choose the top-k experts (and their order, so their
    capacity priority), not to the gate weights (DeepSeek-V3, arXiv 2412.19437, eq. 16).
    `renormalize_top1`: with k = 1, a kept token's weight is 1 in the forward pass (its probability renormalised
    over its one choice) with the probability's gradient (straight-through; see AdaptiveDSConfig).
    `renormalize` False: with k >= 2, the weights are the gate probabilities as they are (Qwen3-MoE's
    `norm_topk_prob` false).
    Returns the kept assignments, the demand per expert before the capacity limit, and the gate probabilities.
    """
    num_tokens, num_experts = logits.shape
    probs = logits.softmax(dim=-1)
    if bias is None:
        top_p, top_e = probs.topk(k, dim=-1)  # (tokens, k)
    else:
        top_e = (probs + bias).topk(k, dim=-1).indices
        top_p = probs.gather(1, top_e)
    # Choice-major order: all first choices in token order, then all second choices.
    expert = top_e.t().reshape(-1)
    token = torch.arange(num_tokens, device=logits.device).repeat(k)
    gate = top_p.t().reshape(-1)
    demand = torch.bincount(expert, minlength=num_experts)
    order = torch.argsort(expert, stable=True)
    if capacity is not None:
        starts = torch.cumsum(demand, 0) - demand
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device) - starts[expert[order]]
        kept = slot < capacity
        order = order[kept[order]]
        gate = gate * kept
    if k > 1 and renormalize:  # renormalise over the kept choices (a fully dropped token gets no expert output)
        total = gate.view(k, num_tokens).sum(0).clamp_min(torch.finfo(gate.dtype).eps)
        gate = gate / total.repeat(k)
    elif renormalize_top1:  # (g - g) + 1: exactly 1 where kept, 0 where dropped, the gradient g's
        gate = (gate - gate.detach()) + (gate.detach() > 0).to(gate.dtype)
    counts = torch.bincount(expert[order], minlength=num_experts)
    return Assignments(token[order], gate[order], counts), demand, probs


class TopKRouter:
    """Top-k routing of one MoE layer (Megatron-Core's `TopKRouter`): logits, top-k with capacity, the routing bias
    and the routing losses. Holds settings only: its weight is the layer's `moe.deepspeed_moe.gate.wg` (where
    DeepSpeed's gate holds it), and the layer passes it in with its bias and its training mode."""

    def __init__(self, config: AdaptiveDSConfig):
        self.k = config.num_routed_experts_per_tok
        self.num_experts = config.num_routed_experts
        self.capacity_factor = config.moe_capacity_factor
        self.min_capacity = config.moe_min_capacity
        self.drop_tokens = config.moe_drop_tokens
        self.jitter = config.moe_jitter
        self.renormalize_top1 = config.moe_renormalize_top1
        self.renormalize = config.moe_norm_topk_prob

    def logits(self, tokens: torch.Tensor, weight: torch.Tensor, training: bool) -> torch.Tensor:
        """(tokens, experts) float32 router logits, with multiplicative jitter on the input in training (the draws
        of DeepSpeed's gate with `noisy_gate_policy="Jitter"`)."""
        x = tokens.float()
        if self.jitter and training:
            x = multiplicative_jitter(x)
        return F.linear(x, weight.float())

    def capacity(self, num_tokens: int, training: bool) -> int | None:
        """Slots per expert in training with `moe_drop_tokens`; None (dropless) otherwise, and always in eval."""
        if not (self.drop_tokens and training):
            return None
        return expert_capacity(num_tokens, self.num_experts, self.k, self.capacity_factor, self.min_capacity)

    def __call__(self, tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 training: bool) -> Routing:
        """Route `tokens` (tokens, hidden) by the router `weight` (experts, hidden); `bias` (experts,) or None. The
        logits are computed now; the top-k and the statistics when a dispatcher first reads them (`Routing`)."""
        routing = Routing(self, self.logits(tokens, weight, training), bias, self.capacity(tokens.shape[0], training))
        if self.jitter and training:  # what `plain_logits` recomputes, kept only if a dispatcher asks
            routing.unjittered = (tokens, weight)
        return routing

    def top_k(self, logits: torch.Tensor, bias: torch.Tensor | None,
              capacity: int | None) -> tuple[Assignments, MoERouting]:
        """The kept assignments of `logits` and the routing's losses and counts (see `route`)."""
        assignments, demand, probs = route(logits, self.k, capacity, bias, self.renormalize_top1,
                                              self.renormalize)
        # DeepSpeed's loss for every k (see the module doc): first choices for k <= 2, all choices beyond.
        if self.k > 2:
            aux_loss = load_balancing_loss(probs, demand, self.k)
        else:
            first = (probs if bias is None else probs + bias).argmax(dim=-1)
            aux_loss = load_balancing_loss(probs, torch.bincount(first, minlength=self.num_experts))
        demand = demand.detach()
        return assignments, MoERouting(aux_loss, router_z_loss(logits), demand, dropped_assignments(demand, capacity))


def dropped_assignments(demand: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Assignments past `capacity` (None: dropless) of the (experts,) `demand`, on the device."""
    return (demand - capacity).clamp_min(0).sum() if capacity is not None else demand.new_zeros(())


class Routing:
    """The router's answer for one forward pass: its (tokens, experts) float32 `logits`, and the top-k `assignments`
    and routing `statistics` computed on first read. A dispatcher that routes by its own gating (DeepSpeed's) reads
    neither, so it costs none of the top-k's bincounts, and hands the layer the statistics of its gating
    (`report`)."""

    def __init__(self, router: TopKRouter, logits: torch.Tensor, bias: torch.Tensor | None, capacity: int | None):
        self.logits = logits
        self.capacity = capacity  # slots per expert; None: dropless
        self._router, self._bias = router, bias
        self._reported: MoERouting | None = None
        self.unjittered: tuple[torch.Tensor, torch.Tensor] | None = None  # (tokens, weight) where jitter was drawn

    @functools.cached_property
    def plain_logits(self) -> torch.Tensor:
        """The logits without the jitter: the router's where it drew none, else recomputed (one small matmul)."""
        if self.unjittered is None:
            return self.logits
        return self._router.logits(*self.unjittered, training=False)

    @functools.cached_property
    def _top_k(self) -> tuple[Assignments, MoERouting]:
        return self._router.top_k(self.logits, self._bias, self.capacity)

    @property
    def assignments(self) -> Assignments:
        """The kept token-expert assignments, sorted by expert."""
        return self._top_k[0]

    @property
    def statistics(self) -> MoERouting:
        """What the layer reports: the statistics a dispatcher reported, else the top-k's."""
        return self._reported if self._reported is not None else self._top_k[1]

    def report(self, statistics: MoERouting) -> None:
        self._reported = statistics


@dataclass
class Dispatched:
    """A dispatcher's rows for this process's experts, and what its `combine` needs to bring their output back."""

    rows: torch.Tensor  # (rows, hidden), grouped by local expert
    # (local experts,) rows of each, in expert order: a tensor, or Python ints where the dispatcher knows them
    # without reading the device (DeepSpeed's fixed capacity layout)
    tokens_per_expert: torch.Tensor | list[int]
    context: tuple  # the dispatcher's own, for `combine`


class TokenDispatcher:
    """Moves tokens to their experts and back (Megatron-Core's token dispatcher): `dispatch` the routed tokens into
    rows grouped by local expert, `combine` the experts' output rows into (tokens, hidden), gate-weighted. `group`:
    the expert-parallel process group (None: the default group)."""

    def dispatch(self, tokens: torch.Tensor, routing: Routing, group) -> Dispatched:
        raise NotImplementedError

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        raise NotImplementedError


class _AllToAll(torch.autograd.Function):
    """Variable-size all-to-all whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


class IndexedDispatcher(TokenDispatcher):
    """The kept assignments' rows, sorted by expert; with `ep_size` > 1, exactly those rows sent to the ranks that
    hold their experts by one variable-size all-to-all, then regrouped by local expert."""

    def __init__(self, num_experts: int, ep_size: int):
        self.num_experts = num_experts
        self.ep_size = ep_size

    def dispatch(self, tokens: torch.Tensor, routing: Routing, group) -> Dispatched:
        assignments = routing.assignments
        x = tokens.index_select(0, assignments.token)  # (kept, hidden), sorted by expert
        if self.ep_size == 1:
            return Dispatched(x, assignments.counts, (tokens, assignments, None))
        num_local = self.num_experts // self.ep_size
        send = assignments.counts.view(self.ep_size, num_local)  # rows for each rank's experts
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # recv[src, e]: rows rank src sends my expert e
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        x = _AllToAll.apply(x, recv_splits, send_splits, group)
        # Received rows are grouped by source rank, then local expert: regroup by local expert.
        local_expert = torch.repeat_interleave(
            torch.arange(num_local, device=x.device).repeat(self.ep_size), recv.flatten())
        regroup = torch.argsort(local_expert, stable=True)
        return Dispatched(x[regroup], recv.sum(0), (tokens, assignments, (regroup, send_splits, recv_splits, group)))

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        tokens, assignments, exchange = dispatched.context
        if exchange is not None:  # back to the source ranks, in the order their rows came
            regroup, send_splits, recv_splits, group = exchange
            y = torch.empty_like(expert_output)
            y[regroup] = expert_output
            expert_output = _AllToAll.apply(y, send_splits, recv_splits, group)
        weighted = expert_output * assignments.weight.unsqueeze(-1).to(expert_output.dtype)
        return torch.zeros_like(tokens).index_add_(0, assignments.token, weighted)


class NoDeepSpeedLayer(TokenDispatcher):
    """`moe_dispatch="deepspeed"` before adaptive_ds's trainer installed DeepSpeed's dispatcher: it refuses to train
    rather than silently run the indexed path."""

    def dispatch(self, tokens: torch.Tensor, routing: Routing, group) -> Dispatched:
        raise ValueError("moe_dispatch 'deepspeed' trains through DeepSpeed's own MoE layer, which adaptive_ds's "
                         "trainer swaps in (adaptive_ds.training.moe_adapter); elsewhere train with moe_dispatch "
                         "'indexed' (the same routing)")


def use_grouped_mm(x: torch.Tensor, mode: str) -> bool:
    """Whether to run the experts as one `torch._grouped_mm` per projection.

    "auto": on Hopper-class GPUs (compute capability 9.0+) in bfloat16, where it is the fast path; elsewhere a
    matmul per expert, which needs no stacked weights.
    "always": wherever torch runs it (also float32 on CPU, which the tests use to check the GPU path's math).
    "never": a matmul per expert.
    """
    if mode == "never" or not hasattr(torch, "_grouped_mm"):
        return False
    hopper_bf16 = x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    if mode == "auto":
        return hopper_bf16
    return hopper_bf16 or (x.device.type == "cpu" and x.dtype == torch.float32)


class LocalExperts:
    """This process's routed experts run on their rows (Megatron-Core's grouped / sequential MLP): one grouped GEMM a
    projection, or one SwiGLU per expert on its contiguous slice. Holds the layer's `deepspeed_experts` module list
    (which DeepSpeed's layer, when swapped in, holds too), not parameters of its own.

    `may_pack`: whether the grouped GEMM may pack weights that each own their storage into one buffer on first use
    (see `stacked_weights`); a trainer turns it off once it packed them before its optimizer flattens them."""

    def __init__(self, experts: nn.ModuleList, grouped_gemm: str):
        self.modules = experts
        self.grouped_gemm = grouped_gemm
        self.may_pack = True

    def weights(self, name: str) -> list[nn.Parameter]:
        """The local experts' `name` projection weights, (out, in) each, in expert order."""
        return [getattr(e, name).weight for e in self.modules]

    def __call__(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]) -> torch.Tensor:
        """SwiGLU of each local expert on its contiguous rows of `rows` (grouped by expert); `tokens_per_expert` a
        tensor or Python ints (which the per-expert loop splits by without reading the device)."""
        if use_grouped_mm(rows, self.grouped_gemm):
            counts = torch.as_tensor(tokens_per_expert, device=rows.device)
            offsets = torch.cumsum(counts, 0).to(torch.int32)

            def stacked(name):  # (experts, in, out) view of the (experts, out, in) Linear weights
                return stacked_weights(self.weights(name), self.may_pack).transpose(-2, -1)

            gate = torch._grouped_mm(rows, stacked("gate_proj"), offs=offsets)
            up = torch._grouped_mm(rows, stacked("up_proj"), offs=offsets)
            return torch._grouped_mm(F.silu(gate) * up, stacked("down_proj"), offs=offsets)
        if isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = tokens_per_expert.tolist()
        chunks = rows.split(tokens_per_expert)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.modules, chunks, strict=True)])


class Router(nn.Module):
    """The (experts, hidden) router weight, `wg` (DeepSpeed's `TopKGate` holds it under that name)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)


class ExpertList(nn.Module):
    """This process's routed experts, `deepspeed_experts` (as DeepSpeed's `Experts` names them): copies of one
    expert module, so each has its shape."""

    def __init__(self, expert: nn.Module, num_local_experts: int):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])


class RoutedExperts(nn.Module):
    """Router and experts, `deepspeed_moe` (DeepSpeed's `MOELayer`); `ep_group` None: the experts are split over
    the default process group when `ep_size` > 1."""

    def __init__(self, router: Router, experts: ExpertList, ep_size: int):
        super().__init__()
        self.gate = router
        self.experts = experts
        self.ep_size = ep_size
        self.ep_group = None


class ExpertMixture(nn.Module):
    """The routed experts and, for PR-MoE (`use_residual`), the dense MLP and its mixing coefficient: the parameters
    of a `deepspeed.moe.layer.MoE`, under its names (see the module doc). Holds parameters only: `MoEFeedForward`
    runs them."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int, ep_size: int, use_residual: bool):
        super().__init__()
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.use_residual = use_residual
        # In DeepSpeed's order (copies of `expert`, then the router, then the coefficient), so that a seed draws
        # the same initial weights whichever of the two layers a model is built with.
        experts = ExpertList(expert, num_experts // ep_size)
        self.deepspeed_moe = RoutedExperts(Router(hidden_size, num_experts), experts, ep_size)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts plus the shared experts when configured: route -> dispatch -> experts -> combine
    (see the module doc). `moe` holds the parameters: an `ExpertMixture`, or the `deepspeed.moe.layer.MoE` a trainer
    swapped in for it; `router`, `dispatcher` and `experts` hold none."""

    def __init__(self, config: AdaptiveDSConfig):
        super().__init__()
        self.num_experts = config.num_routed_experts
        self.moe = ExpertMixture(config.hidden_size, SwiGLU(config.hidden_size, config.expert_intermediate_size),
                                 self.num_experts, config.moe_ep_size, config.moe_use_residual)
        self.shared_experts = (SwiGLU(config.hidden_size, config.shared_intermediate_size)
                               if config.moe_shared_experts else None)
        self.router = TopKRouter(config)
        # Inference is dropless through the indexed dispatcher, whichever dispatcher trains (see the module doc).
        self.inference_dispatcher = IndexedDispatcher(self.num_experts, config.moe_ep_size)
        self.dispatcher = self.inference_dispatcher if config.moe_dispatch == "indexed" else NoDeepSpeedLayer()
        self.experts = LocalExperts(self.moe.deepspeed_moe.experts.deepspeed_experts, config.moe_grouped_gemm)
        self.bias_update_rate = None
        if config.moe_balancing == "bias":
            self.bias_update_rate = config.moe_bias_update_rate
            # (experts,) the routing bias in units of bias_update_rate (see the module doc)
            self.register_buffer("routing_bias_steps", torch.zeros(self.num_experts, dtype=torch.long))

    @property
    def routing_bias(self) -> torch.Tensor | None:
        """(experts,) float32 bias on the gate probabilities for the top-k choice; None without bias balancing."""
        if self.bias_update_rate is None:
            return None
        return self.routing_bias_steps.float() * self.bias_update_rate

    @torch.no_grad()
    def update_routing_bias(self, load: torch.Tensor) -> None:
        """b_e += gamma * sign(mean load - load_e) for the (experts,) `load` of one optimizer step on all ranks
        (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.2): an overloaded expert's bias falls, an idle one's rises."""
        self.routing_bias_steps += torch.sign(load.float().mean() - load.float()).long()

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, MoERouting]:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # (tokens, hidden)
        layer = self.moe.deepspeed_moe
        routing = self.router(tokens, layer.gate.wg.weight, self.routing_bias, self.training)
        dispatcher = self.dispatcher if self.training else self.inference_dispatcher
        dispatched = dispatcher.dispatch(tokens, routing, layer.ep_group)
        expert_output = self.experts(dispatched.rows, dispatched.tokens_per_expert)
        output = dispatcher.combine(expert_output, dispatched).view(hidden_states.shape)
        if self.moe.use_residual:  # PR-MoE (Rajbhandari et al. 2022): a dense MLP mixed in by a learned coefficient
            coef = self.moe.coefficient(hidden_states).softmax(dim=-1)
            output = output * coef[..., 0:1] + self.moe.mlp(hidden_states) * coef[..., 1:]
        if self.shared_experts is not None:  # DeepSeekMoE eq. 9: every token runs the shared experts
            output = output + self.shared_experts(hidden_states)
        return output, routing.statistics


def update_routing_bias(model: nn.Module, step_expert_counts: Sequence[Sequence[torch.Tensor]], group=None) -> None:
    """Move every bias-balanced MoE layer's routing bias after an optimizer step (DeepSeek-V3 sec. 2.1.2).

    `step_expert_counts`: the `expert_counts` of each micro-batch of the step (per MoE layer, in layer order,
    (experts,) choices before capacity). They are summed, then all-reduced over `group` (default: all ranks, which
    all hold the router) in one call, so every rank moves its bias alike. Nothing is read back to the host.
    """
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers or layers[0].bias_update_rate is None or not step_expert_counts:
        return
    load = torch.stack([torch.stack(list(counts)) for counts in step_expert_counts]).sum(0)  # (layers, experts)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(load, group=group)
    for layer, layer_load in zip(layers, load, strict=True):
        layer.update_routing_bias(layer_load)
