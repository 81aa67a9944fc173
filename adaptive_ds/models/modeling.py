"""The adaptive_ds decoder: Llama-style blocks (RMSNorm, RoPE, GQA through SDPA, SwiGLU, no biases).

The model families' features are configuration fields, each off by default: tied embeddings, an explicit
`head_dim`, attention biases, q/k RMSNorm and RoPE scaling (`rope.py`).

`AdaptiveDSConfig.arch` swaps in Mixture-of-Experts MLPs (`moe.py`) and Mixture-of-Depths routing (`mod.py`).
The routing losses and statistics are returned with the hidden states; nothing is kept in module state.
torch and transformers are all these files import: `final/` carries them and loads with `trust_remote_code=True`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from .chunked_loss import linear_cross_entropy
from .configuration import AdaptiveDSConfig
from .mod import ROUTING_MODES, AdaptiveDSCache, LayerOutput, MixtureOfDepths, MoDRouting
from .moe import MoEFeedForward, SwiGLU, update_routing_bias
from .rope import rotary_embedding, rotary_table


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(hidden_states.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Slices rather than chunk: the same views, but their backward is a zero-padded slice, which inductor fuses into
    # one loop per kernel, where chunk's is a concatenation that it writes in one loop per piece (each loop a
    # barrier of the CPU threads).
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def attention_mask_4d(key_padding_mask, query_len: int, past_len: int):
    """Boolean (batch, 1, query, past + query) mask: causal, padded keys hidden, each query sees itself."""
    key_len = past_len + query_len
    device = key_padding_mask.device
    query_pos = torch.arange(past_len, key_len, device=device).unsqueeze(-1)
    key_pos = torch.arange(key_len, device=device)
    causal = key_pos <= query_pos  # (query, key)
    allowed = causal & key_padding_mask[:, None, -key_len:]  # (batch, query, key)
    # A left-padded query would otherwise attend to nothing and turn into NaN.
    allowed = allowed | (key_pos == query_pos)
    return allowed.unsqueeze(1)


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) through `F.scaled_dot_product_attention`."""

    def __init__(self, config: AdaptiveDSConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_bias = config.attention_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_out_bias)
        # Qwen3: RMSNorm over each head's dimensions, queries and keys, before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, hidden_states, position_embeddings, key_padding_mask=None, cache: Cache | None = None):
        batch, seq_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        # keys cached before this call: one per token, or in a MoD block one per slot (see AdaptiveDSCache)
        past_len = k.shape[2] - seq_len
        mask = None
        if key_padding_mask is not None or (past_len and seq_len > 1):
            if key_padding_mask is None:
                key_padding_mask = torch.ones(batch, past_len + seq_len, dtype=torch.bool, device=q.device)
            mask = attention_mask_4d(key_padding_mask, seq_len, past_len)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and seq_len > 1, enable_gqa=True
        )  # (batch, heads, seq, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)). The MLP may be an MoE layer."""

    def __init__(self, config: AdaptiveDSConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoEFeedForward(config)
        elif config.arch_spec.mlp is not None:  # the architecture's own MLP (spec.py)
            self.mlp = config.arch_spec.mlp(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states, position_embeddings, key_padding_mask=None, cache=None) -> LayerOutput:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, key_padding_mask, cache
        )
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        if isinstance(self.mlp, MoEFeedForward):
            mlp_out, routing = mlp_out
            return LayerOutput(hidden_states + mlp_out, moe=routing)
        return LayerOutput(hidden_states + mlp_out)


@dataclass
class AdaptiveDSModelOutput(ModelOutput):
    """Hidden states plus the routing of every MoE layer and MoD block, in layer order.

    `aux_loss` and `z_loss` are means over the MoE layers, so their coefficients do not scale with depth.
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    expert_counts: tuple[torch.Tensor, ...] | None = None  # per MoE layer, (experts,) demand before capacity
    expert_dropped: tuple[torch.Tensor, ...] | None = None  # per MoE layer, assignments over capacity
    mod_routing: tuple[MoDRouting, ...] | None = None  # per MoD block
    mod_predictor_loss: torch.Tensor | None = None  # mean over MoD blocks (training)


@dataclass
class AdaptiveDSCausalLMOutput(ModelOutput):
    """`loss` = `lm_loss` + router_aux_loss_coef * `aux_loss` + router_z_loss_coef * `z_loss`
    + mod_predictor_loss_coef * `mod_predictor_loss` (without the aux term under `moe_balancing="bias"`).

    The routing losses enter the loss once, here. `mod_predictor_loss` is the MoD causal-routing BCE (see mod.py):
    on the router's own logits it also reaches the language model; a predictor's input is detached, so there it
    trains the predictor alone and leaves the language model's gradients as they are.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    expert_counts: tuple[torch.Tensor, ...] | None = None
    expert_dropped: tuple[torch.Tensor, ...] | None = None
    mod_routing: tuple[MoDRouting, ...] | None = None
    mod_predictor_loss: torch.Tensor | None = None


