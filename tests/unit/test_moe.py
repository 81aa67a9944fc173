"""The MoE layer's router, dispatchers and experts against a naive per-expert loop and DeepSpeed's stock layer
(swapped in as the trainer does, `moe_adapter`)."""

import collections

import pytest
import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import multiplicative_jitter as deepspeed_jitter
from helpers.common import tiny_config
from torch.overrides import TorchFunctionMode

from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models import moe as moe_module
from adaptive_ds.models.moe import MoEFeedForward, expert_capacity, multiplicative_jitter, route
from adaptive_ds.training import moe_adapter


def _layer(stock: bool = False, **overrides):
    """A layer whose router routes unevenly; `stock`: in DeepSpeed's MoE layer, as the trainer runs it."""
    config = tiny_config("moe", num_local_experts=4, **overrides)
    layer = MoEFeedForward(config)
    torch.nn.init.normal_(layer.moe.deepspeed_moe.gate.wg.weight, std=0.5)
    if stock:
        moe_adapter.to_deepspeed(layer, config)
    return layer


def naive_moe(layer: MoEFeedForward, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: every token through each of its top-k experts, one token at a time, dropless; routed by the gate's
    logits of `x`, or by the (tokens, experts) `logits` given."""
    tokens = x.reshape(-1, x.shape[-1])
    if logits is None:
        logits = F.linear(tokens.float(), layer.moe.deepspeed_moe.gate.wg.weight.float())
    probs = logits.softmax(-1)
    top_p, top_e = probs.topk(layer.router.k, dim=-1)
    if layer.router.k > 1:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    experts = layer.moe.deepspeed_moe.experts.deepspeed_experts
    rows = []
    for t in range(tokens.shape[0]):
        rows.append(sum(top_p[t, j] * experts[int(top_e[t, j])](tokens[t:t + 1])[0] for j in range(layer.router.k)))
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("grouped", ["always", "never"])
def test_indexed_dispatch_equals_a_naive_loop_in_outputs_and_gradients(k, grouped):
    layer = _layer(num_experts_per_tok=k, moe_drop_tokens=False, moe_grouped_gemm=grouped)
    x = torch.randn(3, 10, 32, requires_grad=True)
    out, routing = layer(x)
    ref = naive_moe(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()], allow_unused=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()], allow_unused=True)
    for g, r in zip(grads, ref_grads, strict=True):
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert int(routing.expert_counts.sum()) == 30 * k and int(routing.dropped) == 0


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, -1).pow(2).mean()


@pytest.mark.parametrize("jitter", [False, True])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_both_dispatchers_equal_deepspeeds_stock_layer(k, drop_tokens, jitter):
    """The indexed dispatcher and DeepSpeed's dispatcher behind the same interface both give what DeepSpeed's own
    `deepspeed.moe.layer.MoE` computes end to end (its gate with the same jitter draws, dispatch, experts and
    combine): outputs, counts, the aux loss and gradients. The z-loss, which DeepSpeed's layer does not compute:
    DeepSpeed's dispatch reports that of the logits without jitter (as the layer did when it ran DeepSpeed's `MoE`
    forward and recomputed the logits beside it), the indexed one that of the logits it routed by."""
    # Top-1 with drops is left out: DeepSpeed picks among equal-priority tokens with topk over a 0/1 mask,
    # an order torch does not define. Top-2 drops in token order, which we reproduce exactly.
    if k == 1 and drop_tokens:
        pytest.skip("DeepSpeed's top-1 drop order is undefined")
    options = dict(num_experts_per_tok=k, moe_drop_tokens=drop_tokens, moe_capacity_factor=0.5, moe_min_capacity=1,
                   moe_jitter=jitter)
    layer = _layer(stock=True, **options)
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch.manual_seed(7)  # each forward draws the same jitter
    indexed, indexed_routing = layer(x)
    layer.dispatcher = moe_adapter.DeepSpeedDispatcher(tiny_config("moe", num_local_experts=4, **options))
    torch.manual_seed(7)
    deepspeed, deepspeed_routing = layer(x)
    torch.manual_seed(7)
    stock, stock_aux, stock_counts = layer.moe(x)  # DeepSpeed's layer's own forward
    for ours, routing in ((indexed, indexed_routing), (deepspeed, deepspeed_routing)):
        torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(routing.aux_loss, stock_aux)
        assert torch.equal(routing.expert_counts, stock_counts)
    tokens, weight = x.detach().reshape(-1, 32).float(), layer.moe.deepspeed_moe.gate.wg.weight.detach().float()
    plain = F.linear(tokens, weight)
    torch.manual_seed(7)
    jittered = F.linear(deepspeed_jitter(tokens, tokens.device), weight) if jitter else plain
    torch.testing.assert_close(deepspeed_routing.z_loss, _z_loss(plain))
    torch.testing.assert_close(indexed_routing.z_loss, _z_loss(jittered))
    if jitter:  # the jitter case tells the two apart
        assert not torch.allclose(_z_loss(plain), _z_loss(jittered), rtol=1e-5, atol=0)
    params = [x, *layer.parameters()]
    g_stock = torch.autograd.grad(stock.sum(), params, allow_unused=True)
    for ours in (indexed, deepspeed):
        for a, b in zip(torch.autograd.grad(ours.sum(), params, allow_unused=True, retain_graph=True), g_stock,
                        strict=True):
            if a is not None and b is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class _HostReads(TorchFunctionMode):
    """Counts the calls of a forward that read the device back to the host: `tolist`, `item`, `__int__`, and
    `bincount` (whose output size depends on its input's values, so it waits for the device)."""

    NAMES = ("bincount", "tolist", "item", "__int__")

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


# The same count, by the same layer forward, at fccbcd0 (before the router / dispatcher / experts split, when the
# layer ran DeepSpeed's `MoE` forward for "deepspeed"): indexed {bincount: 3, tolist: 1} (the routing's demand, kept
# counts and first choices; the per-expert split), deepspeed {__int__: 1} (the capacity `MOELayer.forward` reads),
# alike for top-1 and top-2, with and without drops and jitter.
BEFORE_THE_SPLIT = {"indexed": {"bincount": 3, "tolist": 1}, "deepspeed": {"__int__": 1}}


@pytest.mark.parametrize("jitter", [False, True])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dispatch", ["indexed", "deepspeed"])
def test_a_training_forward_reads_the_device_back_no_more_than_before_the_split(dispatch, k, drop_tokens, jitter):
    layer = _layer(stock=True, num_experts_per_tok=k, moe_drop_tokens=drop_tokens, moe_capacity_factor=1.0,
                   moe_min_capacity=1, moe_jitter=jitter, moe_dispatch=dispatch)
    x = torch.randn(2, 16, 32)
    with _HostReads() as reads:
        layer(x)
    assert dict(reads.calls) == BEFORE_THE_SPLIT[dispatch]


def test_capacity_drops_exactly_the_later_tokens_and_second_choices():
    # 6 tokens, 2 experts, top-1, capacity 2: expert 0 is wanted by tokens 0, 2, 3, 5 -> 3 and 5 drop.
    logits = torch.tensor([[2.0, 0], [0, 2], [2, 0], [2, 0], [0, 2], [2, 0]])
    kept, demand, _ = route(logits, k=1, capacity=2)
    assert demand.tolist() == [4, 2]
    assert sorted(kept.token.tolist()) == [0, 1, 2, 4]
    # top-2, capacity 3: every token picks both experts; first choices (tokens 0..5 in order) fill the slots,
    # so expert 0 keeps first choices 0, 2, 3 and expert 1 keeps first choices 1, 4 then token 0's second.
    kept, demand, _ = route(logits, k=2, capacity=3)
    assert demand.tolist() == [6, 6]
    experts = torch.repeat_interleave(torch.arange(2), kept.counts).tolist()
    by_expert = {0: [], 1: []}
    for token, expert in zip(kept.token.tolist(), experts, strict=True):
        by_expert[expert].append(token)
    assert by_expert == {0: [0, 2, 3], 1: [1, 4, 0]}
    # weights are renormalised over the choices a token kept: one kept choice gets weight 1
    weights = dict(zip(zip(kept.token.tolist(), experts, strict=True), kept.weight.tolist(), strict=True))
    assert weights[(2, 0)] == pytest.approx(1.0) and weights[(0, 0)] + weights[(0, 1)] == pytest.approx(1.0)


def _weights(kept) -> dict[tuple[int, int], float]:
    """(token, expert) -> gate weight of the kept assignments."""
    experts = torch.repeat_interleave(torch.arange(len(kept.counts)), kept.counts).tolist()
    return dict(zip(zip(kept.token.tolist(), experts, strict=True), kept.weight.tolist(), strict=True))


@pytest.mark.parametrize("capacity", [None, 1], ids=["dropless", "capacity 1"])
def test_unrenormalised_top_k_weights_are_the_softmax_probabilities_as_they_are(capacity):
    """Qwen3-MoE's norm_topk_prob false (`renormalize=False`): a token's expert outputs are weighted by their gate
    probabilities, which then sum to less than 1, and a dropped choice's share goes to no other choice."""
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.4, 0.3]])  # token 0: experts 3, 2; token 1: 2, 3
    kept, _, _ = route(probs.log(), k=2, capacity=capacity, renormalize=False)
    renormalised, _, _ = route(probs.log(), k=2, capacity=capacity)
    if capacity is None:  # every choice kept
        expected = {(0, 3): 0.4, (0, 2): 0.3, (1, 2): 0.4, (1, 3): 0.3}
        expected_renormalised = {(0, 3): 4 / 7, (0, 2): 3 / 7, (1, 2): 4 / 7, (1, 3): 3 / 7}
    else:  # one slot each: the first choices win it (token 0 expert 3, token 1 expert 2), the second choices drop
        expected = {(0, 3): 0.4, (1, 2): 0.4}
        expected_renormalised = {(0, 3): 1.0, (1, 2): 1.0}
    assert _weights(kept) == pytest.approx(expected)
    assert _weights(renormalised) == pytest.approx(expected_renormalised)
    # top-1: the probability, or exactly 1 with moe_renormalize_top1, whatever `renormalize` says
    assert _weights(route(probs.log(), k=1, capacity=capacity, renormalize=False)[0]) == pytest.approx(
        {(0, 3): 0.4, (1, 2): 0.4})
    assert _weights(route(probs.log(), k=1, capacity=capacity, renormalize_top1=True, renormalize=False)[0]) == {
        (0, 3): 1.0, (1, 2): 1.0}


