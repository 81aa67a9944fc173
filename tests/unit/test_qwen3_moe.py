"""Qwen3-MoE (models/families/qwen3_moe.py): a folder transformers writes imports through `--init_from`'s Source as
its own family, an MoE model with Qwen3-MoE's routing (norm_topk_prob either way, an expert width of its own, MoE
in every decoder_sparse_step-th layer), its logits transformers' Qwen3MoeForCausalLM's, and exports back to that
class tensor for tensor. What the model cannot be, either way, is refused in one line."""

import copy
import re

import pytest
import torch
from helpers.common import tiny_config
from helpers.pretrained_folders import perturbed
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from adaptive_ds.export.convert import convert
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.families import QWEN3_MOE
from adaptive_ds.pretrained import Source

# an expert width (48) of its own, not intermediate_size (64, the dense layers'); head_dim 16, not hidden / heads
SHAPE = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
             rms_norm_eps=1e-5, num_experts=4)
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


def _stock(**overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return perturbed(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**SHAPE, **overrides})))


def _folder(path, stock: Qwen3MoeForCausalLM, fused: bool = False) -> str:
    """`stock` saved by save_pretrained (one tensor per expert), or with transformers' in-memory tensors as they are
    (`fused`: the experts stacked in gate_up_proj and down_proj)."""
    stock.save_pretrained(path)
    if fused:
        save_file({name: tensor.contiguous() for name, tensor in stock.state_dict().items()},
                  path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def _imported(folder: str, **overrides) -> AdaptiveDSForCausalLM:
    source = Source.open(folder)
    assert source.family is QWEN3_MOE and source.arch == "moe"
    assert source.problems("moe", overrides, None) == []
    model = AdaptiveDSForCausalLM(source.model_config("moe", None, source.config.vocab_size, **overrides))
    source.load_into(model)
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


# transformers' default (norm_topk_prob false) and Qwen3-30B-A3B's (true); top-1 both ways; MoE in every other layer,
# mlp_only_layers naming layers that are dense by decoder_sparse_step already; tied embeddings, biases, a window
CASES = {
    "top-2 unnormalised": dict(num_experts_per_tok=2, norm_topk_prob=False),
    "top-2 renormalised": dict(num_experts_per_tok=2, norm_topk_prob=True),
    "top-1 unnormalised, every other layer": dict(num_experts_per_tok=1, norm_topk_prob=False, decoder_sparse_step=2),
    "top-1 renormalised, every other layer": dict(num_experts_per_tok=1, norm_topk_prob=True, decoder_sparse_step=2,
                                                  mlp_only_layers=[0, 2]),
    "top-3, tied, biases, a window": dict(num_experts_per_tok=3, decoder_sparse_step=2, tie_word_embeddings=True,
                                          attention_bias=True, use_sliding_window=True, sliding_window=64),
}


@pytest.mark.parametrize("case", CASES)
def test_a_saved_qwen3_moe_imports_with_its_logits_and_exports_back_tensor_for_tensor(tmp_path, case):
    settings = CASES[case]
    stock = _stock(**settings)
    model = _imported(_folder(tmp_path, stock))
    c, k, norm = model.config, settings["num_experts_per_tok"], settings.get("norm_topk_prob", False)
    step = settings.get("decoder_sparse_step", 1)
    assert (c.num_routed_experts, c.num_routed_experts_per_tok, c.expert_intermediate_size) == (4, k, 48)
    assert (c.intermediate_size, c.moe_layer_interval, c.num_moe_layers, c.moe_drop_tokens) == (64, step, 4 // step,
                                                                                                 False)
    assert (c.qk_norm, c.head_dim, c.tie_word_embeddings) == (True, 16, settings.get("tie_word_embeddings", False))
    assert (c.moe_renormalize_top1 if k == 1 else c.moe_norm_topk_prob) is norm
    reference = _logits(stock)
    assert (_logits(model) - reference).abs().max() < 1e-5
    # the routing's normalisation shows: the other setting of it, the same weights, is far off
    flipped_config = copy.deepcopy(c)
    setattr(flipped_config, "moe_renormalize_top1" if k == 1 else "moe_norm_topk_prob", not norm)
    flipped = AdaptiveDSForCausalLM(flipped_config).eval()
    flipped.load_state_dict(model.state_dict())
    assert (_logits(flipped) - reference).abs().max() > 1e-3

    exported = convert(model, "qwen3_moe")
    assert type(exported) is Qwen3MoeForCausalLM
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                  "decoder_sparse_step", "norm_topk_prob", "head_dim", "attention_bias", "tie_word_embeddings",
                  "sliding_window"):
        assert getattr(exported.config, field) == getattr(stock.config, field), field
    assert torch.equal(_logits(exported), reference)
    ours, theirs = exported.state_dict(), stock.state_dict()
    assert ours.keys() == theirs.keys()
    assert [name for name in theirs if not torch.equal(ours[name], theirs[name])] == []