@dataclass
class RoutingStatistics:
    """The routing of one forward (`AdaptiveDSForCausalLM.routing_statistics`): its output without the logits and
    hidden states, which a trainer keeps across a step's micro-batches. None where the model has no such routing."""

    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    expert_counts: tuple[torch.Tensor, ...] | None = None
    expert_dropped: tuple[torch.Tensor, ...] | None = None
    mod_routing: tuple[MoDRouting, ...] | None = None
    mod_predictor_loss: torch.Tensor | None = None


class AdaptiveDSPreTrainedModel(PreTrainedModel):
    config_class = AdaptiveDSConfig
    config: AdaptiveDSConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True


class AdaptiveDSModel(AdaptiveDSPreTrainedModel):
    def __init__(self, config: AdaptiveDSConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = []
        for i in range(config.num_hidden_layers):
            block = DecoderLayer(config, i)
            layers.append(MixtureOfDepths(config, block, i) if config.is_mod_layer(i) else block)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.mod_routing = "causal"
        self.post_init()

    def set_mod_routing(self, mode: str) -> None:
        """How MoD blocks route in eval mode: "causal" (router logit or predictor > 0, every token at capacity 1.0;
        generation, honest evaluation), "topk" (the train-time per-sequence top-k, which looks at the whole
        sequence) or "all" (every token runs every block: with `mod_straight_through`, the dense model the blocks
        wrap)."""
        if mode not in ROUTING_MODES:
            raise ValueError(f"unknown MoD routing {mode!r}; valid choices: {', '.join(ROUTING_MODES)}")
        self.mod_routing = mode
        for layer in self.layers:
            if isinstance(layer, MixtureOfDepths):
                layer.routing = mode

    def set_mod_capacity(self, capacity: float) -> None:
        """The share of each sequence's tokens that routed blocks take in training (capacity schedules); at 1.0
        causal routing takes every token too."""
        for layer in self.layers:
            if isinstance(layer, MixtureOfDepths):
                layer.capacity = capacity

    def _cache(self, cache: Cache | None, use_cache: bool | None) -> Cache | None:
        """The KV cache a forward fills: the caller's, a new AdaptiveDSCache, or None where none is used."""
        if use_cache is None:  # a cache is for generation: training would only hold on to memory
            use_cache = self.config.use_cache and not self.training
        if self.training or self.mod_routing == "topk":
            use_cache = use_cache and not self.config.uses_mod  # top-k routing needs the whole sequence
        if not use_cache:
            return None
        if cache is None:
            return AdaptiveDSCache(config=self.config)
        if self.config.uses_mod and not isinstance(cache, AdaptiveDSCache):
            raise ValueError(f"a MoD model needs an AdaptiveDSCache (it records which tokens each routed block "
                             f"cached), got {type(cache).__name__}")
        return cache

    def _position_embeddings(self, hidden_states, attention_mask, key_padding_mask, position_ids, past_len):
        """RoPE's (cos, sin) of the forward's positions: given, counted over the real tokens of a left-padded batch, or
        past_len onwards in every sequence."""
        config, seq_len = self.config, hidden_states.shape[1]
        rope = (config.head_dim, config.rope_theta, hidden_states.dtype)
        scaling = (config.rope_scaling_parameters, config.max_position_embeddings)
        context = config.max_position_embeddings
        if (torch.compiler.is_compiling() and position_ids is None and key_padding_mask is None
                and past_len + seq_len <= context):
            # Computed in the graph, cos and sin would be inlined into each kernel that rotates q or k and computed
            # again for every element (forward and backward). Sliced from a table over the context, a constant of
            # the graph, they are loads, of the same values: within the context a position's cos and sin depend on
            # the position alone (dynamic scaling only changes past it).
            table = rotary_table(context, *rope, hidden_states.device, *scaling)
            return table[:, :, past_len:past_len + seq_len].unbind(0)
        if position_ids is None:
            if key_padding_mask is not None:  # left padding: count real tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_len:]
            else:
                position_ids = torch.arange(past_len, past_len + seq_len, device=hidden_states.device)[None]
        return rotary_embedding(position_ids, *rope, *scaling)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs) -> AdaptiveDSModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        seq_len = hidden_states.shape[1]
        cache = self._cache(cache, use_cache)
        past_len = cache.get_seq_length() if cache is not None else 0
        window = self.config.sliding_window
        if window is not None and past_len + seq_len > window:
            raise ValueError(f"{past_len + seq_len} tokens exceed sliding_window {window}: adaptive_ds's attention is "
                             "full causal attention, the same as a sliding window only within the window")

        key_padding_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_padding_mask = attention_mask.bool()
        position_embeddings = self._position_embeddings(hidden_states, attention_mask, key_padding_mask, position_ids,
                                                        past_len)

        moe_routing, mod_routing = [], []
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                out = torch.utils.checkpoint.checkpoint(
                    layer, hidden_states, position_embeddings, key_padding_mask, cache, use_reentrant=False
                )
            else:
                out = layer(hidden_states, position_embeddings, key_padding_mask, cache)
            hidden_states = out.hidden_states
            if out.moe is not None:
                moe_routing.append(out.moe)
            if out.mod is not None:
                mod_routing.append(out.mod)
        if isinstance(cache, AdaptiveDSCache):
            cache.seen_tokens += seq_len

        predictor = [r.predictor_loss for r in mod_routing if r.predictor_loss is not None]
        return AdaptiveDSModelOutput(
            last_hidden_state=self.norm(hidden_states),
            cache=cache,
            aux_loss=torch.stack([r.aux_loss for r in moe_routing]).mean() if moe_routing else None,
            z_loss=torch.stack([r.z_loss for r in moe_routing]).mean() if moe_routing else None,
            expert_counts=tuple(r.expert_counts for r in moe_routing) or None,
            expert_dropped=tuple(r.dropped for r in moe_routing) or None,
            mod_routing=tuple(mod_routing) or None,
            mod_predictor_loss=torch.stack(predictor).mean() if predictor else None,
        )


