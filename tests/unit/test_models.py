import pytest
import torch
from helpers.common import tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

from adaptive_ds.models import ARCHITECTURES, AdaptiveDSForCausalLM
from adaptive_ds.models.mod import MixtureOfDepths, routed_token_count
from adaptive_ds.models.modeling import rotary_embedding
from adaptive_ds.training import moe_adapter


def _model(arch, **overrides):
    model = AdaptiveDSForCausalLM(tiny_config(arch, **overrides))
    return model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forward_and_backward_reach_every_parameter(arch):
    model = _model(arch)
    ids = torch.randint(2, 64, (3, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (3, 16, 64)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_skip_logits_gives_the_same_losses_and_gradients_without_the_logits(arch):
    """What the trainer asks for: the same losses and gradients, bit for bit, and no logits; without labels it is
    refused (the logits would be the only output)."""
    ids = torch.randint(2, 64, (3, 16))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored targets
    results = []
    for skip in (False, True):
        torch.manual_seed(3)
        model = _model(arch)
        out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40.0), skip_logits=skip)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (kept, kept_grads), (skipped, skipped_grads) = results
    assert kept.logits.shape == (3, 16, 64) and skipped.logits is None
    assert torch.equal(kept.loss, skipped.loss) and torch.equal(kept.lm_loss, skipped.lm_loss)
    # the summed token losses over 40: by hand, from the kept logits
    log_probs = torch.log_softmax(kept.logits[:, :-1].double(), -1)
    targets = labels[:, 1:]
    by_hand = -sum(log_probs[b, t, targets[b, t]] for b in range(3) for t in range(15) if targets[b, t] != -100) / 40
    assert abs(kept.lm_loss.item() - by_hand.item()) < 1e-5
    assert all(torch.equal(kept_grads[n], skipped_grads[n]) for n in kept_grads)
    with pytest.raises(ValueError, match="skip_logits needs labels"):
        model(input_ids=ids, skip_logits=True)


@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_mod_runs_each_routed_block_on_exactly_capacity_times_seq_len_tokens(arch):
    model = _model(arch, mod_capacity=0.25, num_hidden_layers=4, mod_layer_interval=2)
    seen = []
    for layer in model.model.layers:
        target = layer.block if isinstance(layer, MixtureOfDepths) else layer
        target.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    model(input_ids=torch.randint(2, 64, (3, 32)))
    # every other block routes: full, routed, full, routed
    assert seen == [(3, 32, 32), (3, 8, 32), (3, 32, 32), (3, 8, 32)]
    assert routed_token_count(32, 0.25) == 8


def test_mod_top_k_is_per_sequence_and_skipped_tokens_pass_unchanged():
    model = _model("mod", mod_capacity=0.5)
    block = model.model.layers[0]
    hidden = torch.randn(2, 16, 32)
    cos, sin = rotary_embedding(torch.arange(16)[None], 8, 10000.0, hidden.dtype)
    out = block(hidden, (cos, sin))
    selected = out.mod.selected
    assert selected.shape == (2, 8)
    scores = block.router(hidden).squeeze(-1)
    for b in range(2):  # each sequence gets its own top half, whatever the other sequence scores
        assert set(selected[b].tolist()) == set(scores[b].topk(8).indices.tolist())
        skipped = sorted(set(range(16)) - set(selected[b].tolist()))
        torch.testing.assert_close(out.hidden_states[b, skipped], hidden[b, skipped], rtol=0, atol=0)
        assert not torch.allclose(out.hidden_states[b, selected[b]], hidden[b, selected[b]])


