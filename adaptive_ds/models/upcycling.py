"""An adaptive_ds model's first weights from a trained model of the same architecture, or from a dense model
upcycled to MoE, MoD or the hybrid, and the rules of which source starts which architecture.

A source is read by our tensor names for its architecture (a family's `reader` maps a stock folder's names to ours,
models/families/). A model of the source's architecture takes every tensor by its name; a plain source
(`ArchitectureSpec.plain`: dense) starts any architecture whose MLPs are SwiGLU (`starts`), upcycled as below, with
the settings that keep its first forward pass the dense model's (`upcycled_settings`).

Sparse upcycling (Komatsuzaki et al. 2022, arXiv 2212.05055): every expert of an MoE layer starts as a copy of the
dense MLP it replaces, so that the first forward pass is the dense model's:

- granularity 1: routed expert e is the dense MLP; a token's top-k weights are renormalised over its choices (k >= 2
  always; top-1 with `moe_renormalize_top1`, which the upcycled config turns on), so k identical experts give the
  dense output whatever the router says. The router keeps the model's seeded initialisation.
- granularity g (fine-grained experts, `moe_expert_granularity`): copy c of the dense MLP is split into the g
  experts c*g .. c*g+g-1, expert c*g+s holding the s-th slice of the dense MLP's f hidden units (rows of the gate
  and up projections, columns of the down projection, f/g each) with its down projection scaled by g; the g router
  rows of a copy are equal (row c*g's initialisation), so a token's top-(k*g) choice takes whole copies (the k best
  copies' g slices tie exactly, and two copies tie with probability zero), and with the renormalised weights
  p_c / (g * sum of the chosen copies' p) each copy contributes sum_s g * slice_s / g = the dense MLP, the copies
  together the dense output.
- shared experts (`moe_shared_experts`) start with a zero down projection, so they add nothing at first; PR-MoE's
  residual MLP (`moe_use_residual`, granularity 1) is a copy too, so the learned mixing gives the dense output.
- `noise` > 0 multiplies each routed expert's weights element-wise by 1 + N(0, noise^2) (a draw of its own for each
  projection of each expert, seeded by the run's seed, the layer, the expert's global index and the projection, so
  every rank draws the same): the copies then differ from the first step, and the first forward pass is no longer
  exactly the dense one.

The MoD retrofit (Raposo et al. 2024) adds routers to a dense model's blocks: the routers keep the model's seeded
initialisation and the block update is scaled by the straight-through scale (`mod_straight_through`), so a routed
token gets the dense block's output, every token routed (capacity 1.0, or `set_mod_routing("all")`) the dense model.

Vocabulary padding: the model's vocabulary is the source's rounded up to a multiple of 64 (`presets.pad_vocab`); the
added rows of the embedding and the LM head are zeros, so the logits of the source's tokens are unchanged and each
added token's logit is 0 until training lowers it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from .configuration import AdaptiveDSConfig
from .spec import architecture_spec

# Reads a tensor of the source by its name there; `index` selects one entry of its first dimension (a stacked expert).
Reader = Callable[..., torch.Tensor]

SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
# The family features that change which tensors a model holds (models/configuration.py): a source fixes them
FEATURE_FIELDS = ("tie_word_embeddings", "head_dim", "attention_qkv_bias", "attention_out_bias", "qk_norm")
# Fields a folder of our own fixes: they change which tensors the model holds (or, for a dense source, are its shape)
STRUCTURAL_FIELDS = (*SHAPE_FIELDS, "vocab_size", "num_local_experts", "num_experts_per_tok", "moe_layer_interval",
                     "moe_expert_granularity", "moe_shared_experts", "moe_use_residual", "moe_balancing",
                     "mod_layer_interval", "mod_causal_routing", "mod_predictor_hidden_size", "moe_intermediate_size",
                     *FEATURE_FIELDS)
_LAYER = re.compile(r"model\.layers\.(\d+)\.(?:block\.)?(.*)")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT = re.compile(r"mlp\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(\w+_proj)\.weight")
_KEEP = ("router.", "predictor.", "mlp.moe.coefficient.", "mlp.routing_bias_steps")  # the model's own initial values
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def starts(source_arch: str, arch: str) -> bool:
    """Whether a model of `source_arch` starts a model of `arch`: its own architecture, or, from a plain one (dense),
    any whose MLPs are SwiGLU (an architecture with an MLP of its own has no weights for it in a plain model). The
    specs decide (`ArchitectureSpec.plain`), as for every rule here."""
    return arch == source_arch or upcycles(source_arch, arch)


def upcycles(source_arch: str, arch: str) -> bool:
    """Whether starting `arch` from `source_arch` is an upcycling (a plain model to another SwiGLU architecture)."""
    return arch != source_arch and architecture_spec(source_arch).plain and architecture_spec(arch).mlp is None


def copies_experts(source_arch: str, arch: str) -> bool:
    """Whether starting `arch` from `source_arch` copies the dense MLPs into experts (what `noise` perturbs); the
    architectures' specs decide (`ArchitectureSpec.upcycles_into`)."""
    return architecture_spec(source_arch).upcycles_into(architecture_spec(arch))


def fixed_fields(source_arch: str) -> tuple[str, ...]:
    """The config fields a source of `source_arch` fixes (a run may not set them): a plain model's shape, vocabulary
    and family features (`FEATURE_FIELDS`: tied embeddings, head_dim, attention biases, q/k norm); any other's every
    field that changes which tensors the model holds."""
    if architecture_spec(source_arch).plain:
        return (*SHAPE_FIELDS, "vocab_size", *FEATURE_FIELDS)
    return STRUCTURAL_FIELDS


