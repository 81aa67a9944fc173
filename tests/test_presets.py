import pytest
import torch

from adaptive_ds.models import ARCHITECTURES, AdaptiveDSForCausalLM
from adaptive_ds.presets import PRESETS, block_parameters, main, model_config, pad_vocab, parameter_counts


def test_vocab_is_padded_to_a_multiple_of_64():
    assert pad_vocab(104) == 128
    assert pad_vocab(128) == 128
    assert model_config("debug", "dense", 104).vocab_size == 128


def test_table_matches_the_issue():
    p = PRESETS["b1"]
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
            p.intermediate_size, p.seq_len, p.num_local_experts, p.num_experts_per_tok, p.mod_capacity) == (
        2048, 22, 32, 4, 5632, 2048, 8, 2, 0.6)


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
    # The anchors' 1.10B Llama: hidden 2048, 22 layers, 4 KV heads, ffn 5632, vocab 32000, untied.
    assert parameter_counts(model_config("b1", "dense", 32000)).total == 1_100_048_384


def test_cli_prints_every_preset_and_arch(capsys):
    main([])
    out = capsys.readouterr().out
    for preset in PRESETS:
        for arch in ARCHITECTURES:
            assert any(line.split()[:2] == [preset, arch] for line in out.splitlines())