def test_mod_routed_tokens_keep_their_original_rope_positions():
    model = _model("mod", mod_capacity=0.5)
    block = model.model.layers[0]
    captured = {}
    block.block.self_attn.register_forward_hook(lambda m, args, out: captured.update(rope=args[1]))
    hidden = torch.randn(1, 16, 32)
    positions = torch.arange(16)[None]
    out = block(hidden, rotary_embedding(positions, 8, 10000.0, hidden.dtype))
    expected = rotary_embedding(out.mod.selected, 8, 10000.0, hidden.dtype)
    torch.testing.assert_close(captured["rope"][0], expected[0])
    torch.testing.assert_close(captured["rope"][1], expected[1])


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_moe_aux_loss_enters_the_loss_exactly_once(arch):
    ids = torch.randint(2, 64, (2, 16))
    torch.manual_seed(1)
    with_coef = _model(arch, router_aux_loss_coef=0.5, router_z_loss_coef=0.0, mod_predictor_loss_coef=0.0)
    torch.manual_seed(1)
    without = _model(arch, router_aux_loss_coef=0.0, router_z_loss_coef=0.0, mod_predictor_loss_coef=0.0)
    a, b = with_coef(input_ids=ids, labels=ids), without(input_ids=ids, labels=ids)
    torch.testing.assert_close(a.lm_loss, b.lm_loss)
    assert a.aux_loss > 0
    torch.testing.assert_close(a.loss, a.lm_loss + 0.5 * a.aux_loss)
    torch.testing.assert_close(b.loss, b.lm_loss)
    torch.manual_seed(1)
    all_terms = _model(arch, router_aux_loss_coef=0.5, router_z_loss_coef=0.01, mod_predictor_loss_coef=2.0)
    c = all_terms(input_ids=ids, labels=ids)
    expected = c.lm_loss + 0.5 * c.aux_loss + 0.01 * c.z_loss
    if arch == "hybrid":
        expected = expected + 2.0 * c.mod_predictor_loss
    torch.testing.assert_close(c.loss, expected)
    # and its gradient reaches the router with the coefficient applied once
    a.loss.backward()
    b.loss.backward()
    router = next(n for n, _ in with_coef.named_parameters() if "gate.wg" in n)
    g_a = dict(with_coef.named_parameters())[router].grad
    g_b = dict(without.named_parameters())[router].grad
    torch.manual_seed(1)
    aux_only = _model(arch, router_aux_loss_coef=0.5, router_z_loss_coef=0.0, mod_predictor_loss_coef=0.0)
    aux_only(input_ids=ids, labels=ids).aux_loss.backward()
    g_aux = dict(aux_only.named_parameters())[router].grad
    torch.testing.assert_close(g_a, g_b + 0.5 * g_aux)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_and_load_round_trip_gives_identical_logits(arch, tmp_path):
    model = _model(arch).eval()
    ids = torch.randint(2, 64, (2, 12))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).arch == arch
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is AdaptiveDSForCausalLM
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_runs_and_is_deterministic(arch):
    model = _model(arch).eval()
    prompt = torch.randint(2, 64, (2, 5))
    first = model.generate(prompt, max_new_tokens=6, do_sample=False)
    second = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert first.shape[1] > 5
    assert torch.equal(first, second)
    assert torch.equal(first[:, :5], prompt)


def _causal_mod_model(arch):
    """A MoD model in eval mode whose router routes some tokens and skips others."""
    model = _model(arch, mod_layer_interval=1).eval()
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.router.weight, std=1.0)
    return model


@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_causal_mod_routing_ignores_later_tokens(arch):
    model = _causal_mod_model(arch)
    ids = torch.randint(2, 64, (2, 20))
    changed = ids.clone()
    # the token the first block's router scores highest: top-k routing takes it and drops an earlier token
    changed[:, 12:] = model.model.layers[0].router(model.model.embed_tokens.weight[2:]).argmax() + 2
    a, b = model(input_ids=ids), model(input_ids=changed)
    routed = torch.stack([r.routed for r in a.mod_routing])
    assert routed.any() and not routed.all()  # the check is not vacuous
    torch.testing.assert_close(a.logits[:, :12], b.logits[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a.logits[:, 12:], b.logits[:, 12:])
    # the train-time rule does look ahead: that is why evaluation does not use it
    model.model.set_mod_routing("topk")
    c, d = model(input_ids=ids), model(input_ids=changed)
    assert not torch.allclose(c.logits[:, :12], d.logits[:, :12])


@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_causal_mod_sequence_alone_equals_it_inside_a_padded_batch(arch):
    model = _causal_mod_model(arch)
    ids = torch.randint(2, 64, (1, 10))
    other = torch.randint(2, 64, (1, 14))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], 1), other])
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :4] = 0
    alone = model(input_ids=ids).logits
    in_batch = model(input_ids=batch, attention_mask=mask).logits[:1, 4:]
    torch.testing.assert_close(in_batch, alone, rtol=1e-5, atol=1e-5)


def test_mod_predictor_trains_on_detached_inputs_only():
    ids = torch.randint(2, 64, (2, 16))
    grads = []
    for coef in (0.0, 5.0):
        torch.manual_seed(3)
        model = _model("mod", mod_causal_routing="predictor", mod_predictor_loss_coef=coef)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        if "predictor" in name:
            assert g is None or not g.any()
            assert grads[1][name].abs().sum() > 0
        else:
            torch.testing.assert_close(grads[1][name], g)  # the LM does not feel the predictor's loss


