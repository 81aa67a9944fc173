"""The families users start from in 2026, as transformers writes their folders (save_pretrained of a stock model,
test-size shapes, perturbed weights): each imports through `--init_from` as its own family with the stock model's
logits, exports back (`--to auto`: the class it came from) with the same logits, and starts moe, mod and hybrid
exactly (the upcycled or retrofitted model's first forward pass is the stock model's), tied embeddings tied."""

import pytest
import torch
from helpers.pretrained_folders import perturbed
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from adaptive_ds.export.convert import convert, target
from adaptive_ds.models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from adaptive_ds.pretrained import Source

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# test-size shapes with each family's published features (Llama-3.2-1B, SmolLM2, Qwen2.5-0.5B, Qwen3-0.6B, Mistral-7B)
FOLDERS = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE)),
    "llama-3.2": (LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_parameters=LLAMA3)),
    "smollm2": (LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "llama-bias": (LlamaForCausalLM, LlamaConfig(**SHAPE, attention_bias=True, head_dim=8)),
    "qwen2.5": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=True)),
    "qwen3-bias-yarn": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=8, attention_bias=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, head_dim=8, sliding_window=4096)),
}
RETROFIT = {"moe": {}, "mod": {"mod_capacity": 1.0, "mod_layer_interval": 1},
            "hybrid": {"mod_capacity": 1.0, "mod_layer_interval": 1}}


@pytest.fixture(scope="module", params=list(FOLDERS))
def folder(request, tmp_path_factory):
    """(name, its folder, the stock model it holds)."""
    stock_class, config = FOLDERS[request.param]
    torch.manual_seed(0)
    stock = perturbed(stock_class(config))
    path = tmp_path_factory.mktemp(request.param)
    stock.save_pretrained(path)
    return request.param, path, stock


def _ids(length: int = 24) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(5))


def _imported(path, arch: str, **overrides) -> AdaptiveDSForCausalLM:
    source = Source.open(str(path))
    assert source.problems(arch, overrides, None) == []
    model = AdaptiveDSForCausalLM(source.model_config(arch, None, SHAPE["vocab_size"], **overrides))
    source.load_into(model)
    return model.eval()


def _gap(model, stock, length: int = 24) -> float:
    with torch.no_grad():
        return (model(_ids(length)).logits - stock(_ids(length)).logits).abs().max().item()


def test_a_folder_imports_as_its_own_family_with_the_stock_logits(folder):
    name, path, stock = folder
    source = Source.open(str(path))
    assert source.model_type == stock.config.model_type and source.arch == "dense"
    model = _imported(path, "dense")
    assert model.config.source_model_type == stock.config.model_type
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == stock.config.tie_word_embeddings
    assert _gap(model, stock) < 1e-5
    assert _gap(model, stock, SHAPE["max_position_embeddings"] + 8) < 1e-5  # past the context (dynamic, yarn)


def test_it_exports_back_to_the_class_it_came_from(folder, tmp_path):
    name, path, stock = folder
    model = _imported(path, "dense")
    assert target(model, "auto") == stock.config.model_type
    back = convert(model, "auto")
    assert type(back) is type(stock)
    back.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(stock) and _gap(reloaded, stock) < 1e-5
    assert reloaded.state_dict().keys() == stock.state_dict().keys()


@pytest.mark.parametrize("arch", list(RETROFIT))
def test_upcycling_and_the_mod_retrofit_are_exact_at_step_0(folder, arch):
    name, path, stock = folder
    model = _imported(path, arch, **RETROFIT[arch])
    assert model.config.tie_word_embeddings == stock.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == stock.config.tie_word_embeddings
    # evaluation's default routing: causal, which at capacity 1.0 runs every token through every block
    assert model.model.mod_routing == "causal"
    assert _gap(model, stock) < 1e-5


def test_a_model_that_started_from_no_stock_family_has_no_auto_export():
    model = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE))
    with pytest.raises(ValueError, match="--to auto: the model started from no stock model") as refused:
        convert(model, "auto")
    assert "\n" not in str(refused.value) and "qwen2" in str(refused.value)


@pytest.mark.parametrize("fields, to, reason", [
    ({"attention_qkv_bias": True}, "llama", "biases on q/k/v but not on o"),
    ({"qk_norm": True}, "qwen2", "Qwen2 has no attention_qkv_bias False, qk_norm True"),
    ({"attention_qkv_bias": True}, "mistral", "Mistral has no attention_qkv_bias True"),
    ({}, "qwen3", "Qwen3's attention normalises queries and keys"),
    ({"sliding_window": 64}, "llama", "Llama has no sliding_window 64"),
])
def test_an_attention_a_family_cannot_hold_is_refused_in_one_line(fields, to, reason):
    model = AdaptiveDSForCausalLM(AdaptiveDSConfig(**SHAPE, **fields))
    with pytest.raises(ValueError, match=reason) as refused:
        convert(model, to)
    assert "\n" not in str(refused.value)


MOE_FOLDERS = {
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=48, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("name", list(MOE_FOLDERS))
def test_an_moe_folder_imports_as_moe_and_exports_back_with_auto(name, tmp_path):
    stock_class, config = MOE_FOLDERS[name]
    torch.manual_seed(0)
    stock = perturbed(stock_class(config))
    stock.save_pretrained(tmp_path / "stock")
    model = _imported(tmp_path / "stock", "moe")
    assert model.config.arch == "moe" and _gap(model, stock) < 1e-5
    back = convert(model, "auto")
    assert type(back) is stock_class and _gap(back.eval(), stock) < 1e-5


@pytest.mark.parametrize("name, sibling", [("llama", MixtralForCausalLM), ("mistral", MixtralForCausalLM),
                                           ("qwen3", Qwen3MoeForCausalLM)])
def test_an_upcycled_model_exports_with_auto_to_its_familys_moe_class(name, sibling, tmp_path):
    stock_class, config = FOLDERS[name]
    torch.manual_seed(0)
    stock = perturbed(stock_class(config))
    stock.save_pretrained(tmp_path)
    model = _imported(tmp_path, "moe", moe_drop_tokens=False)
    back = convert(model, "auto")
    assert type(back) is sibling and _gap(back.eval(), stock) < 1e-5


def test_an_upcycled_model_of_a_family_without_an_moe_sibling_is_refused_with_auto(tmp_path):
    stock_class, config = FOLDERS["qwen2.5"]
    stock_class(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="MoE layers have no Qwen2 equivalent") as refused:
        convert(_imported(tmp_path, "moe"), "auto")
    assert "\n" not in str(refused.value)
