"""The DeepSeekMoE options (fine-grained and shared experts), auxiliary-loss-free bias balancing and dropless
training, against naive references, hand-worked cases and DeepSpeed's stock gating."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.common import tiny_config
from transformers import AutoModelForCausalLM

from adaptive_ds.flops import training_flops_per_token
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.families.mixtral import mixtral_incompatibility, to_mixtral
from adaptive_ds.models.moe import MoEFeedForward, route, update_routing_bias
from adaptive_ds.presets import block_parameters, parameter_counts
from adaptive_ds.training import moe_adapter
from adaptive_ds.training.controller import Controller, ControllerSettings, Knobs, WindowReport

FINE = dict(moe_expert_granularity=2, moe_shared_experts=1)  # 4 x 2 = 8 experts of width 32, top-4, shared 32


def _layer(stock: bool = False, **overrides):
    """A layer whose experts differ (they are built as copies of one module), so outputs show routing; `stock`: in
    DeepSpeed's MoE layer, as the trainer runs it."""
    config = tiny_config("moe", **overrides)
    layer = MoEFeedForward(config)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.2)
    torch.nn.init.normal_(layer.moe.deepspeed_moe.gate.wg.weight, std=0.5)
    if stock:
        moe_adapter.to_deepspeed(layer, config)
    return layer


def _swiglu_by_hand(mlp, x):
    """down(silu(gate x) * up x) from the module's weight matrices."""
    return (F.silu(x @ mlp.gate_proj.weight.t()) * (x @ mlp.up_proj.weight.t())) @ mlp.down_proj.weight.t()


