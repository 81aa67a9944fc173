"""The model families' features (tied embeddings, head_dim, attention biases, q/k norm, RoPE scaling, sliding window):
each computes what transformers' own class computes with the same weights, and each is off by default."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from adaptive_ds.flops import training_flops_per_token
from adaptive_ds.models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from adaptive_ds.presets import block_parameters, parameter_counts

SHAPE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7,
                      "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn at random (transformers initialises biases to 0 and norms to 1, which would hide
    them)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def logit_gap(stock: torch.nn.Module, fields: dict, length: int) -> float:
    """max |logits| difference between `stock` (weights randomized) and our model of `fields` with its weights."""
    stock = randomized(stock)
    ours = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE, **fields)).eval()
    ours.load_state_dict(stock.state_dict(), strict=True)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids).logits - stock(ids).logits).abs().max().item()


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.parametrize("length", [12, 40])  # within and past max_position_embeddings (dynamic changes past it)
def test_rope_scaling_computes_what_transformers_computes(name, length):
    scaling = SCALINGS[name]
    stock = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters={"rope_theta": 500.0, **scaling}))
    assert logit_gap(stock, dict(rope_theta=500.0, rope_scaling_parameters=scaling), length) < 1e-5
    # the control: plain RoPE on the same weights is another function (dynamic only past the original context)
    if name != "dynamic" or length > SHAPE["max_position_embeddings"]:
        assert logit_gap(stock, dict(rope_theta=500.0), length) > 1e-3


def test_llama_attention_bias_tied_embeddings_and_head_dim_compute_what_transformers_computes():
    stock = LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True, tie_word_embeddings=True, head_dim=8))
    fields = dict(attention_qkv_bias=True, attention_out_bias=True, tie_word_embeddings=True, head_dim=8)
    assert logit_gap(stock, fields, 20) < 1e-5


def test_qwen2_qkv_biases_and_qwen3_qk_norm_compute_what_transformers_computes():
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))
    assert logit_gap(qwen2, dict(attention_qkv_bias=True, tie_word_embeddings=True), 20) < 1e-5
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True))
    assert logit_gap(qwen3, dict(qk_norm=True, head_dim=16, tie_word_embeddings=True), 20) < 1e-5
    # the control: the same weights without the norms (their weights then unused) differ
    fields = dict(head_dim=16, tie_word_embeddings=True)
    ours = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE, **fields))
    state = {k: v for k, v in randomized(qwen3).state_dict().items() if "_norm." not in k or "layernorm" in k}
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 20))
    with torch.no_grad():
        assert (ours.eval()(ids).logits - qwen3(ids).logits).abs().max() > 1e-3


def test_tied_embeddings_share_one_tensor_and_train_as_one():
    model = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert parameter_counts(model.config).total == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 10))
    model(ids, labels=ids).loss.backward()
    assert model.lm_head.weight.grad is model.model.embed_tokens.weight.grad


FEATURES = st.fixed_dictionaries({
    "tie_word_embeddings": st.booleans(), "attention_qkv_bias": st.booleans(), "attention_out_bias": st.booleans(),
    "qk_norm": st.booleans(), "head_dim": st.sampled_from([None, 8, 16]),
    "arch": st.sampled_from(["dense", "moe", "mod", "hybrid"])})


@settings(max_examples=25, deadline=None)
@given(FEATURES)
def test_the_counts_and_flops_follow_the_features(fields):
    config = AdaptiveDSConfig(**SHAPE, **fields)
    model = AdaptiveDSForCausalLM(config)
    assert parameter_counts(config).total == sum(p.numel() for p in model.parameters())
    for i, layer in enumerate(model.model.layers):
        assert block_parameters(config, i).total == sum(p.numel() for p in layer.parameters()), i
    # attention's scores and values span heads x head_dim: a wider head costs more, by hand
    wider = AdaptiveDSConfig(**{**SHAPE, **fields, "head_dim": 32})
    narrow = AdaptiveDSConfig(**{**SHAPE, **fields, "head_dim": 8})
    projections = 2 * 48 * (4 + 2) * (32 - 8)  # q, k, v, o: 2 h (heads + kv heads) x the head_dim difference
    attention = 12 * 4 * (32 - 8) * 64  # 12 x heads x head_dim difference x seq_len
    layers = [i for i in range(2) if not config.is_mod_layer(i)]  # MoD blocks scale theirs by capacity
    if len(layers) == 2:
        gap = training_flops_per_token(wider, 64) - training_flops_per_token(narrow, 64)
        assert gap == pytest.approx(2 * (6 * projections + attention))


def test_features_off_add_no_parameter_and_draw_no_random_number():
    torch.manual_seed(3)
    plain = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE))
    after_plain = torch.rand(1)
    torch.manual_seed(3)
    explicit = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE, head_dim=12, tie_word_embeddings=False,
                                                      attention_qkv_bias=False, qk_norm=False))
    assert torch.rand(1) == after_plain
    assert plain.state_dict().keys() == explicit.state_dict().keys()
    pairs = zip(plain.state_dict().values(), explicit.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("fields, message", [
    ({"rope_scaling_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not one of"),
    ({"rope_scaling_parameters": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor, high_freq_factor"),
    ({"head_dim": 7}, "head_dim must be an even number"),
    ({"sliding_window": 0}, "sliding_window must be >= 1"),
    ({"hidden_size": 50}, "hidden_size 50 is not divisible by num_attention_heads 4"),
])
def test_inconsistent_features_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveDSConfig(**{**SHAPE, **fields})


def test_a_head_dim_of_its_own_frees_hidden_from_the_heads():
    config = AdaptiveDSConfig(**{**SHAPE, "hidden_size": 50, "head_dim": 16})
    model = AdaptiveDSForCausalLM(config)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 50)
    assert model(torch.randint(0, 96, (1, 5))).logits.shape == (1, 5, 96)


def test_a_sequence_longer_than_the_sliding_window_is_refused():
    model = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE, sliding_window=8)).eval()
    model(torch.randint(0, 96, (1, 8)))  # within the window: full causal attention is the window's attention
    with pytest.raises(ValueError, match="9 tokens exceed sliding_window 8"):
        model(torch.randint(0, 96, (1, 9)))