def upcycling_problems(source_arch: str, arch: str, settings: dict) -> list[str]:
    """What keeps `settings` (AdaptiveDSConfig fields) from upcycling a `source_arch` model to `arch`, one line
    each."""
    found = []
    if copies_experts(source_arch, arch) and settings.get("moe_use_residual") \
            and settings.get("moe_expert_granularity", 1) > 1:
        found.append("upcycling copies the dense MLP into PR-MoE's residual MLP, which needs moe_expert_granularity 1")
    if copies_experts(source_arch, arch) and settings.get("moe_intermediate_size") is not None:
        found.append("upcycling copies the dense MLP into the experts, whose width is then the dense MLP's: "
                     "--model may not set moe_intermediate_size")
    return found


def upcycled_settings(source_arch: str, arch: str, settings: dict) -> dict:
    """The settings that make an upcycled model's first forward pass the dense model's (empty when `arch` from
    `source_arch` is no upcycling), given its other `settings`: MoD's straight-through update scale, and top-1
    routing renormalised over its one choice (identical experts then give the dense output)."""
    if not upcycles(source_arch, arch):
        return {}
    spec = architecture_spec(arch)
    top_1 = settings["num_experts_per_tok"] * settings.get("moe_expert_granularity", 1) == 1
    return {"mod_straight_through": spec.mod, "moe_renormalize_top1": spec.moe and top_1}


def initial_tensors(model: torch.nn.Module, source_arch: str, read: Reader, ep_rank: int = 0,
                    noise: float = 0.0, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every entry of the state dict `model` (an AdaptiveDSForCausalLM, perhaps holding one
    expert-parallel rank's experts) starts from, one at a time, for a source of `source_arch` that `read` reads by
    our tensor names (experts by their global index): the model's own architecture (every tensor by its name) or a
    dense model, upcycled to the model's architecture. `ep_rank`: which experts the model holds (rank r holds
    experts r * n .. r * n + n - 1)."""
    config: AdaptiveDSConfig = model.config
    assert starts(source_arch, config.arch), (source_arch, config.arch)
    upcycled = upcycles(source_arch, config.arch)
    num_local = config.num_routed_experts // config.moe_ep_size
    for name, own in model.state_dict().items():
        match = _LAYER.fullmatch(name)
        if match is None:  # the embedding, the final norm, the LM head (the embedding, where they are tied)
            source = _VOCAB[0] if name == _VOCAB[1] and config.tie_word_embeddings else name
            yield name, _padded(read(source), own) if name in _VOCAB else read(source)
            continue
        layer, inner = match.group(1), match.group(2)
        expert = _EXPERT.fullmatch(inner)
        global_expert = ep_rank * num_local + int(expert.group(1)) if expert else None
        if not upcycled:
            tensor = read(name if expert is None else name.replace(f"deepspeed_experts.{expert.group(1)}.",
                                                                   f"deepspeed_experts.{global_expert}."))
        else:
            tensor = _from_dense(config, layer, inner, expert, global_expert, own, read)
        if expert is not None and noise > 0 and upcycled:
            projection = _PROJECTIONS.index(expert.group(2))  # gate and up are equally shaped: draws of their own
            generator = torch.Generator().manual_seed(
                seed * 1_000_003 + int(layer) * 10_007 + global_expert * len(_PROJECTIONS) + projection)
            tensor = tensor * (1 + noise * torch.randn(tensor.shape, generator=generator))
        yield name, tensor


def _padded(source: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The source's (vocab, hidden) rows, then zero rows up to the model's padded vocabulary."""
    assert source.shape[0] <= own.shape[0] and source.shape[1:] == own.shape[1:], (source.shape, own.shape)
    padded = source.new_zeros(own.shape)
    padded[: source.shape[0]] = source
    return padded


def _from_dense(config: AdaptiveDSConfig, layer: str, inner: str, expert, global_expert, own, read) -> torch.Tensor:
    if inner.startswith(_KEEP) or inner.startswith("mlp.shared_experts.") and not inner.startswith(
            "mlp.shared_experts.down_proj"):
        return own
    if inner == "mlp.shared_experts.down_proj.weight":
        return torch.zeros_like(own)  # shared experts add nothing at first
    if inner == "mlp.moe.deepspeed_moe.gate.wg.weight":
        # the g router rows of each copy equal (its first slice's), so a token picks whole copies
        g = config.moe_expert_granularity
        return own.view(-1, g, own.shape[-1])[:, :1].expand(-1, g, -1).reshape(own.shape).clone()
    if inner.startswith("mlp.moe.mlp."):  # PR-MoE's residual MLP: a copy of the dense MLP
        return read(f"model.layers.{layer}.{inner.replace('mlp.moe.mlp.', 'mlp.')}")
    if expert is None:  # attention, norms, a dense MLP
        return read(f"model.layers.{layer}.{inner}")
    projection = expert.group(2)
    dense = read(f"model.layers.{layer}.mlp.{projection}.weight")  # gate, up (ffn, hidden); down (hidden, ffn)
    g = config.moe_expert_granularity
    if g == 1:
        return dense
    width, piece = config.expert_intermediate_size, global_expert % g
    if projection == "down_proj":
        return dense[:, piece * width:(piece + 1) * width] * g
    return dense[piece * width:(piece + 1) * width]