class AdaptiveDSForCausalLM(AdaptiveDSPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # with tie_word_embeddings

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward creates an AdaptiveDSCache, which also tracks MoD routing

    def __init__(self, config: AdaptiveDSConfig):
        super().__init__(config)
        self.model = AdaptiveDSModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The coefficient the loss uses, as Mixtral keeps it: a trainer may move it during a run (the adaptive
        # controller does) without changing the configuration that is saved with the model.
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.post_init()

    def update_routing_bias(self, step_expert_counts, group=None) -> None:
        """After an optimizer step: move the MoE routing biases (`moe_balancing="bias"`) by the step's expert
        loads, the `expert_counts` of each of its micro-batches (see `moe.update_routing_bias`)."""
        update_routing_bias(self, step_expert_counts, group)

    # What a trainer asks of the architecture (spec.py), answered here so that the trainer names none.
    def default_knobs(self) -> dict:
        """The model's side of a trainer's adjustable knobs as configured: `aux_coef` (the load-balancing loss's
        coefficient; None without experts, or with bias balancing, where the aux loss is not trained on) and
        `mod_capacity` (None without MoD blocks)."""
        config = self.config
        return {"aux_coef": config.router_aux_loss_coef if config.uses_moe and config.moe_balancing == "aux_loss"
                else None,
                "mod_capacity": config.mod_capacity if config.uses_mod else None}

    def apply_knobs(self, knobs) -> None:
        """Follow a trainer's knobs (any object with `activation_checkpointing`, `aux_coef` and `mod_capacity`, as
        `default_knobs` names them; a None knob leaves its part as it is). Idempotent."""
        self.model.gradient_checkpointing = knobs.activation_checkpointing
        if knobs.aux_coef is not None:  # the loss's coefficient, not the saved configuration's
            self.router_aux_loss_coef = knobs.aux_coef
        if knobs.mod_capacity is not None:
            self.model.set_mod_capacity(knobs.mod_capacity)

    @staticmethod
    def routing_statistics(output: AdaptiveDSCausalLMOutput) -> RoutingStatistics:
        """The routing statistics of a forward's output, without its logits and hidden states."""
        return RoutingStatistics(aux_loss=output.aux_loss, z_loss=output.z_loss, expert_counts=output.expert_counts,
                                 expert_dropped=output.expert_dropped, mod_routing=output.mod_routing,
                                 mod_predictor_loss=output.mod_predictor_loss)

    def after_optimizer_step(self, step_routing: list[RoutingStatistics], group=None) -> None:
        """What follows an optimizer step that was applied, given the routing of each of its micro-batches: the MoE
        routing biases move by the step's expert loads (bias balancing, `update_routing_bias`); nothing otherwise."""
        if self.config.uses_moe:
            self.update_routing_bias([routing.expert_counts for routing in step_routing], group)

    def validation_routings(self) -> tuple[str, ...]:
        """How validation routes MoD blocks (`AdaptiveDSModel.set_mod_routing`), the honest one first: causal, then
        with MoD blocks the train-time top-k, which sees the whole sequence."""
        return ("causal", "topk") if self.config.uses_mod else ("causal",)

    def _next_token_loss(self, hidden_states, logits, labels, num_items_in_batch):
        """The cross entropy of position t's logits against labels[t + 1], -100 ignored: the mean over the targets, or
        their sum over `num_items_in_batch`. `logits` None: they were not computed (compiled, with `skip_logits`)."""
        if logits is None:
            # Compiled, with no logits to return: the projection and the loss a chunk of positions at a time, the
            # logits never whole (models/chunked_loss.py; BENCHMARKS.md, throughput:debug:cpu).
            targets = F.pad(labels, (0, 1), value=-100)[:, 1:].flatten()
            return linear_cross_entropy(hidden_states.flatten(0, 1), self.lm_head.weight, targets, num_items_in_batch)
        if torch.compiler.is_compiling():
            # Compiled, the labels shift (the last position's target is -100, ignored) and the logits stay whole: the
            # sliced logits would be a copy of nearly all of them, forward and backward (the gradient zero-padded
            # back), where this is one pass (BENCHMARKS.md, throughput:debug:cpu). The same mean over the same
            # targets; eager keeps the slice, whose reduction order the golden losses hold.
            predicted = logits.flatten(0, 1).float()
            targets = F.pad(labels, (0, 1), value=-100)[:, 1:].flatten()
        else:
            predicted = logits[:, :-1].flatten(0, 1).float()
            targets = labels[:, 1:].flatten()
        if num_items_in_batch is None:
            return F.cross_entropy(predicted, targets, ignore_index=-100)
        return F.cross_entropy(predicted, targets, ignore_index=-100, reduction="sum") / num_items_in_batch

    def _projects_plainly(self) -> bool:
        """Whether the output projection is this class's own bias-free Linear with its whole weight at hand, which the
        chunked loss multiplies by directly: not one that an adapter wrapped (PEFT) or ZeRO-3 partitioned (its
        weight gathered only inside the module's own call)."""
        head = self.lm_head
        return type(head) is nn.Linear and head.bias is None and not hasattr(head.weight, "ds_id")

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep: int = 0, num_items_in_batch=None,
                skip_logits: bool = False, **kwargs) -> AdaptiveDSCausalLMOutput:
        """`num_items_in_batch` (as in transformers' Trainer): divide the summed token losses by this count
        instead of by this batch's own target count, so that a step split into micro-batches and ranks of
        unequal target counts weighs every target token alike.

        `skip_logits` (with `labels`): the losses, with `logits` None in the output. The trainer asks for it, as it
        reads only the losses. Eager, the logits are still computed, for the loss, and the losses and gradients are
        the same, bit for bit; the output just does not hold on to them. Compiled, a returned logits tensor would be
        an output of the graph, whose backward then takes a gradient for it, a zero tensor of (batch x seq x vocab)
        when only the loss is backpropagated; without it, the projection and the loss run a chunk of positions at a
        time and the logits never exist whole (models/chunked_loss.py; BENCHMARKS.md, throughput:debug:cpu)."""
        if skip_logits and labels is None:
            raise ValueError("skip_logits needs labels: without them the logits are the only output")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache)
        hidden_states = out.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        fused = labels is not None and skip_logits and torch.compiler.is_compiling() and self._projects_plainly()
        logits = None if fused else self.lm_head(hidden_states)

        lm_loss = loss = None
        if labels is not None:
            lm_loss = self._next_token_loss(hidden_states, logits, labels, num_items_in_batch)
            loss = lm_loss
            if out.aux_loss is not None:
                # with bias balancing the aux loss is only reported (see AdaptiveDSConfig.moe_balancing)
                aux_coef = 0.0 if self.config.moe_balancing == "bias" else self.router_aux_loss_coef
                loss = loss + aux_coef * out.aux_loss + self.config.router_z_loss_coef * out.z_loss
            if out.mod_predictor_loss is not None:
                loss = loss + self.config.mod_predictor_loss_coef * out.mod_predictor_loss
        return AdaptiveDSCausalLMOutput(
            loss=loss, logits=None if skip_logits else logits, cache=out.cache, lm_loss=lm_loss,
            aux_loss=out.aux_loss, z_loss=out.z_loss,
            expert_counts=out.expert_counts, expert_dropped=out.expert_dropped, mod_routing=out.mod_routing,
            mod_predictor_loss=out.mod_predictor_loss,
        )
