"""Mixture-of-Depths routing around a whole decoder block (Raposo et al. 2024, arXiv 2404.02258).

Training routes the top `capacity * seq_len` tokens of each sequence (the paper's expert-choice routing).
That choice looks at the whole sequence, so inference cannot use it causally. Section 3.5 of the paper gives
two fixes; `AdaptiveDSConfig.mod_causal_routing` picks one:

- ``"router"`` (the default, the paper's first method): an auxiliary binary cross-entropy loss on the router's own
  logits, with top-k membership as targets and the gradient reaching the router and its input, teaches the
  router to score the tokens it would pick above 0; inference routes a token when its router logit is > 0.
- ``"predictor"`` (the second method): a small MLP on the stop-gradient block input, trained with the same BCE
  toward top-k membership, routes a token when its logit is > 0; the language model never feels its loss.

In eval mode (`routing="causal"`, the default) that decision routes; `routing="topk"` evaluates with the
train-time rule; `routing="all"` runs every token through every block (with the straight-through scale below, the
plain dense model). At capacity 1.0 (the block's capacity as it stands: the config's `mod_capacity`, or where a
run's capacity schedule has set it) the top-k is every token, a rule that needs no look-ahead, so causal routing
routes every token too and evaluation computes what training does: a dense model retrofitted at capacity 1.0 is the
dense model, and its Llama export. Causal routing really skips compute: each sequence's routed tokens are gathered
and the block runs on them alone, so a skipped token costs nothing, writes no keys and values into the block's
cache, and a decoding step whose tokens all skip does not run the block at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache

from .configuration import AdaptiveDSConfig

if TYPE_CHECKING:
    from .moe import MoERouting

ROUTING_MODES = ("causal", "topk", "all")


def update_scale(logits: torch.Tensor, straight_through: bool) -> torch.Tensor:
    """The scale r of a routed token's block update (eq. 1 of Raposo et al.): sigmoid(logit), or with
    `straight_through` a scale exactly 1 in the forward pass whose gradient is sigmoid's (the straight-through
    estimator, Bengio et al. 2013, arXiv 1308.3432), so that a routed token gets the plain block's output while the
    router still learns from the LM loss. Written (s - s) + 1, which is 1 exactly in floating point."""
    scale = torch.sigmoid(logits)
    return (scale - scale.detach()) + 1.0 if straight_through else scale


def routed_token_count(seq_len: int, capacity: float) -> int:
    """Tokens of each sequence that pass through a routed block: ceil(capacity * seq_len), at least one."""
    return max(1, math.ceil(capacity * seq_len - 1e-9))


class AdaptiveDSCache(DynamicCache):
    """A DynamicCache in which each MoD block's layer holds the keys and values of the tokens that ran it, only.

    Sequences of a batch route different numbers of tokens through a block, so each forward appends to a MoD
    block's layer as many slots as the sequence that routed most, and `slots[layer]` marks which of them hold a
    routed token; the others are padding, masked out of attention. A MoD layer's length therefore counts slots,
    not tokens: `get_seq_length()` returns the tokens seen, which is what generation and RoPE positions need.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen_tokens = 0
        self.slots: dict[int, torch.Tensor] = {}  # MoD layer -> (batch, slots) bool: the slot holds a routed token
        self.padded: dict[int, bool] = {}  # MoD layer -> some slot is padding (its attention needs a key mask)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def append_slots(self, layer_idx: int, valid: torch.Tensor, padded: bool) -> torch.Tensor | None:
        """Record the (batch, width) slots this forward appends to MoD layer `layer_idx`; returns the key mask of
        all its slots, or None while every slot holds a routed token."""
        previous = self.slots.get(layer_idx)
        self.slots[layer_idx] = valid if previous is None else torch.cat([previous, valid], dim=1)
        self.padded[layer_idx] = self.padded.get(layer_idx, False) or padded
        return self.slots[layer_idx] if self.padded[layer_idx] else None

    # Generation strategies that rearrange the batch (beam search, contrastive search) move the slot records along.
    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self.slots = {i: s.index_select(0, beam_idx.to(s.device)) for i, s in self.slots.items()}

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self.slots = {i: s.repeat_interleave(repeats, dim=0) for i, s in self.slots.items()}

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self.slots = {i: s[indices] for i, s in self.slots.items()}

    @property
    def is_croppable(self) -> bool:
        return not self.slots and super().is_croppable

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove and self.slots:  # a MoD layer's slots are not tokens: the last n tokens have no slot count
            raise ValueError("a MoD model's cache cannot be cropped (assisted generation); generate without an "
                             "assistant model")
        super().crop(tokens_to_remove)  # a negative count of tokens to remove; it refuses anything else
        self.seen_tokens += tokens_to_remove

    def reset(self):
        super().reset()
        self.seen_tokens, self.slots, self.padded = 0, {}, {}


