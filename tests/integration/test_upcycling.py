"""--init_from's models against transformers' stock ones: stock Llama and Mixtral folders and our own final/ folders
import with their logits; a dense model upcycles to MoE (fine-grained, shared and residual experts too), MoD and the
hybrid with the dense model's logits at step 0; the upcycled and retrofitted models export back to stock Mixtral and
Llama with their logits; a retrofitted MoD model learns causal routing from its first steps; upcycling noise is drawn
alike on every expert-parallel rank. The stock models are the reference the import must reproduce."""

import copy
from pathlib import Path

import pytest
import torch
from helpers.pretrained_folders import llama_folder, mixtral_folder
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, MixtralForCausalLM

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.families.llama import to_llama
from adaptive_ds.models.families.mixtral import to_mixtral
from adaptive_ds.presets import pad_vocab
from adaptive_ds.pretrained import Source

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "final"
def imported(folder: Path, arch: str, **overrides) -> AdaptiveDSForCausalLM:
    """Our model as the trainer builds it from the folder: its config, a seeded model, the folder's weights."""
    source = Source.open(str(folder))
    tokenizer = source.tokenizer()
    config = source.model_config(arch, "debug", len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, **overrides)
    torch.manual_seed(0)
    model = AdaptiveDSForCausalLM(config)
    source.load_into(model)
    return model.eval()


def logits(model, ids: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    return out[..., :vocab] if vocab else out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, len(embedded_tokenizer()), (2, 24), generator=torch.Generator().manual_seed(5))


def test_a_stock_llama_imports_with_its_logits(llama, ids):
    stock = LlamaForCausalLM.from_pretrained(llama).eval()
    model = imported(llama, "dense")
    assert model.config.rope_theta == 5000.0 and model.config.rms_norm_eps == 1e-5
    torch.testing.assert_close(logits(model, ids), logits(stock, ids), rtol=0, atol=1e-5)


def test_the_padded_vocabulary_rows_are_zero_and_leave_the_real_logits(tmp_path, ids):
    vocab = len(embedded_tokenizer())
    assert vocab % 64, "the embedded vocabulary is padded"
    folder = llama_folder(tmp_path / "llama", vocab_size=vocab)
    stock = LlamaForCausalLM.from_pretrained(folder).eval()
    model = imported(folder, "dense")
    assert model.config.vocab_size == pad_vocab(vocab) > vocab
    assert not model.model.embed_tokens.weight[vocab:].any() and not model.lm_head.weight[vocab:].any()
    out = logits(model, ids)
    torch.testing.assert_close(out[..., :vocab], logits(stock, ids), rtol=0, atol=1e-5)
    assert not out[..., vocab:].any()


@pytest.mark.parametrize("overrides", [{}, {"num_experts_per_tok": 1}, {"moe_expert_granularity": 4},
                                       {"moe_expert_granularity": 2, "num_experts_per_tok": 1},
                                       {"moe_shared_experts": 1, "moe_use_residual": True, "moe_layer_interval": 2,
                                        "moe_balancing": "bias"}],
                         ids=["top2", "top1", "fine4", "fine2-top1", "shared-residual-interval2-bias"])
def test_a_dense_model_upcycled_to_moe_starts_as_the_dense_model(llama, ids, overrides):
    stock = LlamaForCausalLM.from_pretrained(llama).eval()
    model = imported(llama, "moe", **overrides)
    config = model.config
    assert config.num_routed_experts == 8 * config.moe_expert_granularity  # the preset's experts
    assert config.moe_renormalize_top1 == (config.num_routed_experts_per_tok == 1)
    torch.testing.assert_close(logits(model, ids), logits(stock, ids), rtol=0, atol=1e-5)


def test_fine_grained_upcycling_splits_the_hidden_units_and_shares_the_router_rows(llama):
    model = imported(llama, "moe", moe_expert_granularity=4)
    dense = load_file(llama / "model.safetensors")
    layer = model.model.layers[1].mlp
    experts = layer.moe.deepspeed_moe.experts.deepspeed_experts
    w = dense["model.layers.1.mlp.down_proj.weight"]  # (hidden, 64): 4 slices of 16 hidden units
    assert torch.equal(experts[6].down_proj.weight, w[:, 32:48] * 4)  # copy 1, slice 2
    assert torch.equal(experts[6].gate_proj.weight, dense["model.layers.1.mlp.gate_proj.weight"][32:48])
    router = layer.moe.deepspeed_moe.gate.wg.weight  # (32, hidden)
    assert torch.equal(router[4], router[7]) and not torch.equal(router[3], router[4])


