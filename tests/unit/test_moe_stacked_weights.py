"""The grouped GEMM's (experts, out, in) weights: a view of the experts' own parameters, no copy per forward.

Each case is checked against the previous implementation (`torch.stack` of the weights on every call, written out
here) and against one matmul per expert, in outputs and in the gradients each expert's parameters receive; and
in memory: where the weights live before and after, and whether the stacked tensor is theirs or a copy.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.expert_weights import PROJECTIONS, expert_modules, projection_weights, weight_storages
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.expert_layout import regular_stride, stacked_weights
from adaptive_ds.models.moe import MoEFeedForward
from adaptive_ds.training import moe_adapter
from adaptive_ds.training.optim import parameter_groups


def experts_by_stack(layer: MoEFeedForward, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The previous implementation: each projection's weights copied by `torch.stack` on every call."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)

    def stacked(name):
        return torch.stack(projection_weights(layer, name)).transpose(-2, -1)

    gate = torch._grouped_mm(x, stacked("gate_proj"), offs=offsets)
    up = torch._grouped_mm(x, stacked("up_proj"), offs=offsets)
    return torch._grouped_mm(F.silu(gate) * up, stacked("down_proj"), offs=offsets)


def experts_by_matmul(layer: MoEFeedForward, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One SwiGLU per expert on its rows, with plain matmuls."""
    rows = []
    for expert, chunk in zip(expert_modules(layer), x.split(counts.tolist()), strict=True):
        gate, up = chunk @ expert.gate_proj.weight.t(), chunk @ expert.up_proj.weight.t()
        rows.append((F.silu(gate) * up) @ expert.down_proj.weight.t())
    return torch.cat(rows)


def _repoint(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Point `params` into one flat buffer in the given order, as DeepSpeed's optimizers do; returns the buffer."""
    flat = _flatten_dense_tensors([p.data for p in params])
    for p, view in zip(params, _unflatten_dense_tensors(flat, params), strict=True):
        p.data = view
    return flat


@pytest.mark.parametrize("layout", ["own storage", "one flat buffer", "flat buffer, experts reversed"])
def test_stacked_weights_equal_a_stack_and_per_expert_matmuls_and_share_memory_where_regular(layout, tiny_config):
    layer = MoEFeedForward(tiny_config("moe", moe_grouped_gemm="always"))
    params = list(expert_modules(layer).parameters())  # expert 0's gate, up, down, then expert 1's, ...
    if layout == "one flat buffer":
        _repoint(params)
    elif layout == "flat buffer, experts reversed":  # each projection's weights run backwards: no single stride
        _repoint(params[::-1])
    before = weight_storages(layer)
    x = torch.randn(20, 32, requires_grad=True)
    counts = torch.tensor([7, 0, 9, 4])  # an expert without rows too
    inputs = [x, *params]
    ref = experts_by_stack(layer, x, counts)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    torch.testing.assert_close(ref, experts_by_matmul(layer, x, counts), rtol=1e-5, atol=1e-6)

    saved = []  # what the forward keeps for backward: the grouped GEMMs keep their weight operand
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer.experts(x, counts)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for p, g in zip(inputs, ref_grads, strict=True):  # each expert's .grad gets its own slice's gradient
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)

    after = weight_storages(layer)
    copies = [t for t in saved if t.dim() == 3 and t.untyped_storage().data_ptr() not in after]
    assert len(copies) == (3 if layout == "flat buffer, experts reversed" else 0)  # no weight copy held to backward
    for name in PROJECTIONS:
        weights = projection_weights(layer, name)
        stacked = stacked_weights(weights)
        shares = stacked.untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()
        if layout == "flat buffer, experts reversed":  # copied each call; the weights stay in their buffer
            assert not shares and regular_stride(weights) is None
        else:
            assert shares and stacked.data_ptr() == weights[0].data_ptr()
            assert all(torch.equal(s, w) for s, w in zip(stacked, weights, strict=True))
    if layout == "own storage":  # packed once: one buffer per projection, weights re-pointed into it
        assert len(set(before)) == 12 and len(set(after)) == 3
    else:  # never moved out of the buffer an optimizer updates
        assert after == before