def naive_fine_grained(layer: MoEFeedForward, x: torch.Tensor, k: int, bias=None) -> torch.Tensor:
    """Reference: one token at a time, its top-k experts picked by hand from the (biased) gate probabilities,
    their SwiGLUs weighted by the unbiased probabilities renormalised over the k, plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = (tokens.float() @ layer.moe.deepspeed_moe.gate.wg.weight.float().t()).softmax(-1)
    experts = layer.moe.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for t in range(tokens.shape[0]):
        scores = [float(probs[t, e].detach()) + (float(bias[e]) if bias is not None else 0.0)
                  for e in range(len(experts))]
        chosen = sorted(range(len(experts)), key=lambda e: -scores[e])[:k]
        total = sum(probs[t, e] for e in chosen)
        row = sum(probs[t, e] / total * _swiglu_by_hand(experts[e], tokens[t]) for e in chosen)
        if layer.shared_experts is not None:
            row = row + _swiglu_by_hand(layer.shared_experts, tokens[t])
        rows.append(row)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("grouped", ["always", "never"])
@pytest.mark.parametrize("training", [True, False])
def test_fine_grained_and_shared_experts_equal_a_naive_per_token_loop(grouped, training):
    layer = _layer(**FINE, moe_grouped_gemm=grouped).train(training)
    experts = layer.moe.deepspeed_moe.experts.deepspeed_experts
    assert len(experts) == 8 and experts[0].gate_proj.weight.shape == (32, 32)  # ffn 64 / 2
    assert layer.shared_experts.gate_proj.weight.shape == (32, 32)  # one shared expert of the same width
    x = torch.randn(2, 9, 32, requires_grad=True)
    out, routing = layer(x)
    ref = naive_fine_grained(layer, x, k=4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), params, allow_unused=True)
    for g, r in zip(grads, ref_grads, strict=True):
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert int(routing.expert_counts.sum()) == 18 * 4 and int(routing.dropped) == 0


def test_top_k_beyond_two_equals_deepspeeds_stock_top_k_gating_when_dropless():
    # DeepSpeed's topkgating (k > 2), dropless: same outputs, expert counts and aux loss (E / k * sum me * ce,
    # DeepSeekMoE's expert-level balance loss) as the indexed path.
    layer = _layer(stock=True, moe_expert_granularity=2, moe_drop_tokens=False)
    x = torch.randn(2, 12, 32)
    ours, routing = layer(x)
    layer.moe.deepspeed_moe.gate.drop_tokens = False
    stock, aux_loss, counts = layer.moe(x)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routing.aux_loss, aux_loss)
    assert torch.equal(routing.expert_counts, counts)


def _weights(kept) -> dict[tuple[int, int], float]:
    """{(token, expert): gate weight} of the kept assignments (sorted by expert)."""
    experts = torch.repeat_interleave(torch.arange(len(kept.counts)), kept.counts).tolist()
    return dict(zip(zip(kept.token.tolist(), experts, strict=True), kept.weight.tolist(), strict=True))


def test_the_bias_changes_which_experts_are_chosen_but_not_their_gate_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.5, 1.0]])
    probs = logits.softmax(-1)
    # probabilities [0.665, 0.245, 0.090] and [0.186, 0.307, 0.507]: token 0's expert 0 falls to 0.065, below both
    bias = torch.tensor([-0.6, 0.0, 0.0])
    assert sorted(_weights(route(logits, k=1, capacity=None)[0])) == [(0, 0), (1, 2)]
    kept, demand, _ = route(logits, k=1, capacity=None, bias=bias)
    weights = _weights(kept)
    assert sorted(weights) == [(0, 1), (1, 2)] and demand.tolist() == [0, 1, 1]
    assert weights[(0, 1)] == pytest.approx(float(probs[0, 1]))  # the unbiased probability, as top-1 uses it
    # top-2: token 0 takes experts 1 and 2, weighted by their unbiased probabilities renormalised over the two
    weights = _weights(route(logits, k=2, capacity=None, bias=bias)[0])
    p1, p2 = float(probs[0, 1]), float(probs[0, 2])
    assert weights[(0, 1)] == pytest.approx(p1 / (p1 + p2)) and weights[(0, 2)] == pytest.approx(p2 / (p1 + p2))
    assert (0, 0) not in weights


def test_a_biased_layer_equals_the_naive_loop_with_the_same_bias():
    layer = _layer(**FINE, moe_balancing="bias", moe_bias_update_rate=0.05)
    layer.routing_bias_steps.copy_(torch.tensor([3, -2, 0, 1, -4, 2, 0, -1]))
    x = torch.randn(3, 7, 32)
    bias = 0.05 * torch.tensor([3.0, -2, 0, 1, -4, 2, 0, -1])
    torch.testing.assert_close(layer(x)[0], naive_fine_grained(layer, x, k=4, bias=bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x)[0], naive_fine_grained(layer, x, k=4), atol=1e-4)  # the bias matters


def test_bias_updates_match_a_hand_computed_rule_and_move_a_skewed_router_toward_balance():
    torch.manual_seed(1)
    layer = _layer(num_experts_per_tok=1, moe_balancing="bias", moe_bias_update_rate=0.02)
    direction = torch.randn(32)
    direction /= direction.norm()
    with torch.no_grad():  # skew: expert 0's gate row points along a direction every token shares
        layer.moe.deepspeed_moe.gate.wg.weight.normal_(std=0.3)
        layer.moe.deepspeed_moe.gate.wg.weight[0] = direction
    x = torch.randn(4, 32, 32) + 2 * direction
    gate_before = layer.moe.deepspeed_moe.gate.wg.weight.clone()
    expected = [0, 0, 0, 0]
    loads = []
    for _ in range(30):
        _, first = layer(x[:2])
        _, second = layer(x[2:])  # two micro-batches of one step
        load = (first.expert_counts + second.expert_counts).tolist()
        loads.append(load)
        mean = sum(load) / 4
        expected = [b + (1 if mean > n else -1 if mean < n else 0) for b, n in zip(expected, load, strict=True)]
        update_routing_bias(layer, [(first.expert_counts,), (second.expert_counts,)])
        assert layer.routing_bias_steps.tolist() == expected
    assert max(loads[0]) > 80  # of 128 tokens, an even share being 32
    assert max(max(load) for load in loads[-5:]) <= 40
    assert torch.equal(layer.moe.deepspeed_moe.gate.wg.weight, gate_before)  # only the bias moved


def test_the_bias_is_a_persistent_buffer_saved_and_loaded_with_the_model(tmp_path, tiny_config):
    model = AdaptiveDSForCausalLM(tiny_config("moe", **FINE, moe_balancing="bias")).eval()
    assert not any("routing_bias" in name for name, _ in model.named_parameters())
    for layer in model.model.layers:
        layer.mlp.routing_bias_steps.copy_(torch.randint(-20, 20, (8,)))
    state = model.state_dict()
    keys = [k for k in state if k.endswith("mlp.routing_bias_steps")]
    assert len(keys) == 2
    fresh = AdaptiveDSForCausalLM(tiny_config("moe", **FINE, moe_balancing="bias"))
    fresh.load_state_dict(state, strict=True)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(2, 64, (2, 10))
    for other in (fresh.eval(), loaded):
        for key in keys:
            assert torch.equal(other.state_dict()[key], state[key])
        # to rounding: with several threads, from_pretrained's copy can round one logit differently in the last bit
        torch.testing.assert_close(other(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dispatch,options", [("indexed", FINE), ("deepspeed", dict(moe_expert_granularity=2,
                                                                                   num_experts_per_tok=1)),
                                              ("deepspeed", {})])
def test_dropless_training_drops_nothing_where_capacity_mode_drops(dispatch, options):
    stock = dispatch == "deepspeed"
    capped = _layer(stock, **options, moe_dispatch=dispatch, moe_drop_tokens=True, moe_capacity_factor=0.5,
                    moe_min_capacity=1)
    x = torch.randn(2, 16, 32)
    capped_out, capped_routing = capped(x)
    assert int(capped_routing.dropped) > 0
    dropless = _layer(stock, **options, moe_dispatch=dispatch, moe_drop_tokens=False)
    dropless.load_state_dict(capped.state_dict())
    out, routing = dropless(x)
    assert dropless.training and int(routing.dropped) == 0
    k = dropless.router.k
    torch.testing.assert_close(out, naive_fine_grained(dropless, x, k=k), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(capped_out, out, atol=1e-4)


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_counted_parameters_and_flops_equal_the_built_modules(arch, tiny_config):
    config = tiny_config(arch, **FINE, moe_use_residual=True, moe_balancing="bias", num_hidden_layers=4,
                         moe_layer_interval=2, mod_layer_interval=2)
    model = AdaptiveDSForCausalLM(config)
    assert parameter_counts(config).total == sum(p.numel() for p in model.parameters())
    flops = 6.0 * config.vocab_size * config.hidden_size
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "block", layer)
        assert block_parameters(config, i).total == sum(p.numel() for p in layer.parameters()), i
        mlp = block.mlp
        if isinstance(mlp, MoEFeedForward):  # one token: router, 4 of the 8 experts, shared, PR-MoE residual
            one_expert = sum(p.numel() for p in mlp.moe.deepspeed_moe.experts.deepspeed_experts[0].parameters())
            everyone = sum(p.numel() for p in mlp.parameters()) - 8 * one_expert
            active_mlp = everyone + 4 * one_expert
        else:
            active_mlp = sum(p.numel() for p in mlp.parameters())
        assert block_parameters(config, i).mlp_active == active_mlp, i
        if arch == "moe":
            matmuls = sum(p.numel() for p in block.self_attn.parameters()) + active_mlp
            flops += 6.0 * matmuls + 12 * config.hidden_size * 64
    if arch == "moe":
        assert training_flops_per_token(config, 64) == flops


def _options():
    biased = dict(**FINE, moe_balancing="bias")
    return [("moe", biased), ("hybrid", biased), ("moe", dict(**FINE, moe_drop_tokens=True, moe_capacity_factor=0.5,
                                                             moe_min_capacity=1))]


@pytest.mark.parametrize("arch,options", _options())
def test_cached_generation_equals_the_full_forward_for_every_option(arch, options, tiny_config):
    model = AdaptiveDSForCausalLM(tiny_config(arch, **options))
    for name, param in model.named_parameters():
        if "gate.wg" in name:
            torch.nn.init.normal_(param, std=1.0)
    for module in model.modules():
        if isinstance(module, MoEFeedForward) and module.bias_update_rate is not None:
            module.routing_bias_steps.copy_(torch.randint(-100, 100, (8,)))  # a bias of up to +-0.1
    model.eval()
    prompt = torch.randint(2, 64, (2, 5))
    steps = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    cached = model.generate(prompt, use_cache=True, output_logits=True, return_dict_in_generate=True, **steps)
    assert torch.equal(cached.sequences, model.generate(prompt, use_cache=False, **steps))
    with torch.no_grad():
        full = model(input_ids=cached.sequences).logits  # (batch, 11, vocab)
    torch.testing.assert_close(torch.stack(cached.logits, dim=1), full[:, 4:10], rtol=0, atol=1e-5)


def test_with_bias_balancing_the_aux_loss_is_reported_but_not_trained_on(tiny_config):
    ids = torch.randint(2, 64, (2, 12))
    torch.manual_seed(0)
    biased = AdaptiveDSForCausalLM(tiny_config("moe", **FINE, moe_balancing="bias", router_aux_loss_coef=0.5))
    out = biased(input_ids=ids, labels=ids)
    assert out.aux_loss > 0
    torch.testing.assert_close(out.loss, out.lm_loss + 0.001 * out.z_loss)
    torch.manual_seed(0)
    plain = AdaptiveDSForCausalLM(tiny_config("moe", **FINE, router_aux_loss_coef=0.5))
    out = plain(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, out.lm_loss + 0.5 * out.aux_loss + 0.001 * out.z_loss)


def test_bad_moe_options_are_all_named_at_once(tiny_config):
    with pytest.raises(ValueError) as error:
        tiny_config("moe", moe_expert_granularity=3, moe_dispatch="deepspeed", moe_balancing="bias",
                    moe_shared_experts=-1)
    message = str(error.value)
    assert ("the expert width 64 (moe_intermediate_size, else intermediate_size) is not divisible by "
            "moe_expert_granularity 3") in message
    assert "top-6 (num_experts_per_tok x moe_expert_granularity) needs moe_dispatch 'indexed'" in message
    assert "moe_balancing 'bias' needs moe_dispatch 'indexed'" in message
    assert "moe_shared_experts must be >= 0" in message
    with pytest.raises(ValueError, match="moe_balancing must be one of aux_loss, bias"):
        tiny_config("moe", moe_balancing="loss_free")
    with pytest.raises(ValueError, match="12 routed experts .* not divisible by moe_ep_size 8"):
        tiny_config("moe", num_local_experts=4, moe_expert_granularity=3, intermediate_size=63, moe_ep_size=8)
    assert tiny_config("moe", num_experts_per_tok=3).num_routed_experts_per_tok == 3  # indexed: any k


def test_fine_grained_top_2_converts_to_mixtral_and_shared_or_biased_models_do_not(tiny_config):
    model = AdaptiveDSForCausalLM(tiny_config("moe", moe_expert_granularity=2, num_experts_per_tok=1)).eval()
    for name, param in model.named_parameters():
        if "gate.wg" in name:
            torch.nn.init.normal_(param, std=1.0)
    mixtral = to_mixtral(model).eval()
    assert mixtral.config.num_local_experts == 8 and mixtral.config.intermediate_size == 32
    ids = torch.randint(2, 64, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(mixtral(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert "shared experts" in mixtral_incompatibility(tiny_config("moe", moe_shared_experts=1))
    assert "routing bias" in mixtral_incompatibility(tiny_config("moe", moe_balancing="bias"))


def test_with_bias_balancing_the_controller_reports_dead_experts_but_moves_no_aux_coefficient(tmp_path):
    path = tmp_path / "decisions.jsonl"
    controller = Controller(ControllerSettings(balance_windows=2, balance_threshold=0.8),
                            Knobs(micro_batch=8, accumulation=1, aux_coef=None), str(path))
    for step in (1, 2, 3):  # poor balance and a dead expert
        controller.observe_window(WindowReport(step, moe={"load_balance": 0.3, "dead_experts": ["0:5"]}))
    controller.close()
    decisions = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["action"] for d in decisions] == ["report dead expert"] and controller.knobs.aux_coef is None