def test_layer_reports_dropped_assignments_in_training_and_is_dropless_in_eval():
    layer = _layer(moe_drop_tokens=True, moe_capacity_factor=0.5, moe_min_capacity=1)
    x = torch.randn(1, 40, 32)
    _, routing = layer(x)
    capacity = expert_capacity(40, 4, 2, 0.5, 1)
    assert int(routing.dropped) == int((routing.expert_counts - capacity).clamp_min(0).sum()) > 0
    layer.eval()
    _, routing = layer(x)
    assert int(routing.dropped) == 0  # inference is dropless


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dispatch", ["indexed", "deepspeed"])
def test_eval_is_dropless_for_a_capacity_limited_layer(k, dispatch):
    layer = _layer(stock=True, num_experts_per_tok=k, moe_drop_tokens=True, moe_capacity_factor=0.5,
                   moe_min_capacity=1, moe_dispatch=dispatch)
    x = torch.randn(3, 10, 32)
    trained, _ = layer(x)
    reference = naive_moe(layer, x)
    assert not torch.allclose(trained, reference, atol=1e-3)  # training drops, so it differs from dropless
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], reference, rtol=1e-5, atol=1e-5)
        one_token, _ = layer(x[:1, :1])  # a decoding step: DeepSpeed's top-1 gate would assert >= min tokens
        torch.testing.assert_close(one_token, reference[:1, :1], rtol=1e-5, atol=1e-5)
        if k == 2:  # and equal to DeepSpeed's own dropless gating (its top-1 asserts tokens >= min_capacity)
            layer.moe.deepspeed_moe.gate.drop_tokens = False
            stock, _, _ = layer.moe(x)
            torch.testing.assert_close(layer(x)[0], stock, rtol=1e-5, atol=1e-6)


