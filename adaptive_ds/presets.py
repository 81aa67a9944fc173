"""The one table of model sizes, the one table of variants (what each architecture ships with, and its named
options), and the true parameter counts of every preset x architecture.

Run `python -m adaptive_ds.presets [--vocab_size N]` to print the counts and the variants.

Importing this module imports no torch (the model configuration is imported where a model configuration is built), so
that a training run's settings are checked before torch is (training/arguments.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models.configuration import AdaptiveDSConfig


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    seq_len: int
    num_local_experts: int
    num_experts_per_tok: int


PRESETS: dict[str, Preset] = {
    #                  hidden layers heads kv   ffn   seq  experts top-k
    "debug": Preset(128, 4, 4, 2, 384, 256, 8, 2),
    "debug_200m": Preset(1024, 12, 16, 4, 2816, 2048, 8, 2),
    "b1": Preset(2048, 22, 32, 4, 5632, 2048, 8, 2),
    "b7": Preset(4096, 32, 32, 8, 11008, 2048, 8, 2),
}
# A run from pretrained weights of no preset's shape (and none named) trains at their max_position_embeddings up to
# this (adaptive_ds/pretrained.py): the longest preset's seq_len, never the default preset's, which describes another
# model.
NO_PRESET_SEQ_LEN = max(p.seq_len for p in PRESETS.values())


def _architecture_defaults() -> dict[str, dict]:
    """What each architecture ships with (`ARCHITECTURE_DEFAULTS` of models/defaults.py, where the model configuration
    fills them in), read from that file alone: importing it through the models package would import torch."""
    spec = importlib.util.spec_from_file_location("_architecture_defaults",
                                                  Path(__file__).parent / "models" / "defaults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ARCHITECTURE_DEFAULTS


ARCHITECTURE_DEFAULTS = _architecture_defaults()

# MoD settings the variants below are made of (Raposo et al. 2024, arXiv 2404.02258): the paper's recommended setting,
# 12.5% capacity in every other block (sec. 4.1), and capacity 0.5 in every block, mod's first default.
_MOD_PAPER = {"mod_capacity": 0.125, "mod_layer_interval": 2}
_MOD_HALF = {"mod_capacity": 0.5, "mod_layer_interval": 1}
# The hybrid's MoE routing before its top-1 dropless default, named by the variants that trained it.
_TOP2_CAPACITY = {"num_experts_per_tok": 2, "moe_drop_tokens": True}


@dataclass(frozen=True)
class ArchVariant:
    """A named setting of an architecture: overrides of its model config (AdaptiveDSConfig fields) and of the
    training controller (ControllerSettings fields), and one line on what it is. The training run checks every
    field, so an entry is one line of `VARIANTS`."""

    arch: str
    model: dict = field(default_factory=dict)
    controller: dict = field(default_factory=dict)
    about: str = ""


# The one table of variants, each named ARCH or ARCH:OPTION: `--variant NAME` of a training run, `--variants NAME ...`
# of the grid (adaptive_ds/tools/grid.py), `model_config(preset, arch, vocab, **VARIANTS[name].model)` in code. The
# plain architecture names are what each architecture ships with, the defaults AdaptiveDSConfig fills in for the fields
# a config leaves unset (models/defaults.py): `model_config` applies them over the preset's sizes and under any explicit
# override (a variant, `--model`). A named variant names every field it sets, so that it keeps training what it
# trained in the BENCHMARKS.md grids that named it when the architecture's defaults move.
VARIANTS: dict[str, ArchVariant] = {
    "dense": ArchVariant("dense", dict(ARCHITECTURE_DEFAULTS["dense"]), about="Llama-style decoder"),
    # 8 experts top-2 by definition (the preset's), capacity-limited training routing
    "moe": ArchVariant("moe", dict(ARCHITECTURE_DEFAULTS["moe"]), about="the preset's experts top-2, capacity-limited"),
    # The paper's setting: of the MoD settings measured at equal tokens the one of the lowest mean validation loss
    # (each a tie with dense), and below dense trained on the same FLOPs, ties at both budgets: -0.0968 ± 0.0339 at
    # 500k tokens and -0.0620 ± 0.0110 at 2M (three seeds; BENCHMARKS.md sections grid:debug:embedded-hard,
    # grid:debug:embedded-hard:active-flops-vs-iso-dense and grid:debug:embedded-hard:2m-vs-iso-dense).
    "mod": ArchVariant("mod", dict(ARCHITECTURE_DEFAULTS["mod"]),
                       about="MoD at the paper's setting: 12.5% capacity in every other block"),
    # The same MoD setting around MoE blocks that route each token to one expert, dropless: below dense trained on the
    # same FLOPs, ties at both budgets: -0.0495 ± 0.0167 at 500k tokens and -0.0433 ± 0.0139 at 2M, where the top-2
    # capacity-limited hybrid is above it, +0.0161 ± 0.0033, a tie too (three seeds; sections
    # grid:debug:embedded-hard:active-flops-vs-iso-dense, grid:debug:embedded-hard:2m-vs-iso-dense and
    # grid:debug:embedded-hard:2m-hybrid-paper-vs-iso-dense). The moe architecture itself is 8 experts top-2 by
    # definition; the hybrid's top-k is free to follow the measurements.
    "hybrid": ArchVariant("hybrid", dict(ARCHITECTURE_DEFAULTS["hybrid"]),
                          about="mod's setting around MoE blocks that route top-1, dropless"),
    "moe:dropless": ArchVariant("moe", {"moe_drop_tokens": False}, about="no capacity drops"),
    "moe:top1": ArchVariant("moe", {"num_experts_per_tok": 1},
                            about="top-1 (Switch Transformer): dense's active FLOPs, so equal tokens ~ equal FLOPs"),
    "moe:fine1": ArchVariant("moe", {"moe_expert_granularity": 4, "num_experts_per_tok": 1},
                             about="32 experts of a quarter width, top-4: fine-grained at dense's active FLOPs"),
    "moe:fine1-dropless": ArchVariant("moe", {"moe_expert_granularity": 4, "num_experts_per_tok": 1,
                                              "moe_drop_tokens": False}, about="moe:fine1, dropless"),
    "moe:noaux": ArchVariant("moe", {"router_aux_loss_coef": 0.0}, {"moe_balance": False},
                             about="no balancing loss, and no controller raising its coefficient back"),
    "moe:bias": ArchVariant("moe", {"moe_balancing": "bias"},
                            about="auxiliary-loss-free balancing by a routing bias (DeepSeek-V3, arXiv 2412.19437)"),
    "moe:fine": ArchVariant("moe", {"moe_expert_granularity": 4},
                            about="4x the experts, a quarter as wide, top-8 (DeepSeekMoE, arXiv 2401.06066): same "
                                  "active FLOPs"),
    "moe:deepseek": ArchVariant("moe", {"moe_expert_granularity": 4, "moe_shared_experts": 1,
                                        "moe_balancing": "bias", "moe_drop_tokens": False},
                                about="DeepSeekMoE's recipe: fine-grained, one shared expert, bias balancing, "
                                      "dropless"),
    "mod:paper": ArchVariant("mod", _MOD_PAPER, about="the paper's setting, named (mod's default)"),
    "mod:half": ArchVariant("mod", _MOD_HALF, about="capacity 0.5 in every block: mod's first default"),
    "mod:predictor": ArchVariant("mod", {"mod_causal_routing": "predictor"},
                                 about="causal routing by the detached predictor MLP (before router-logit routing)"),
    "hybrid:predictor": ArchVariant("hybrid", {"mod_causal_routing": "predictor"},
                                    about="causal routing by the detached predictor MLP"),
    "hybrid:top1": ArchVariant("hybrid", {"num_experts_per_tok": 1, "moe_drop_tokens": True},
                               about="MoE blocks top-1, capacity-limited"),
    "hybrid:paper": ArchVariant("hybrid", {**_MOD_PAPER, **_TOP2_CAPACITY},
                                about="mod's setting around top-2 capacity-limited MoE: the hybrid's default "
                                      "before top-1 dropless"),
    "hybrid:half": ArchVariant("hybrid", {**_MOD_HALF, **_TOP2_CAPACITY},
                               about="capacity 0.5 in every block around top-2 capacity-limited MoE: the hybrid's "
                                     "first default"),
    "hybrid:dropless": ArchVariant("hybrid", {**_MOD_HALF, **_TOP2_CAPACITY, "moe_drop_tokens": False},
                                   about="hybrid:half, dropless"),
}
# The architectures, in the order of the tables: the variants named after their own architecture, each what it ships
# with. The model code registers each (adaptive_ds/models/architectures.py, which a final/ folder's copy carries);
# this table is the one read before torch is imported (tests/unit/test_presets.py keeps the two the same).
ARCHITECTURES = tuple(name for name, entry in VARIANTS.items() if name == entry.arch)

# The architectures with experts and with MoD routing (as their specs in models/architectures.py have them), and the
# fields only they read: set for another architecture a field would change nothing, so a run
# refuses it (`unused_fields`), before torch is imported (training/arguments.py: preflight).
MOE_ARCHITECTURES = ("moe", "hybrid")
MOD_ARCHITECTURES = ("mod", "hybrid")
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "moe_layer_interval", "moe_capacity_factor",
              "moe_min_capacity", "moe_drop_tokens", "moe_ep_size", "moe_dispatch",
              "moe_grouped_gemm", "moe_jitter", "moe_use_residual", "moe_expert_granularity", "moe_shared_experts",
              "moe_balancing", "moe_bias_update_rate", "moe_renormalize_top1", "moe_intermediate_size",
              "moe_norm_topk_prob", "router_aux_loss_coef",
              "router_z_loss_coef")
MOD_FIELDS = ("mod_capacity", "mod_layer_interval", "mod_causal_routing", "mod_predictor_hidden_size",
              "mod_predictor_loss_coef", "mod_straight_through")


def unused_fields(arch: str, names) -> list[str]:
    """One line for each kind of field among `names` that `arch` does not read (MoE fields without experts, MoD fields
    without MoD routing), naming the fields and the architectures that read them; empty when `arch` reads them all."""
    found = []
    for kind, architectures, kind_fields in (("experts", MOE_ARCHITECTURES, MOE_FIELDS),
                                             ("MoD routing", MOD_ARCHITECTURES, MOD_FIELDS)):
        unused = [name for name in names if name in kind_fields]
        if unused and arch not in architectures:
            found.append(f"model field(s) {', '.join(unused)} apply to arch {' and '.join(architectures)} ({kind}), "
                         f"not to arch {arch}")
    return found

# Spellings of variants before they were named ARCH:OPTION: `--variant` still takes them (with a warning).
# Deprecated in 0.2, removed in 0.3 (CHANGELOG.md).
RENAMED_VARIANTS = {"mod_paper": "mod:paper", "mod_half": "mod:half"}


def variant_overrides(name: str) -> ArchVariant:
    """The variant `name` as overrides of its architecture's defaults, what a run's command line passes: a plain
    architecture name overrides nothing (its entry is those defaults, which `model_config` applies itself), a named
    variant every field of its entry. ValueError naming the valid ones for an unknown name."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
    entry = VARIANTS[name]
    return ArchVariant(entry.arch, {} if name == entry.arch else dict(entry.model), dict(entry.controller),
                       entry.about)


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """The tokenizer's vocabulary rounded up to a multiple of 64, for aligned embedding matmuls."""
    return -(-vocab_size // multiple) * multiple


def model_config(preset: str, arch: str, vocab_size: int, **overrides) -> AdaptiveDSConfig:
    """The model configuration of `preset` in architecture `arch` (with the defaults of its entry in `VARIANTS`) for
    a tokenizer of `vocab_size` tokens; `overrides` (AdaptiveDSConfig fields) win over both."""
    from .models.configuration import AdaptiveDSConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid choices: {', '.join(PRESETS)}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; valid choices: {', '.join(ARCHITECTURES)}")
    p = PRESETS[preset]
    fields = dict(
        arch=arch, vocab_size=pad_vocab(vocab_size), hidden_size=p.hidden_size,
        num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads, intermediate_size=p.intermediate_size,
        max_position_embeddings=p.seq_len, num_local_experts=p.num_local_experts,
        num_experts_per_tok=p.num_experts_per_tok,
    )
    fields.update(VARIANTS[arch].model)
    fields.update(overrides)
    return AdaptiveDSConfig(**fields)


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int  # parameters one token passes through on average (MoE: top-k experts; MoD: routed share)


@dataclass(frozen=True)
class BlockParameters:
    """The parameters of one decoder block, by part: the one place a block's arithmetic is written (parameter
    counts, FLOPs and the planner's memory all start here)."""

    attention: int  # q, k, v, o projection weights: 2 h q + 2 h kv (q = heads x head_dim, kv = kv heads x head_dim)
    norms: int  # the two RMSNorm weights, the q/k norms' (qk_norm) and the attention biases: no matmuls
    mlp: int  # one MLP (SwiGLU: 3 h f; an architecture may bring its own), or one routed expert (3 h f / granularity)
    experts: int  # routed experts in this layer (0: a dense MLP)
    experts_per_token: int
    router: int  # the MoE router (0 in a dense layer)
    shared: int  # what every token runs beside its routed experts: shared experts, PR-MoE residual MLP (0: none)
    mod_router: int  # the MoD router, run on every token (0: not routed)
    mod_predictor: int  # the MoD causal-routing predictor, run on every token (0: none, or not routed)

    @property
    def mlp_total(self) -> int:
        return self.router + self.experts * self.mlp + self.shared if self.experts else self.mlp

    @property
    def mlp_active(self) -> int:
        """The MLP parameters one token passes through: its top-k experts, the shared ones and the router."""
        return self.router + self.experts_per_token * self.mlp + self.shared if self.experts else self.mlp

    @property
    def mod_routing(self) -> int:
        """The MoD routing parameters: router and predictor."""
        return self.mod_router + self.mod_predictor

    @property
    def total(self) -> int:
        return self.attention + self.norms + self.mlp_total + self.mod_routing


def block_parameters(config: AdaptiveDSConfig, layer_idx: int) -> BlockParameters:
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    mod = config.is_mod_layer(layer_idx)
    predictor = mod and config.mod_causal_routing == "predictor"
    norms = 2 * h + 2 * config.head_dim * config.qk_norm
    norms += (q + 2 * kv) * config.attention_qkv_bias + h * config.attention_out_bias
    common = dict(attention=2 * h * q + 2 * h * kv, norms=norms, mod_router=h if mod else 0,
                  mod_predictor=(h + 1) * config.mod_predictor_hidden_size if predictor else 0)
    if not config.is_moe_layer(layer_idx):
        own = config.arch_spec.mlp_parameters  # an architecture's own MLP (models/spec.py); None: SwiGLU
        mlp = own(config) if own is not None else 3 * h * config.intermediate_size
        return BlockParameters(**common, mlp=mlp, experts=0, experts_per_token=0, router=0, shared=0)
    expert = 3 * h * config.expert_intermediate_size
    shared = 3 * h * config.shared_intermediate_size
    if config.moe_use_residual:  # an expert-sized MLP and its (h -> 2) mixing coefficient with bias
        shared += expert + 2 * h + 2
    return BlockParameters(**common, mlp=expert, experts=config.num_routed_experts,
                           experts_per_token=config.num_routed_experts_per_tok, router=h * config.num_routed_experts,
                           shared=shared)


def parameter_counts(config: AdaptiveDSConfig) -> ParameterCounts:
    """Exact counts from the dimensions (a test checks them against built models).

    Active parameters: a token uses the embedding row, attention, norms, the MLP or its top-k routed experts
    plus the router and any shared experts, and the LM head. In a MoD-routed block only `mod_capacity` of the
    tokens run the block, so the block counts with that weight (its router and any causal-routing predictor with
    weight 1).
    """
    h = config.hidden_size
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    total = active = float(embeddings + h)  # + final norm
    for i in range(config.num_hidden_layers):
        block = block_parameters(config, i)
        block_active = block.attention + block.norms + block.mlp_active
        if config.is_mod_layer(i):
            active += block.mod_routing
            block_active *= config.mod_capacity
        total += block.total
        active += block_active
    return ParameterCounts(int(total), int(round(active)))


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description="True total and active parameter counts of every preset.")
    parser.add_argument("--vocab_size", type=int, default=32000,
                        help="tokenizer vocabulary (padded to a multiple of 64); default: Llama's 32000")
    args = parser.parse_args(argv)
    print(f"vocab {pad_vocab(args.vocab_size)} (padded from {args.vocab_size}); untied embeddings")
    print(f"{'preset':<12}{'arch':<8}{'total':>16}{'active':>16}{'total':>9}{'active':>9}")
    for name in PRESETS:
        for arch in ARCHITECTURES:
            counts = parameter_counts(model_config(name, arch, args.vocab_size))
            print(f"{name:<12}{arch:<8}{counts.total:>16,}{counts.active:>16,}"
                  f"{_human(counts.total):>9}{_human(counts.active):>9}")
    print("variants (adaptive_ds/presets.py VARIANTS): --variant NAME of a training run, --variants NAME of the grid; "
          "a plain architecture name is what it ships with, which the counts above use")
    print(f"{'name':<20}{'arch':<8}overrides")
    for name, entry in VARIANTS.items():
        controller = f" controller {json.dumps(entry.controller)}" if entry.controller else ""
        print(f"{name:<20}{entry.arch:<8}{json.dumps(entry.model)}{controller}")
        print(f"{'':<28}{entry.about}")
    renamed = ", ".join(f"{old} -> {new}" for old, new in RENAMED_VARIANTS.items())
    print(f"renamed (--variant still takes the old spelling, with a warning, until 0.3): {renamed}")

if __name__ == "__main__":
    main()