def test_the_fused_expert_layout_imports_as_the_per_expert_one(tmp_path):
    """transformers' in-memory tensors (mlp.experts.gate_up_proj: gate rows then up rows) read as save_pretrained's
    per-expert tensors do: the same model, tensor for tensor."""
    stock = _stock(num_experts_per_tok=2, decoder_sparse_step=2)
    fused = _folder(tmp_path / "fused", stock, fused=True)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(f"{fused}/model.safetensors")
    saved = _folder(tmp_path / "saved", stock)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in load_file(f"{saved}/model.safetensors")
    from_fused, from_saved = _imported(fused).state_dict(), _imported(saved).state_dict()
    assert [name for name in from_saved if not torch.equal(from_fused[name], from_saved[name])] == []
    expert = "model.layers.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.3."
    assert torch.equal(from_fused[expert + "up_proj.weight"], stock.model.layers[1].mlp.experts.gate_up_proj[3, 48:])
    assert torch.equal(from_fused[expert + "down_proj.weight"], stock.model.layers[1].mlp.experts.down_proj[3])


@pytest.mark.parametrize("settings, problem", [
    (dict(mlp_only_layers=[1]), "has mlp_only_layers [1], dense MLPs in MoE layers [1] of decoder_sparse_step 1; "
                                "adaptive_ds's MoE layers are every moe_layer_interval-th, with no exceptions"),
    (dict(decoder_sparse_step=2, mlp_only_layers=[0, 3]), "has mlp_only_layers [0, 3], dense MLPs in MoE layers [3]"),
    (dict(decoder_sparse_step=5), "has decoder_sparse_step 5 over 4 layers, no MoE layer"),
    (dict(num_experts=0), "has num_experts 0, no MoE layer"),
    (dict(hidden_act="gelu"), "has hidden_act 'gelu'; adaptive_ds's MLPs are SwiGLU (silu)"),
])
def test_what_the_model_cannot_hold_is_refused_in_one_line_naming_it(tmp_path, settings, problem):
    Qwen3MoeConfig(**{**SHAPE, **settings}).save_pretrained(tmp_path)
    save_file({"unread": torch.zeros(1)}, tmp_path / "model.safetensors")  # (the config is what is checked)
    problems = Source.open(str(tmp_path)).feature_problems()
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith(f"init_from {str(tmp_path)!r} ") and problem in problems[0]


@pytest.mark.parametrize("settings, stock", [
    (dict(moe_expert_granularity=2, moe_norm_topk_prob=False), dict(num_experts=8, num_experts_per_tok=2,
                                                                    moe_intermediate_size=32, norm_topk_prob=False)),
    (dict(moe_renormalize_top1=False), dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)),
    (dict(moe_renormalize_top1=True, moe_norm_topk_prob=False), dict(num_experts_per_tok=1, norm_topk_prob=True)),
], ids=["fine-grained", "top-1 raw (moe:top1)", "top-1 renormalised (upcycled)"])
def test_a_top_k_moe_model_trained_here_exports_to_qwen3_moe_with_its_logits(settings, stock):
    """Fine-grained experts are Qwen3-MoE experts of their width, k x g of them routed; top-1 weighs its expert as
    moe_renormalize_top1 says, whatever moe_norm_topk_prob; the dense layers between the MoE ones are Qwen3-MoE's
    dense MLPs."""
    torch.manual_seed(0)
    model = perturbed(AdaptiveDSForCausalLM(tiny_config(
        "moe", vocab_size=128, num_hidden_layers=4, qk_norm=True, moe_layer_interval=2, num_experts_per_tok=1,
        **settings)))
    exported = convert(model, "qwen3_moe")
    assert {field: getattr(exported.config, field) for field in stock} == stock
    assert (exported.config.decoder_sparse_step, exported.config.intermediate_size) == (2, 64)
    assert (_logits(exported) - _logits(model)).abs().max() < 1e-5


@pytest.mark.parametrize("arch, settings, reason", [
    ("dense", dict(qk_norm=True), "arch is 'dense', not 'moe'"),
    ("hybrid", dict(qk_norm=True), "arch is 'hybrid', not 'moe'"),
    ("moe", {}, "Qwen3-MoE's attention normalises queries and keys (qk_norm), this model's does not"),
    ("moe", dict(qk_norm=True, attention_qkv_bias=True), "biases on q/k/v but not on o"),
    ("moe", dict(qk_norm=True, moe_shared_experts=1), "shared experts have no Qwen3-MoE equivalent"),
    ("moe", dict(qk_norm=True, moe_use_residual=True), "the residual (PR-MoE) MLP has no Qwen3-MoE equivalent"),
    ("moe", dict(qk_norm=True, moe_balancing="bias"), "the routing bias (moe_balancing 'bias')"),
])
def test_what_qwen3_moe_cannot_express_is_refused_in_one_line(arch, settings, reason):
    model = AdaptiveDSForCausalLM(tiny_config(arch, **settings))
    assert reason in QWEN3_MOE.export_problem(model.config)
    with pytest.raises(ValueError, match=re.escape(reason)) as refused:
        convert(model, "qwen3_moe")
    assert "\n" not in str(refused.value) and str(refused.value).startswith("--to qwen3_moe needs")