@pytest.mark.parametrize("arch", ["mod", "hybrid"])
def test_mod_generate_with_kv_cache_equals_generate_without(arch):
    model = _causal_mod_model(arch)
    prompt = torch.randint(2, 64, (2, 5))
    cached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True, min_new_tokens=10)
    uncached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False, min_new_tokens=10)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_generate_with_kv_cache_equals_generate_without(arch):
    model = _model(arch).eval()
    prompt = torch.randint(2, 64, (2, 5))
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, min_new_tokens=8)
    uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, min_new_tokens=8)
    assert torch.equal(cached, uncached)


def test_left_padding_gives_the_same_logits_as_the_unpadded_sequence():
    model = _model("dense").eval()
    ids = torch.randint(2, 64, (1, 10))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], dim=1).long()
    alone = model(input_ids=ids).logits
    in_batch = model(input_ids=padded, attention_mask=mask).logits[:, 3:]
    torch.testing.assert_close(in_batch, alone, rtol=1e-5, atol=1e-5)


def test_bad_config_names_the_valid_choices(tiny_config):
    with pytest.raises(ValueError, match="dense, moe, mod, hybrid"):
        tiny_config("sparse")


def _capacity_limited(arch, dispatch):
    """A moe / hybrid model with a training-time capacity limit that really drops tokens (asserted), in eval; with
    `dispatch` "deepspeed", in DeepSpeed's MoE layer.

    8 experts, top-2 as in the debug preset; capacity factor 0.5 in training. The eval factor is small too, so
    a model that kept a capacity limit in eval would drop there as well. Routers with large weights route
    unevenly, and (hybrid) the MoD router routes some tokens and skips others.
    """
    model = _model(arch, num_local_experts=8, moe_drop_tokens=True, moe_capacity_factor=0.5,
                   moe_min_capacity=1, moe_dispatch=dispatch, mod_layer_interval=1)
    if dispatch == "deepspeed":  # its stock layer, as the trainer swaps it in
        moe_adapter.prepare(model)
    for name, param in model.named_parameters():
        if "gate.wg" in name or name.endswith("router.weight"):
            torch.nn.init.normal_(param, std=1.0)
    out = model(input_ids=torch.randint(2, 64, (2, 24)))
    assert sum(int(d) for d in out.expert_dropped) > 0  # training mode drops: the limit is real
    return model.eval()


@pytest.mark.parametrize("dispatch", ["indexed", "deepspeed"])
@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_capacity_limited_moe_is_causal_and_dropless_in_eval(arch, dispatch):
    model = _capacity_limited(arch, dispatch)
    ids = torch.randint(2, 64, (3, 24))
    changed = ids.clone()
    changed[:, 12:] = torch.randint(2, 64, (3, 12))
    with torch.no_grad():
        a, b = model(input_ids=ids), model(input_ids=changed)
    torch.testing.assert_close(a.logits[:, :12], b.logits[:, :12], rtol=0, atol=1e-5)
    assert not torch.allclose(a.logits[:, 12:], b.logits[:, 12:])
    assert all(int(d) == 0 for d in a.expert_dropped + b.expert_dropped)


@pytest.mark.parametrize("dispatch", ["indexed", "deepspeed"])
@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_capacity_limited_moe_sequence_alone_equals_it_in_a_batch(arch, dispatch):
    model = _capacity_limited(arch, dispatch)
    ids = torch.randint(2, 64, (1, 16))
    others = torch.randint(2, 64, (3, 16))
    with torch.no_grad():
        alone = model(input_ids=ids).logits
        last = model(input_ids=torch.cat([others, ids])).logits[3:]  # its tokens come after the others'
        first = model(input_ids=torch.cat([ids, others])).logits[:1]
    torch.testing.assert_close(last, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(first, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dispatch", ["indexed", "deepspeed"])
@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_capacity_limited_moe_cached_generation_equals_the_full_forward(arch, dispatch):
    model = _capacity_limited(arch, dispatch)
    prompt = torch.randint(2, 64, (3, 6))
    steps = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    cached = model.generate(prompt, use_cache=True, output_logits=True, return_dict_in_generate=True, **steps)
    uncached = model.generate(prompt, use_cache=False, **steps)
    assert torch.equal(cached.sequences, uncached)
    with torch.no_grad():
        full = model(input_ids=cached.sequences).logits  # (batch, 16, vocab)
    step_logits = torch.stack(cached.logits, dim=1)  # (batch, 10, vocab): positions 5..14
    torch.testing.assert_close(step_logits, full[:, 5:15], rtol=0, atol=1e-5)
