"""Mixture-of-Depths causal routing that skips compute, its two causal-routing modes, and its FLOPs accounting.

The reference for real skipping is the masked implementation it replaced (`masked_causal` below): every token
runs the block and the skipped tokens are masked out of its attention keys and keep their input.
"""

import json

import pytest
import torch
from helpers.common import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from adaptive_ds.flops import training_flops_per_token
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.mod import AdaptiveDSCache, MixtureOfDepths, MoDRouting
from adaptive_ds.presets import VARIANTS, model_config

MODES = ("router", "predictor")


def masked_causal(layer, hidden_states, scores, position_embeddings, key_padding_mask, cache):
    """The block on every token, skipped tokens hidden from its attention keys and given back their input."""
    assert cache is None
    seq_len = hidden_states.shape[1]
    routed = layer.causal_logits(hidden_states, scores) > 0
    if key_padding_mask is not None:
        routed = routed & key_padding_mask[:, -seq_len:]
    out = layer.block(hidden_states, position_embeddings, routed, None)
    weight = torch.sigmoid(scores).unsqueeze(-1) * routed.unsqueeze(-1)
    return out._replace(hidden_states=hidden_states + (out.hidden_states - hidden_states) * weight,
                        mod=MoDRouting(None, routed))


def mod_layers(model):
    return [layer for layer in model.model.layers if isinstance(layer, MixtureOfDepths)]


def causal_model(arch, mode, **overrides):
    """A MoD model in eval mode whose causal decision routes some tokens and skips others, with logits far
    enough from 0 that float noise cannot flip a decision."""
    model = AdaptiveDSForCausalLM(tiny_config(arch, mod_causal_routing=mode, **overrides)).eval()
    for layer in mod_layers(model):
        decision = layer.router if mode == "router" else layer.predictor[2]
        torch.nn.init.normal_(decision.weight, std=1.0)
    return model


def padded_batch():
    """Three sequences, the first two left-padded: (input_ids, attention_mask, lengths)."""
    lengths = [7, 11, 14]
    ids = torch.randint(2, 64, (3, 14))
    mask = torch.zeros(3, 14, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :14 - n] = 0
        mask[b, 14 - n:] = 1
    return ids, mask, lengths


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_skipping_equals_the_masked_reference_in_a_padded_batch(arch, mode, monkeypatch):
    model = causal_model(arch, mode, num_hidden_layers=3)
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        skipping = model(input_ids=ids, attention_mask=mask, use_cache=False)
        for layer in mod_layers(model):
            monkeypatch.setattr(layer, "_causal", masked_causal.__get__(layer))
        reference = model(input_ids=ids, attention_mask=mask, use_cache=False)
    routed = torch.stack([r.routed for r in skipping.mod_routing])  # (blocks, batch, seq)
    counts = routed.sum(-1)
    assert (counts != counts[:, :1]).any()  # sequences route different numbers: padding slots are exercised
    assert torch.equal(routed, torch.stack([r.routed for r in reference.mod_routing]))
    real = mask.bool()
    torch.testing.assert_close(skipping.logits[real], reference.logits[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_the_block_runs_on_the_routed_tokens_only_and_caches_only_them(mode):
    model = causal_model("mod", mode, num_hidden_layers=2)
    widths = {i: [] for i in range(2)}
    for i, layer in enumerate(mod_layers(model)):
        layer.block.register_forward_hook(lambda m, args, out, i=i: widths[i].append(args[0].shape[1]))
    prompt = torch.randint(2, 64, (1, 12))
    out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         return_dict_in_generate=True)
    generated = {i: list(w) for i, w in widths.items()}  # before the reference forward below adds its own
    with torch.no_grad():
        routed = [r.routed[0] for r in model(input_ids=out.sequences[:, :-1], use_cache=False).mod_routing]
    for i, r in enumerate(routed):  # (23,) decisions of block i: 12 prompt tokens, then 11 decoded
        assert 0 < int(r.sum()) < len(r)
        # prefill runs the block on the routed prompt tokens; a decoded token runs it only if routed
        assert generated[i] == [int(r[:12].sum())] * bool(r[:12].any()) + [1] * int(r[12:].sum())
        assert out.cache.layers[i].keys.shape[2] == int(r.sum())  # no slot for a skipped token
        assert out.cache.slots[i].all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("arch", "top_k", "interval"), [("mod", 2, 1), ("hybrid", 2, 1), ("hybrid", 1, 1),
                                                         ("mod", 2, 2), ("hybrid", 1, 2)])  # the shipped defaults