class LayerOutput(NamedTuple):
    """What a decoder block, plain or MoD-routed, returns."""

    hidden_states: torch.Tensor
    moe: MoERouting | None = None  # the MoE MLP's routing
    mod: MoDRouting | None = None  # the MoD router's decisions


@dataclass
class MoDRouting:
    """One MoD block's routing of one forward pass."""

    selected: torch.Tensor | None  # (batch, k) routed positions (top-k routing)
    routed: torch.Tensor  # (batch, seq) bool: tokens that ran the block
    predictor_loss: torch.Tensor | None = None  # causal-routing BCE toward top-k membership (training)
    predictor_correct: torch.Tensor | None = None  # causal decisions that matched top-k membership
    predictor_tokens: torch.Tensor | int = 0  # tokens those decisions were made on (padding excluded)


class MixtureOfDepths(nn.Module):
    """Routes tokens of each sequence through `block`; the others skip it and keep their hidden state.

    Implements eq. (1) of Raposo et al.: x_{l+1} = r * f(x~) + x for routed tokens and x_{l+1} = x otherwise,
    where f(x~) is the block's residual update computed on the routed tokens alone. The scale r is the
    sigmoid of the router logit (a bounded stand-in for the raw logit, with the same top-k order) so the
    router receives gradient through the LM loss. Top-k is taken per sequence, never across the batch, and the
    routed tokens keep their original RoPE positions and causal order, so compute drops to the routed share.
    """

    def __init__(self, config: AdaptiveDSConfig, block: nn.Module, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.capacity = config.mod_capacity
        self.routing = "causal"
        self.straight_through = config.mod_straight_through
        self.router = nn.Linear(config.hidden_size, 1, bias=False)
        self.predictor = None  # "router": the router's own logit decides
        if config.mod_causal_routing == "predictor":
            hidden = config.mod_predictor_hidden_size
            self.predictor = nn.Sequential(nn.Linear(config.hidden_size, hidden, bias=False), nn.SiLU(),
                                           nn.Linear(hidden, 1, bias=False))
        self.block = block

    def forward(self, hidden_states, position_embeddings, key_padding_mask=None, cache=None) -> LayerOutput:
        scores = self.router(hidden_states).squeeze(-1).float()  # (batch, seq)
        if self.training or self.routing == "topk":
            if cache is not None:
                raise ValueError("top-k MoD routing sees the whole sequence and cannot use a KV cache")
            return self._topk(hidden_states, scores, position_embeddings, key_padding_mask)
        return self._causal(hidden_states, scores, position_embeddings, key_padding_mask, cache)

    def causal_logits(self, hidden_states: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """(batch, seq) logits of the causal decision, > 0 routes: each from its own token's block input alone."""
        if self.predictor is None:
            return scores
        return self.predictor(hidden_states).squeeze(-1).float()

    @staticmethod
    def gather(hidden_states, position_embeddings, index):
        """The tokens at `index` (batch, n) with their own RoPE cos and sin: ((batch, n, hidden), (cos, sin))."""
        batch, _, hidden = hidden_states.shape
        gathered = hidden_states.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden))
        cos, sin = position_embeddings  # (1 or batch, seq, head_dim)
        rope_index = index.unsqueeze(-1).expand(-1, -1, cos.shape[-1])
        return gathered, (cos.expand(batch, -1, -1).gather(1, rope_index),
                          sin.expand(batch, -1, -1).gather(1, rope_index))

    def _topk(self, hidden_states, scores, position_embeddings, key_padding_mask):
        seq_len, hidden = hidden_states.shape[1:]
        k = routed_token_count(seq_len, self.capacity)
        ranked = scores
        if key_padding_mask is not None:
            ranked = scores.masked_fill(~key_padding_mask[:, -seq_len:], float("-inf"))
        selected = ranked.topk(k, dim=1).indices.sort(dim=1).values  # (batch, k), in sequence order
        routed, routed_rope = self.gather(hidden_states, position_embeddings, selected)  # (batch, k, hidden)
        routed_mask = None if key_padding_mask is None else key_padding_mask.gather(1, selected)

        out = self.block(routed, routed_rope, routed_mask, cache=None)
        weight = update_scale(ranked.gather(1, selected), self.straight_through).unsqueeze(-1).to(hidden_states.dtype)
        update = (out.hidden_states - routed) * weight  # (batch, k, hidden)
        in_topk = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, selected, True)

        # The causal decision learns top-k membership: the router's own logits (their gradient reaches the LM), or
        # the predictor's from the detached block input (it never touches the LM).
        logits = scores if self.predictor is None else self.causal_logits(hidden_states.detach(), scores)
        valid = torch.ones_like(in_topk) if key_padding_mask is None else key_padding_mask[:, -seq_len:]
        # Mean over the valid tokens as a masked sum, not by boolean indexing: indexing has a data-dependent
        # shape, which would break a torch.compile graph at every MoD block.
        per_token = F.binary_cross_entropy_with_logits(logits, in_topk.float(), reduction="none")
        count = valid.sum()
        loss = (per_token * valid).sum() / count.clamp_min(1)
        correct = (((logits > 0) == in_topk) & valid).sum()
        routing = MoDRouting(selected, in_topk, loss, correct, count)  # tensors: no host sync
        index = selected.unsqueeze(-1).expand(-1, -1, hidden)
        return out._replace(hidden_states=hidden_states.scatter_add(1, index, update), mod=routing)

    def _causal(self, hidden_states, scores, position_embeddings, key_padding_mask, cache):
        """Route each token by `causal_logits` > 0 (every token with routing "all", or at capacity 1.0, where the
        top-k is every token), a decision that depends on nothing after the token, and run the block on the routed
        tokens alone.

        Each sequence's routed tokens are gathered in sequence order, with their RoPE positions, into `width`
        slots, width the most tokens any sequence routed; a sequence that routed fewer fills its last slots with
        padding, masked out of attention and discarded. Routed tokens thus attend to exactly the routed tokens
        before them, as in training. Skipped tokens keep their input.
        """
        seq_len, hidden = hidden_states.shape[1:]
        if self.routing == "all" or self.capacity >= 1.0:
            routed = torch.ones_like(scores, dtype=torch.bool)
        else:
            routed = self.causal_logits(hidden_states, scores) > 0  # (batch, seq)
        if key_padding_mask is not None:
            routed = routed & key_padding_mask[:, -seq_len:]
        counts = routed.sum(1)
        # the one host sync of the block: the gathered width is data-dependent
        width, fewest = torch.stack([counts.max(), counts.min()]).tolist()
        if width == 0:  # every token skips: the block does not run and its cache is left as it is
            return LayerOutput(hidden_states, mod=MoDRouting(None, routed))
        valid = torch.arange(width, device=counts.device) < counts.unsqueeze(1)  # (batch, width)
        keys = valid if fewest < width else None
        if cache is not None:
            keys = cache.append_slots(self.layer_idx, valid, padded=fewest < width)
        if fewest == seq_len:  # every token routes, as in a routed decoding step: nothing to gather
            out = self.block(hidden_states, position_embeddings, keys, cache)
            weight = update_scale(scores, self.straight_through).unsqueeze(-1).to(hidden_states.dtype)
            return out._replace(hidden_states=hidden_states + (out.hidden_states - hidden_states) * weight,
                                mod=MoDRouting(None, routed))
        # routed positions first, in sequence order; a padding slot points at one of its sequence's skipped tokens
        order = torch.argsort((~routed).to(torch.uint8), dim=1, stable=True)[:, :width]  # (batch, width)
        gathered, rope = self.gather(hidden_states, position_embeddings, order)
        out = self.block(gathered, rope, keys, cache)
        weight = update_scale(scores.gather(1, order), self.straight_through) * valid  # (batch, width), 0 on padding
        update = (out.hidden_states - gathered) * weight.unsqueeze(-1).to(hidden_states.dtype)
        index = order.unsqueeze(-1).expand(-1, -1, hidden)
        return out._replace(hidden_states=hidden_states.scatter_add(1, index, update), mod=MoDRouting(None, routed))