def test_the_z_loss_is_the_mean_squared_logsumexp_of_the_router_logits():
    layer = _layer(moe_drop_tokens=False)
    x = torch.randn(2, 8, 32)
    _, routing = layer(x)
    logits = F.linear(x.reshape(-1, 32), layer.moe.deepspeed_moe.gate.wg.weight)
    torch.testing.assert_close(routing.z_loss, torch.logsumexp(logits, -1).pow(2).mean())


def _logits(layer: MoEFeedForward, tokens: torch.Tensor) -> torch.Tensor:
    """The layer's router logits of `tokens` (tokens, hidden), in the layer's mode."""
    return layer.router.logits(tokens, layer.moe.deepspeed_moe.gate.wg.weight, layer.training)


JITTER = 1e-2  # DeepSpeed's multiplicative_jitter: each router input times a factor uniform in [1 - eps, 1 + eps]


def test_jitter_multiplies_each_router_input_by_a_factor_within_epsilon_in_training_only():
    layer = _layer(moe_jitter=True, moe_drop_tokens=False)
    with torch.no_grad():  # one-hot gate rows: expert e's logit is input feature e, so the logits show the factors
        gate = layer.moe.deepspeed_moe.gate.wg.weight
        gate.zero_()
        gate[torch.arange(4), torch.arange(4)] = 1.0
    x = torch.randn(4000, 32)
    layer.eval()
    assert torch.equal(_logits(layer, x), x[:, :4])  # no noise at all in eval
    layer.train()
    with torch.no_grad():
        factors = _logits(layer, x) / x[:, :4]  # (tokens, experts): one factor per input element
    assert factors.min() >= 1 - JITTER - 1e-6 and factors.max() <= 1 + JITTER + 1e-6
    assert factors.min() < 1 - 0.9 * JITTER and factors.max() > 1 + 0.9 * JITTER  # the whole range is drawn
    assert abs(float(factors.mean()) - 1) < 1e-3  # centred on 1 (uniform: standard error ~5e-5 here)
    assert (factors[:, 0] != factors[:, 1]).float().mean() > 0.99  # a factor per element, not one per token
    assert not torch.equal(_logits(layer, x), _logits(layer, x))  # a new draw every forward
    plain = _layer(moe_drop_tokens=False)
    plain.load_state_dict(layer.state_dict())
    assert plain.training and torch.equal(_logits(plain, x), x[:, :4])  # off unless asked for