def test_packing_keeps_the_parameters_so_an_optimizer_made_before_it_trains_the_weights_the_forward_reads(tiny_config):
    torch.manual_seed(0)
    grouped = MoEFeedForward(tiny_config("moe", moe_grouped_gemm="always"))
    per_expert = copy.deepcopy(grouped)
    per_expert.experts.grouped_gemm = "never"
    assert grouped.experts.grouped_gemm == "always"  # a deep copy's experts are its own, its modules too
    assert per_expert.experts.modules is per_expert.moe.deepspeed_moe.experts.deepspeed_experts
    x = torch.randn(2, 12, 32)
    losses = {}
    for name, layer in (("always", grouped), ("never", per_expert)):
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(4):
            out, routing = layer(x)
            loss = out.square().mean() + 0.01 * routing.aux_loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    assert len(set(weight_storages(grouped))) == 3  # packed at the first forward
    assert losses["always"] == pytest.approx(losses["never"], rel=1e-5)
    assert losses["always"][-1] < losses["always"][0]  # the steps moved the weights the forward reads


def test_with_activation_checkpointing_packing_in_the_first_forward_gives_the_per_expert_gradients(tiny_config):
    grouped = AdaptiveDSForCausalLM(tiny_config("moe", moe_grouped_gemm="always")).train()
    per_expert = copy.deepcopy(grouped)
    for layer in per_expert.modules():
        if isinstance(layer, MoEFeedForward):
            layer.experts.grouped_gemm = "never"
    ids = torch.randint(2, 64, (2, 12))
    for model in (grouped, per_expert):
        model.model.gradient_checkpointing = True  # the packing forward runs again in backward, now as a view
        model(input_ids=ids, labels=ids).loss.backward()
    layers = [m for m in grouped.modules() if isinstance(m, MoEFeedForward)]
    assert all(len(set(weight_storages(layer))) == 3 for layer in layers)  # packed
    for (name, p), q in zip(grouped.named_parameters(), per_expert.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_packed_model_saves_and_loads_with_save_pretrained_and_packs_again_after_loading(tmp_path, tiny_config):
    model = AdaptiveDSForCausalLM(tiny_config("moe", moe_grouped_gemm="always")).eval()
    ids = torch.randint(2, 64, (2, 10))
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # packs every MoE layer's weights
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = AdaptiveDSForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-6)
    for layer in (m for m in loaded.modules() if isinstance(m, MoEFeedForward)):
        assert all(regular_stride(projection_weights(layer, name)) is not None for name in PROJECTIONS)


def test_a_forward_under_inference_mode_leaves_the_weights_trainable(tiny_config):
    model = AdaptiveDSForCausalLM(tiny_config("moe", moe_grouped_gemm="always"))
    ids = torch.randint(2, 64, (2, 16))
    with torch.inference_mode():
        model(input_ids=ids)
    layer = next(m for m in model.modules() if isinstance(m, MoEFeedForward))
    assert not any(w.is_inference() for w in projection_weights(layer, "gate_proj"))
    model(input_ids=ids, labels=ids).loss.backward()  # raised "Inference tensors cannot be saved for backward"
    assert regular_stride(projection_weights(layer, "gate_proj")) is not None  # packed by this training forward instead


def test_moe_param_groups_are_as_many_at_every_ep_size(tiny_config):
    """DeepSpeed's universal loader pairs param groups by position: a resume on another ep_size needs as many."""
    counts, cap = [], None
    for ep_size in (1, 2):
        model = AdaptiveDSForCausalLM(tiny_config("moe", num_hidden_layers=4, moe_ep_size=ep_size))
        if cap is None:  # 2.5 layers of experts: DeepSpeed's cap would cut the third layer
            cap = int(2.5 * sum(p.numel() for p in expert_modules(next(
                m for m in model.modules() if isinstance(m, MoEFeedForward))).parameters()))
        moe_adapter.prepare(model)
        groups = parameter_groups(model, 0.1, moe_group_cap=cap)
        counts.append(sum(1 for g in groups if g.get("moe")))
    assert counts == [2, 2]


def test_weights_at_a_stride_grouped_gemm_cannot_take_are_not_viewed():
    """torch._grouped_mm on GPU needs 16-byte aligned operands and strides: an odd offset or stride is copied."""
    buffer = torch.zeros(4 * 24 + 1)  # fp32: 4 bytes an element
    aligned = [buffer[i * 24:(i * 24) + 16].view(4, 4) for i in range(4)]  # 24 elements apart: 96 bytes, aligned
    assert regular_stride(aligned) == 24
    odd_start = [buffer[1 + i * 24:1 + i * 24 + 16].view(4, 4) for i in range(4)]  # starts 4 bytes in
    assert regular_stride(odd_start) is None
    odd_stride = [buffer[i * 17:i * 17 + 16].view(4, 4) for i in range(4)]  # 68 bytes apart
    assert regular_stride(odd_stride) is None
    assert torch.equal(stacked_weights(odd_stride, may_pack=False), torch.stack(odd_stride))
