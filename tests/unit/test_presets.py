import pytest
import torch

from adaptive_ds.models import ARCHITECTURES, AdaptiveDSConfig, AdaptiveDSForCausalLM
from adaptive_ds.presets import (
    PRESETS,
    VARIANTS,
    block_parameters,
    main,
    model_config,
    pad_vocab,
    parameter_counts,
)


def test_vocab_is_padded_to_a_multiple_of_64():
    assert pad_vocab(104) == 128
    assert pad_vocab(128) == 128
    assert model_config("debug", "dense", 104).vocab_size == 128


def test_b1_has_tinyllamas_shape():
    p = PRESETS["b1"]
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
            p.intermediate_size, p.seq_len, p.num_local_experts, p.num_experts_per_tok) == (
        2048, 22, 32, 4, 5632, 2048, 8, 2)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_mod_and_hybrid_ship_with_the_papers_setting(preset):
    # Raposo et al. 2024, sec. 4.1: 12.5% capacity in every other block, the first block seeing every token.
    for arch in ("mod", "hybrid"):
        config = model_config(preset, arch, 32000)
        layers = config.num_hidden_layers
        assert (config.mod_capacity, config.mod_layer_interval) == (0.125, 2)
        assert [i for i in range(layers) if config.is_mod_layer(i)] == list(range(1, layers, 2))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_hybrid_routes_top1_dropless_and_moe_keeps_the_presets_top2(preset):
    # the hybrid's MoE blocks: one expert per token, no capacity drops (BENCHMARKS.md, "MoE at dense's active
    # FLOPs"); the moe architecture keeps the preset's 8 experts top-2 with capacity-limited training routing
    hybrid, moe = model_config(preset, "hybrid", 32000), model_config(preset, "moe", 32000)
    assert (hybrid.num_experts_per_tok, hybrid.moe_drop_tokens) == (1, False)
    assert (moe.num_experts_per_tok, moe.moe_drop_tokens, moe.num_local_experts) == (2, True, 8)
    assert hybrid.num_local_experts == 8 and hybrid.moe_expert_granularity == moe.moe_expert_granularity == 1


def test_explicit_overrides_win_over_the_architectures_defaults():
    quarter = model_config("b1", "mod", 32000, mod_capacity=0.25)
    assert (quarter.mod_capacity, quarter.mod_layer_interval) == (0.25, 2)
    half = model_config("b1", "mod", 32000, **VARIANTS["mod:half"].model)
    assert (half.mod_capacity, half.mod_layer_interval) == (0.5, 1)
    half = model_config("debug", "hybrid", 128, **VARIANTS["mod:half"].model)
    assert (half.mod_capacity, half.mod_layer_interval) == (0.5, 1)
    # a config built directly is what --arch builds (tests/unit/test_config_defaults.py), under its explicit fields
    direct = AdaptiveDSConfig(arch="mod", mod_capacity=0.25)
    assert (direct.mod_capacity, direct.mod_layer_interval) == (0.25, 2)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_preset_builds_on_meta_with_the_counted_parameters(preset, arch):
    config = model_config(preset, arch, 32000)
    with torch.device("meta"):
        model = AdaptiveDSForCausalLM(config)
    counts = parameter_counts(config)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    h, f = config.hidden_size, config.intermediate_size
    expert = 3 * h * f
    if arch == "dense":
        assert counts.active == counts.total
    if arch == "moe":  # every token skips (experts - top-k) experts in every layer
        unused = config.num_hidden_layers * (config.num_local_experts - config.num_experts_per_tok) * expert
        assert counts.active == counts.total - unused
    if arch in ("mod", "hybrid"):
        assert counts.active < counts.total


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_block_has_the_parameters_of_the_built_layer(arch):
    # interval 2: routed / expert layers alternate with plain ones, so both kinds are checked
    config = model_config("debug", arch, 128, moe_layer_interval=2, mod_layer_interval=2)
    with torch.device("meta"):
        layers = AdaptiveDSForCausalLM(config).model.layers
    for i, layer in enumerate(layers):
        block = block_parameters(config, i)
        assert block.total == sum(p.numel() for p in layer.parameters()), i
        experts = [m for name, m in layer.named_modules() if name.endswith("deepspeed_experts")]
        assert block.experts == (len(experts[0]) if experts else 0)


def test_b1_dense_is_the_1_1b_llama():
    # An external reference (an independent 1.1B Llama): hidden 2048, 22 layers, 4 KV heads, ffn 5632, vocab 32000.
    assert parameter_counts(model_config("b1", "dense", 32000)).total == 1_100_048_384


def test_cli_prints_every_preset_and_arch(capsys):
    main([])
    out = capsys.readouterr().out
    for preset in PRESETS:
        for arch in ARCHITECTURES:
            assert any(line.split()[:2] == [preset, arch] for line in out.splitlines())
    # the one table of variants: name, architecture, overrides (the architecture's defaults for a plain name)
    lines = out.splitlines()
    assert 'mod                 mod     {"mod_capacity": 0.125, "mod_layer_interval": 2}' in lines
    assert 'mod:half            mod     {"mod_capacity": 0.5, "mod_layer_interval": 1}' in lines
    assert 'moe:noaux           moe     {"router_aux_loss_coef": 0.0} controller {"moe_balance": false}' in lines
    assert sum(line.split()[:1] == [name] for name in VARIANTS for line in lines) == len(VARIANTS)
    assert "mod_paper -> mod:paper, mod_half -> mod:half" in out


def test_the_architectures_the_settings_know_are_the_models():
    """presets.ARCHITECTURES (read by the run's settings before torch is imported) and the registered specs (which
    a final/ folder's copy of the model code carries) are the same, in the same order."""
    from adaptive_ds import presets
    from adaptive_ds.models import ARCH_SPECS

    assert presets.ARCHITECTURES == tuple(ARCH_SPECS) == ARCHITECTURES
    assert all(VARIANTS[arch].arch == arch for arch in ARCHITECTURES)  # each architecture's defaults have an entry


def test_every_moe_and_mod_field_is_known_as_one():
    """A new moe_* or mod_* field joins its architectures' fields, so that a run refuses it on an arch without them."""
    from dataclasses import fields

    from adaptive_ds.models import ARCH_SPECS
    from adaptive_ds.presets import MOD_ARCHITECTURES, MOD_FIELDS, MOE_ARCHITECTURES, MOE_FIELDS

    # presets.py's tables (read before torch is imported) say what the specs say
    assert MOE_ARCHITECTURES == tuple(name for name, spec in ARCH_SPECS.items() if spec.moe)
    assert MOD_ARCHITECTURES == tuple(name for name, spec in ARCH_SPECS.items() if spec.mod)

    names = {f.name for f in fields(AdaptiveDSConfig)}
    assert {n for n in names if n.startswith("moe_")} <= set(MOE_FIELDS) <= names
    assert {n for n in names if n.startswith("mod_")} == set(MOD_FIELDS)
    assert {"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"} <= set(MOE_FIELDS)