def test_a_jittered_layer_routes_by_the_jittered_logits_in_training_and_is_deterministic_in_eval():
    layer = _layer(moe_jitter=True, moe_drop_tokens=False)
    x = torch.randn(2, 8, 32)
    torch.manual_seed(1)
    jittered = _logits(layer, x.reshape(-1, 32))
    torch.manual_seed(1)  # the same draw inside the forward
    out, _ = layer(x)
    torch.testing.assert_close(out, naive_moe(layer, x, jittered), rtol=1e-5, atol=1e-5)
    layer.eval()
    a, _ = layer(x)
    b, _ = layer(x)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, naive_moe(layer, x), rtol=1e-5, atol=1e-5)
    assert not torch.equal(a, out)  # the training forward's noise changed its output


def _swiglu_by_hand(mlp, x):
    """down(silu(gate x) * up x) from the module's weight matrices."""
    return (F.silu(x @ mlp.gate_proj.weight.t()) * (x @ mlp.up_proj.weight.t())) @ mlp.down_proj.weight.t()


@pytest.mark.parametrize("dispatch", ["indexed", "deepspeed"])
def test_residual_moe_mixes_the_dense_mlp_and_the_experts_by_the_softmax_of_the_coefficient(dispatch):
    # PR-MoE (Rajbhandari et al. 2022, DeepSpeed-MoE eq. 2's residual form): out = c0 * experts(x) + c1 * mlp(x),
    # (c0, c1) = softmax(W x + b), with W, b the layer's coefficient
    layer = _layer(stock=dispatch == "deepspeed", moe_use_residual=True, moe_drop_tokens=False, moe_dispatch=dispatch)
    for param in layer.parameters():  # the dense MLP unlike the experts, the coefficient far from an even split
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(2, 8, 32)
    out, _ = layer(x)
    coefficient = layer.moe.coefficient
    mix = (x @ coefficient.weight.t() + coefficient.bias).softmax(-1)  # (2, 8, 2)
    expected = naive_moe(layer, x) * mix[..., :1] + _swiglu_by_hand(layer.moe.mlp, x) * mix[..., 1:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert mix.min() < 0.2 and mix.max() > 0.8  # some tokens lean on one side: the mixing is really tested
    with torch.no_grad():  # the dense MLP's share moves the output by exactly c1 * its change
        before = _swiglu_by_hand(layer.moe.mlp, x)
        layer.moe.mlp.down_proj.weight.mul_(2)
        changed, _ = layer(x)
    torch.testing.assert_close(changed - out, mix[..., 1:] * before, rtol=1e-4, atol=1e-5)


def _stock_moe_like_before(config):
    """Stands in for `ExpertMixture`: the `deepspeed.moe.layer.MoE` an MoE MLP was built as, with its settings."""

    def build(hidden_size, expert, num_experts, ep_size, use_residual):
        return MoE(hidden_size=hidden_size, expert=expert, num_experts=num_experts, ep_size=ep_size,
                   k=config.num_routed_experts_per_tok, capacity_factor=config.moe_capacity_factor,
                   min_capacity=config.moe_min_capacity, use_residual=use_residual, noisy_gate_policy=None,
                   drop_tokens=config.moe_drop_tokens, use_rts=False, top2_2nd_expert_sampling=False)

    return build


@pytest.mark.parametrize("ep_size", [1, 2])
def test_a_seed_builds_the_same_model_as_with_deepspeeds_layer_in_its_place(monkeypatch, ep_size, tiny_config):
    """The same initial weights, names and order, and the same random numbers left to draw after it."""
    config = tiny_config("moe", moe_use_residual=True, moe_shared_experts=1, moe_ep_size=ep_size)
    torch.manual_seed(3)
    plain = AdaptiveDSForCausalLM(config)
    after_plain = torch.get_rng_state()
    monkeypatch.setattr(moe_module, "ExpertMixture", _stock_moe_like_before(config))
    torch.manual_seed(3)
    stock = AdaptiveDSForCausalLM(config)
    assert isinstance(stock.model.layers[0].mlp.moe, MoE) and not isinstance(plain.model.layers[0].mlp.moe, MoE)
    assert torch.equal(torch.get_rng_state(), after_plain)
    stock_state = stock.state_dict()
    assert list(plain.state_dict()) == list(stock_state)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, stock_state[name]), name


