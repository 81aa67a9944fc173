"""Mixture-of-Depths routing around a whole decoder block (Raposo et al. 2024, arXiv 2404.02258).

Training routes the top `capacity * seq_len` tokens of each sequence (the paper's expert-choice routing).
That choice looks at the whole sequence, so inference cannot use it causally. Section 3.5 of the paper gives
the fix used here: a small auxiliary predictor, an MLP on the stop-gradient block input trained with binary
cross-entropy toward top-k membership, decides per token whether it runs the block. In eval mode
(`routing="causal"`, the default) the predictor routes; `routing="topk"` evaluates with the train-time rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache

from .configuration import AdaptiveDSConfig

ROUTING_MODES = ("causal", "topk")


def routed_token_count(seq_len: int, capacity: float) -> int:
    """Tokens of each sequence that pass through a routed block: ceil(capacity * seq_len), at least one."""
    return max(1, math.ceil(capacity * seq_len - 1e-9))


class AdaptiveDSCache(DynamicCache):
    """A DynamicCache that also remembers, per MoD block, which cached tokens ran the block.

    In causal routing every token's keys and values are cached, and the tokens that skipped a block are masked
    out of its attention for all later queries, as if their keys had never been written.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.routed: dict[int, torch.Tensor] = {}  # layer -> (batch, cached tokens) bool

    def update_routed(self, layer_idx: int, routed: torch.Tensor) -> torch.Tensor:
        previous = self.routed.get(layer_idx)
        self.routed[layer_idx] = routed if previous is None else torch.cat([previous, routed], dim=1)
        return self.routed[layer_idx]


@dataclass
class MoDRouting:
    """One MoD block's routing of one forward pass."""

    selected: torch.Tensor | None  # (batch, k) routed positions (top-k routing)
    routed: torch.Tensor  # (batch, seq) bool: tokens that ran the block
    predictor_loss: torch.Tensor | None = None  # BCE of the causal predictor toward top-k membership (training)
    predictor_correct: torch.Tensor | None = None  # predictor decisions that matched top-k membership
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
        self.router = nn.Linear(config.hidden_size, 1, bias=False)
        hidden = config.mod_predictor_hidden_size
        self.predictor = nn.Sequential(nn.Linear(config.hidden_size, hidden, bias=False), nn.SiLU(),
                                       nn.Linear(hidden, 1, bias=False))
        self.block = block

    def forward(self, hidden_states, position_embeddings, key_padding_mask=None, cache=None):
        scores = self.router(hidden_states).squeeze(-1).float()  # (batch, seq)
        if self.training or self.routing == "topk":
            if cache is not None:
                raise ValueError("top-k MoD routing sees the whole sequence and cannot use a KV cache")
            return self._topk(hidden_states, scores, position_embeddings, key_padding_mask)
        return self._causal(hidden_states, scores, position_embeddings, key_padding_mask, cache)

    def _topk(self, hidden_states, scores, position_embeddings, key_padding_mask):
        batch, seq_len, hidden = hidden_states.shape
        k = routed_token_count(seq_len, self.capacity)
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask[:, -seq_len:], float("-inf"))
        selected = scores.topk(k, dim=1).indices.sort(dim=1).values  # (batch, k), in sequence order
        gather_hidden = selected.unsqueeze(-1).expand(-1, -1, hidden)
        routed = hidden_states.gather(1, gather_hidden)  # (batch, k, hidden)

        cos, sin = position_embeddings  # (1 or batch, seq, head_dim)
        gather_rope = selected.unsqueeze(-1).expand(-1, -1, cos.shape[-1])
        routed_rope = (cos.expand(batch, -1, -1).gather(1, gather_rope),
                       sin.expand(batch, -1, -1).gather(1, gather_rope))
        routed_mask = None if key_padding_mask is None else key_padding_mask.gather(1, selected)

        out = self.block(routed, routed_rope, routed_mask, cache=None)
        weight = torch.sigmoid(scores.gather(1, selected)).unsqueeze(-1).to(hidden_states.dtype)
        update = (out.hidden_states - routed) * weight  # (batch, k, hidden)
        in_topk = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, selected, True)

        # The predictor learns top-k membership from the block input, detached: it never touches the LM.
        logits = self.predictor(hidden_states.detach()).squeeze(-1).float()
        valid = torch.ones_like(in_topk) if key_padding_mask is None else key_padding_mask[:, -seq_len:]
        # Mean over the valid tokens as a masked sum, not by boolean indexing: indexing has a data-dependent
        # shape, which would break a torch.compile graph at every MoD block.
        per_token = F.binary_cross_entropy_with_logits(logits, in_topk.float(), reduction="none")
        count = valid.sum()
        loss = (per_token * valid).sum() / count.clamp_min(1)
        correct = (((logits > 0) == in_topk) & valid).sum()
        routing = MoDRouting(selected, in_topk, loss, correct, count)  # tensors: no host sync
        return out._replace(hidden_states=hidden_states.scatter_add(1, gather_hidden, update), mod=routing)

    def _causal(self, hidden_states, scores, position_embeddings, key_padding_mask, cache):
        """Route each token by the predictor alone: a decision that depends on nothing after the token.

        The block runs on the full sequence with skipped tokens masked out of its attention keys, so routed
        tokens see exactly the routed tokens before them, as in training; skipped tokens keep their input.
        """
        seq_len = hidden_states.shape[1]
        routed = self.predictor(hidden_states).squeeze(-1) > 0  # (batch, seq)
        if key_padding_mask is not None:
            routed = routed & key_padding_mask[:, -seq_len:]
        keys = routed if cache is None else cache.update_routed(self.layer_idx, routed)
        out = self.block(hidden_states, position_embeddings, keys, cache)
        weight = torch.sigmoid(scores).unsqueeze(-1).to(hidden_states.dtype) * routed.unsqueeze(-1)
        update = (out.hidden_states - hidden_states) * weight
        return out._replace(hidden_states=hidden_states + update, mod=MoDRouting(None, routed))
