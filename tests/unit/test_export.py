"""Conversion to stock transformers classes: Llama and Mixtral give the same logits, and a model Mixtral cannot
express is refused with the reasons."""


import pytest
import torch

from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.families.llama import to_llama
from adaptive_ds.models.families.mixtral import mixtral_incompatibility, to_mixtral


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_llama_conversion_gives_the_same_logits(tiny_config):
    model = AdaptiveDSForCausalLM(tiny_config("dense"))
    llama = to_llama(model)
    assert type(llama).__name__ == "LlamaForCausalLM"
    ids = torch.randint(2, 64, (2, 16))
    torch.testing.assert_close(_logits(llama, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs a dense model"):
        to_llama(AdaptiveDSForCausalLM(tiny_config("mod")))


@pytest.mark.parametrize("drop_tokens", [False, True])
def test_mixtral_conversion_gives_the_same_logits_for_top2(drop_tokens, tiny_config):
    # A capacity-limited model converts too: the limit applies in training only, inference is dropless.
    model = AdaptiveDSForCausalLM(tiny_config("moe", moe_drop_tokens=drop_tokens, moe_capacity_factor=0.5,
                                              moe_min_capacity=1))
    for layer in model.model.layers:  # a router that does something
        torch.nn.init.normal_(layer.mlp.moe.deepspeed_moe.gate.wg.weight, std=0.5)
    mixtral = to_mixtral(model)
    ids = torch.randint(2, 64, (2, 16))
    torch.testing.assert_close(_logits(mixtral, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_mixtral_conversion_says_why_it_refuses(tiny_config):
    assert mixtral_incompatibility(tiny_config("moe", moe_drop_tokens=True)) is None
    assert "renormalises" in mixtral_incompatibility(tiny_config("moe", num_experts_per_tok=1))
    with pytest.raises(ValueError, match="routing semantics differ"):
        to_mixtral(AdaptiveDSForCausalLM(tiny_config("hybrid")))