def test_the_swap_to_deepspeeds_layer_keeps_the_parameters_and_marks_the_experts(tiny_config):
    config = tiny_config("moe", moe_use_residual=True, moe_shared_experts=1)
    model = AdaptiveDSForCausalLM(config)
    before = list(model.named_parameters())
    rng = torch.get_rng_state()
    moe_adapter.prepare(model)
    moe_adapter.prepare(model)  # idempotent
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn: the run's random numbers are unchanged
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(p is q for (_, p), (_, q) in zip(after, before, strict=True))  # the same Parameter objects
    assert all(p.device.type == "cpu" for _, p in after)
    layers = moe_adapter.moe_layers(model)
    assert all(isinstance(layer.moe, MoE) and not layer.experts.may_pack for layer in layers)
    experts = {n for n, p in after if not getattr(p, "allreduce", True)}  # DeepSpeed's mark on expert parameters
    assert experts == {n for n, _ in after if ".deepspeed_experts." in n}
    assert {getattr(p, "group_name", None) for n, p in after if n in experts} == {"ep_size_1"}


def test_deepspeeds_stock_dispatch_needs_its_layer_to_train_and_says_so():
    layer = _layer(moe_dispatch="deepspeed")
    x = torch.randn(2, 8, 32)
    with pytest.raises(ValueError, match="moe_dispatch 'deepspeed' trains through DeepSpeed's own MoE layer.*"
                                         "train with moe_dispatch 'indexed'"):
        layer(x)
    layer.eval()  # inference is the indexed path in every dispatch mode
    torch.testing.assert_close(layer(x)[0], naive_moe(layer, x), rtol=1e-5, atol=1e-5)


def test_jitter_draws_what_deepspeeds_multiplicative_jitter_draws():
    x = torch.randn(64, 32)
    torch.manual_seed(5)
    ours = multiplicative_jitter(x)
    torch.manual_seed(5)
    assert torch.equal(ours, deepspeed_jitter(x, device=x.device))