def test_cached_generation_of_a_padded_batch_equals_the_full_forward_and_each_sequence_alone(arch, top_k, interval,
                                                                                              mode):
    model = causal_model(arch, mode, num_experts_per_tok=top_k, mod_layer_interval=interval, mod_capacity=0.125)
    prompts, mask, lengths = padded_batch()
    steps = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                 return_dict_in_generate=True)
    cached = model.generate(prompts, attention_mask=mask, use_cache=True, **steps)
    uncached = model.generate(prompts, attention_mask=mask, use_cache=False, **steps)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert not all(s.all() for s in cached.cache.slots.values())  # batch-mates routed differently: padded slots
    step_logits = torch.stack(cached.logits, dim=1)  # (batch, 8, vocab)
    full_mask = torch.cat([mask, torch.ones(3, 8, dtype=torch.long)], dim=1)
    with torch.no_grad():
        full = model(input_ids=cached.sequences, attention_mask=full_mask, use_cache=False).logits
    torch.testing.assert_close(step_logits, full[:, 13:21], rtol=0, atol=1e-5)
    for b, n in enumerate(lengths):  # a sequence generates the same alone as beside its batch-mates
        alone = model.generate(prompts[b:b + 1, 14 - n:], use_cache=True, **steps)
        assert torch.equal(alone.sequences, cached.sequences[b:b + 1, 14 - n:])
        torch.testing.assert_close(torch.stack(alone.logits, 1), step_logits[b:b + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_causal_routing_with_every_other_block_routed_ignores_later_tokens(mode):
    model = causal_model("mod", mode, num_hidden_layers=4, mod_layer_interval=2)
    ids = torch.randint(2, 64, (2, 20))
    changed = ids.clone()
    changed[:, 12:] = torch.randint(2, 64, (2, 8))
    with torch.no_grad():
        a, b = model(input_ids=ids), model(input_ids=changed)
    assert len(a.mod_routing) == 2
    torch.testing.assert_close(a.logits[:, :12], b.logits[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a.logits[:, 12:], b.logits[:, 12:])


def _decisions(model, mode, ids):
    """Each MoD block's routed tokens in a forward, and the logits of its causal decision (the router's, or the
    predictor's last layer's), caught at the module that computes them."""
    logits = []
    hooks = [(layer.router if mode == "router" else layer.predictor).register_forward_hook(
        lambda m, args, out: logits.append(out.squeeze(-1))) for layer in mod_layers(model)]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([r.routed for r in out.mod_routing]), logits, out.logits


@pytest.fixture(scope="module", params=[(arch, mode) for arch in ("mod", "hybrid") for mode in MODES],
                ids=lambda p: "-".join(p))
def routed_models(request):
    """A MoD or hybrid model, its causal-routing mode, and input ids: built once, its capacity set by each case."""
    arch, mode = request.param
    torch.manual_seed(0)
    return causal_model(arch, mode, num_hidden_layers=3), mode, torch.randint(2, 64, (2, 16))


@settings(max_examples=12, deadline=None)
@given(capacity=st.floats(0.01, 0.999))
def test_below_capacity_one_causal_routing_routes_by_the_sign_of_its_decision(routed_models, capacity):
    """No capacity below 1.0: whatever the blocks' capacity, a token runs a block exactly when the decision's logit
    is > 0, some run and some skip (the figures published at capacities below 1.0 are this routing's)."""
    model, mode, ids = routed_models
    model.model.set_mod_capacity(capacity)
    routed, logits, _ = _decisions(model, mode, ids)
    assert torch.equal(routed, torch.stack(logits) > 0)
    assert 0 < routed.float().mean() < 1


def test_at_capacity_one_causal_routing_is_the_top_k_every_token(routed_models):
    """Top-k at capacity 1.0 takes every token, which needs no look-ahead: causal routing takes them all too, and
    computes the train-time routing's logits (here with the sigmoid scale: not the plain block)."""
    model, mode, ids = routed_models
    model.model.set_mod_capacity(0.5)
    assert not _decisions(model, mode, ids)[0].all()  # the decision alone skips some
    model.model.set_mod_capacity(1.0)
    try:
        routed, _, causal = _decisions(model, mode, ids)
        assert routed.all()
        model.model.set_mod_routing("topk")
        with torch.no_grad():
            topk = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(causal, topk, rtol=0, atol=1e-5)
        model.model.set_mod_routing("causal")
        generated = model.generate(ids[:1, :6], max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                   return_dict_in_generate=True)
        assert all(s.all() for s in generated.cache.slots.values())  # cached decoding routes every token too
    finally:
        model.model.set_mod_routing("causal")


def test_a_step_that_skips_every_block_leaves_their_caches_alone():
    model = causal_model("mod", "router")
    for layer in mod_layers(model):
        torch.nn.init.zeros_(layer.router.weight)  # every logit is 0: nothing routes
    cache = AdaptiveDSCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=torch.randint(2, 64, (2, 6)), cache=cache)
        out = model(input_ids=torch.randint(2, 64, (2, 1)), cache=cache)
    assert not any(r.routed.any() for r in out.mod_routing)
    assert cache.get_seq_length() == 7 and cache.slots == {}
    assert all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_beam_search_with_the_cache_equals_beam_search_without():
    model = causal_model("mod", "router")
    prompt = torch.randint(2, 64, (2, 5))
    steps = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=3)
    cached, uncached = model.generate(prompt, use_cache=True, **steps), model.generate(prompt, use_cache=False, **steps)
    assert torch.equal(cached, uncached)


def test_router_mode_trains_the_router_toward_top_k_through_the_lm_and_has_no_predictor(tiny_config):
    ids = torch.randint(2, 64, (2, 16))
    grads = []
    for coef in (0.0, 5.0):
        torch.manual_seed(3)
        model = AdaptiveDSForCausalLM(tiny_config("mod", mod_causal_routing="router", mod_predictor_loss_coef=coef))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert not any("predictor" in name for name in grads[0])
    # the BCE is on the router's own logits toward its top-k choice
    routing = out.mod_routing[0]
    scores = model.model.layers[0].router(model.model.embed_tokens(ids)).squeeze(-1)
    in_topk = torch.zeros_like(scores).scatter_(1, scores.topk(8, dim=1).indices, 1.0)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(scores, in_topk)
    torch.testing.assert_close(routing.predictor_loss, expected)
    # not detached: its gradient reaches the router and the blocks below (here the embeddings)
    for name in ("model.layers.0.router.weight", "model.embed_tokens.weight"):
        assert not torch.allclose(grads[0][name], grads[1][name])


def test_an_unknown_causal_routing_names_the_choices(tiny_config):
    with pytest.raises(ValueError, match="mod_causal_routing must be one of router, predictor"):
        tiny_config("mod", mod_causal_routing="oracle")


@pytest.mark.parametrize(("overrides", "routed_blocks", "tokens"), [
    ({}, [False, True, False, True], 32),  # mod's default: the paper's setting, 12.5% of 256 in every other block
    (VARIANTS["mod:paper"].model, [False, True, False, True], 32),
    (VARIANTS["mod:half"].model, [True] * 4, 128),  # the default before: half of 256 in every block
], ids=["default", "mod:paper", "mod:half"])
def test_the_debug_mod_model_routes_what_its_setting_says(overrides, routed_blocks, tokens):
    model = AdaptiveDSForCausalLM(model_config("debug", "mod", 128, **overrides))
    assert [isinstance(layer, MixtureOfDepths) for layer in model.model.layers] == routed_blocks
    seen = []
    for layer in mod_layers(model):
        layer.block.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    model(input_ids=torch.randint(0, 128, (1, 256)))
    assert seen == [tokens] * sum(routed_blocks)


def test_flops_of_the_paper_variant_by_hand(tiny_config):
    # h 32, ffn 64, 4 heads of 8 with 2 KV heads, vocab 64, 4 layers, MoD on layers 1 and 3 at 1/8, seq 64
    config = tiny_config("mod", num_hidden_layers=4, **VARIANTS["mod:paper"].model)
    attention = 2 * 32 * 32 + 2 * 32 * 16  # q, o; k, v
    mlp = 3 * 32 * 64
    full_block = 6 * (attention + mlp) + 12 * 32 * 64  # 79_872
    routed_block = 6 * (attention + mlp) / 8 + 12 * 32 * 64 / 64 + 6 * 32  # 7_488: 1/8 of the matmuls, router
    lm_head = 6 * 64 * 32
    assert training_flops_per_token(config, 64) == lm_head + 2 * full_block + 2 * routed_block == 187_008


@pytest.mark.parametrize("overrides", [dict(mod_causal_routing="router", **VARIANTS["mod:paper"].model),
                                       dict(mod_causal_routing="predictor", mod_capacity=0.5)],
                         ids=["router-paper", "predictor-half"])
@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_flops_match_the_matmuls_torch_counts_in_a_training_step(arch, overrides, tiny_config):
    """torch's FlopCounterMode counts every matmul of forward and backward; it does not see CPU attention
    kernels, so attention is added by hand: 12 h s per token for a full block, 12 h s r^2 for a routed one."""
    config = tiny_config(arch, num_hidden_layers=4, **overrides)
    model = AdaptiveDSForCausalLM(config)
    batch, seq = 2, 64
    ids = torch.randint(2, 64, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    r = config.mod_capacity
    attention = sum(12 * 32 * seq * (r * r if config.is_mod_layer(i) else 1) for i in range(4))
    measured = counter.get_total_flops() / (batch * seq) + attention
    assert measured == pytest.approx(training_flops_per_token(config, seq), rel=1e-9)


def test_a_saved_model_from_before_the_router_option_keeps_its_predictor(tmp_path, tiny_config):
    model = AdaptiveDSForCausalLM(tiny_config("mod", mod_causal_routing="predictor")).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["mod_causal_routing"], config["config_version"]  # as written before the option existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AdaptiveDSForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mod_causal_routing == "predictor"
    ids = torch.randint(2, 64, (2, 12))
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    new = AdaptiveDSForCausalLM(tiny_config("mod"))
    new.save_pretrained(tmp_path / "new")
    assert AdaptiveDSForCausalLM.from_pretrained(tmp_path / "new").config.mod_causal_routing == "router"


def test_a_saved_mod_model_without_the_capacity_fields_loads_as_capacity_half_in_every_block(tmp_path, tiny_config):
    # mod's default until the paper's setting replaced it (presets.py VARIANTS); a config.json written
    # without the two fields means that model
    model = AdaptiveDSForCausalLM(tiny_config("mod", mod_capacity=0.5, mod_layer_interval=1)).eval()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["mod_capacity"], config["mod_layer_interval"], config["config_version"]  # as written then
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AdaptiveDSForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.mod_capacity, loaded.config.mod_layer_interval) == (0.5, 1) and len(mod_layers(loaded)) == 2
    ids = torch.randint(2, 64, (2, 12))
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