def test_a_dense_model_retrofitted_with_mod_is_the_dense_model_at_capacity_one(llama, ids):
    stock = LlamaForCausalLM.from_pretrained(llama).eval()
    expected = logits(stock, ids)
    model = imported(llama, "mod")
    assert model.config.mod_straight_through and model.config.mod_capacity == 0.125  # the shipped capacity
    model.model.set_mod_routing("all")
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=1e-5)
    model.model.set_mod_routing("topk")
    model.model.set_mod_capacity(1.0)
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=1e-5)
    model.train()  # training's top-k routing at capacity 1.0: the dense loss, and the routers get a gradient
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-5)
    out.lm_loss.backward()
    assert model.model.layers[1].router.weight.grad.abs().sum() > 0
    model.eval().model.set_mod_routing("causal")  # at capacity 1.0 causal routing takes every token too
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=1e-5)
    model.model.set_mod_capacity(0.125)  # below, the router's seeded initialisation routes some tokens, not all
    routed = torch.cat([r.routed.flatten() for r in model(input_ids=ids, use_cache=False).mod_routing]).float()
    assert 0.05 < routed.mean() < 0.95


@pytest.mark.parametrize("arch", ["mod", "hybrid"])
@pytest.mark.parametrize("source", ["llama", "ours"])
def test_a_dense_model_retrofitted_at_capacity_one_is_the_dense_model_with_default_routing(llama, ids, source, arch):
    """What evaluation and generation do, unasked: causal routing at capacity 1.0 runs every token through every
    block, so the retrofit is the dense model it came from (a stock Llama, or our own dense final/)."""
    if source == "llama":
        folder, dense = llama, LlamaForCausalLM.from_pretrained(llama)
    else:
        folder, dense = FIXTURES / "dense", AdaptiveDSForCausalLM.from_pretrained(FIXTURES / "dense")
    model = imported(folder, arch, mod_capacity=1.0, mod_layer_interval=1)
    assert model.model.mod_routing == "causal" and model.config.mod_straight_through
    out = model(input_ids=ids, use_cache=False)
    assert len(out.mod_routing) == model.config.num_hidden_layers and all(r.routed.all() for r in out.mod_routing)
    torch.testing.assert_close(out.logits, logits(dense.eval(), ids), rtol=0, atol=1e-5)
    generated = model.generate(ids[:, :8], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(generated, dense.generate(ids[:, :8], max_new_tokens=6, min_new_tokens=6, do_sample=False))


def test_a_dense_model_upcycled_to_the_hybrid_starts_as_the_dense_model(llama, ids):
    stock = LlamaForCausalLM.from_pretrained(llama).eval()
    model = imported(llama, "hybrid")
    config = model.config
    assert config.num_experts_per_tok == 1 and config.moe_renormalize_top1 and config.mod_straight_through
    model.model.set_mod_routing("all")
    torch.testing.assert_close(logits(model, ids), logits(stock, ids), rtol=0, atol=1e-5)


def test_the_shipped_scalings_stay_without_a_dense_import(tmp_path):
    """Off otherwise: a model of our own imports with its own settings, and the field defaults are the shipped ones."""
    moe = imported(FIXTURES / "moe", "moe").config
    assert not moe.moe_renormalize_top1 and not moe.mod_straight_through
    hybrid = imported(FIXTURES / "hybrid", "hybrid").config
    assert not hybrid.moe_renormalize_top1 and not hybrid.mod_straight_through


@pytest.mark.parametrize("arch", ["dense", "moe", "mod", "hybrid"])
def test_our_own_final_folders_import_with_their_logits(arch):
    reference = load_file(FIXTURES / arch / "reference.safetensors")
    model = imported(FIXTURES / arch, arch)
    torch.testing.assert_close(logits(model, reference["input_ids"]), reference["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["saved", "in_memory"])
def test_a_stock_mixtral_imports_as_moe_with_its_logits(tmp_path, ids, layout):
    folder = mixtral_folder(tmp_path / "mixtral")
    stock = MixtralForCausalLM.from_pretrained(folder).eval()
    names = set(load_file(folder / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names  # transformers saves Mixtral's layout
    if layout == "in_memory":  # the fused layout transformers holds in memory, as a folder may also carry it
        save_file({k: v.contiguous() for k, v in stock.state_dict().items()}, folder / "model.safetensors")
    model = imported(folder, "moe")
    config = model.config
    assert (config.num_local_experts, config.num_experts_per_tok, config.moe_drop_tokens) == (4, 2, False)
    torch.testing.assert_close(logits(model, ids), logits(stock, ids), rtol=0, atol=1e-5)


def test_a_top1_mixtral_imports_with_its_renormalised_weight(tmp_path, ids):
    """Mixtral renormalises its top-k weights for every k: with one expert a token's weight is 1, not the raw gate
    probability that our top-1 routing uses unless moe_renormalize_top1 is on."""
    folder = mixtral_folder(tmp_path / "mixtral", num_experts_per_tok=1)
    stock = MixtralForCausalLM.from_pretrained(folder).eval()
    model = imported(folder, "moe")
    assert model.config.num_experts_per_tok == 1 and model.config.moe_renormalize_top1
    torch.testing.assert_close(logits(model, ids), logits(stock, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [{"num_experts_per_tok": 1}, {"moe_expert_granularity": 2}],
                         ids=["top1", "fine2-top4"])
def test_an_upcycled_moe_exports_to_a_stock_mixtral_with_its_logits(llama, ids, overrides):
    model = imported(llama, "moe", **overrides)
    with torch.no_grad():  # trained a little: experts that differ, so the export must carry each one
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    mixtral = to_mixtral(model).eval()
    torch.testing.assert_close(logits(mixtral, ids), logits(model, ids), rtol=0, atol=1e-5)


def test_a_retrofitted_mod_model_at_capacity_one_exports_to_a_stock_llama_with_its_logits(llama, ids):
    model = imported(llama, "mod", mod_layer_interval=1, mod_capacity=1.0)
    with torch.no_grad():  # trained a little: routers and blocks that differ from the dense source
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    exported = logits(to_llama(model).eval(), ids)
    model.model.set_mod_routing("topk")  # its training routing: at capacity 1.0 every token, scaled by exactly 1
    torch.testing.assert_close(exported, logits(model, ids), rtol=0, atol=1e-5)
    model.model.set_mod_routing("all")
    torch.testing.assert_close(exported, logits(model, ids), rtol=0, atol=1e-5)
    shipped = copy.deepcopy(model.config)
    shipped.mod_straight_through = False
    with pytest.raises(ValueError, match="sigmoid"):
        to_llama(AdaptiveDSForCausalLM(shipped))


def test_a_retrofitted_mod_model_below_capacity_one_is_not_exported_to_llama(llama):
    """A Llama runs every token through every block: the function of a MoD model trained at capacity 1.0 only."""
    model = imported(llama, "mod", mod_layer_interval=1, mod_capacity=0.125)
    with pytest.raises(ValueError, match=r"mod_capacity 0\.125") as refused:
        to_llama(model)
    assert "\n" not in str(refused.value) and "1.0" in str(refused.value)


def _causal_share(model, ids) -> float:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return torch.cat([r.routed.flatten() for r in out.mod_routing]).float().mean().item()


def test_a_retrofitted_mod_model_at_the_shipped_capacity_learns_causal_routing_from_its_first_steps(llama, ids):
    """The routers start from the model's seeded initialisation (about half the tokens have a positive logit); the
    causal-routing loss then moves their decisions toward the top-k share (12.5%) from the first steps, routing
    some tokens, never none and never all."""
    model = imported(llama, "mod")
    before = _causal_share(model, ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(5):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = _causal_share(model, ids)
    assert 0 < after < before < 1, (before, after)


def test_upcycling_noise_makes_the_copies_differ_alike_on_every_expert_parallel_rank(llama):
    source = Source.open(str(llama))
    config = source.model_config("moe", "debug", len(embedded_tokenizer()))
    whole = AdaptiveDSForCausalLM(config)
    source.load_into(whole, noise=0.01, seed=4)
    experts = whole.model.layers[0].mlp.moe.deepspeed_moe.experts.deepspeed_experts
    dense = load_file(llama / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(experts[0].up_proj.weight, experts[1].up_proj.weight)
    assert (experts[0].up_proj.weight / dense - 1).std().item() == pytest.approx(0.01, rel=0.1)
    # gate and up are equally shaped: each draws its own noise (one pattern on both would correlate them)
    dense_gate = load_file(llama / "model.safetensors")["model.layers.0.mlp.gate_proj.weight"]
    gate_noise, up_noise = experts[0].gate_proj.weight / dense_gate - 1, experts[0].up_proj.weight / dense - 1
    assert abs(torch.corrcoef(torch.stack([gate_noise.flatten(), up_noise.flatten()]))[0, 1].item()) < 0.1
    half = copy.deepcopy(config)
    half.moe_ep_size = 2
    second = AdaptiveDSForCausalLM(half)  # expert-parallel rank 1 of 2 holds experts 4..7
    source.load_into(second, ep_rank=1, noise=0.01, seed=4)
    held = second.model.layers[0].mlp.moe.deepspeed_moe.experts.deepspeed_experts
    assert len(held) == 4 and all(torch.equal(held[e].up_proj.weight, experts[4 + e].up_proj.weight)
                                  for e in range(4))
    assert second.model.layers[0].mlp.moe.deepspeed_moe.gate.wg.weight.shape[0] == 8
