"""The final/ folders written when the MoE MLPs were DeepSpeed's own layers load into the models by their tensor
names and give their logits.

tests/fixtures/final/<arch> are such folders (written by tests/helpers/make_final_fixtures.py at commit 6e3cb93,
the copied source files left out): a tiny model of each architecture trained for four steps, and
reference.safetensors with its logits (fp32, eval) on fixed input ids and its greedy continuation of them, as the
training environment computed them."""


import pytest
import torch
from helpers.common import ROOT
from safetensors import safe_open
from safetensors.torch import load_file

from adaptive_ds.models import ARCHITECTURES, AdaptiveDSForCausalLM

FIXTURES = ROOT / "tests" / "fixtures" / "final"


def _reference(arch: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / arch / "reference.safetensors")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_folders_written_with_deepspeeds_moe_layer_load_by_name_and_give_their_logits(arch):
    names = set(safe_open(FIXTURES / arch / "model.safetensors", "pt").keys())
    model = AdaptiveDSForCausalLM.from_pretrained(FIXTURES / arch).eval()
    assert set(model.state_dict()) == names  # no tensor of the folder left out, none missing
    if arch in ("moe", "hybrid"):  # every kind of name an MoE layer saves
        kinds = {".moe.deepspeed_moe.gate.wg.weight", ".moe.deepspeed_moe.experts.deepspeed_experts.3.gate_proj.weight",
                 ".moe.mlp.down_proj.weight", ".moe.coefficient.bias", ".shared_experts.up_proj.weight",
                 ".routing_bias_steps"}
        assert {k for k in kinds if any(n.endswith(k) for n in names)} == (
            kinds - {".shared_experts.up_proj.weight", ".routing_bias_steps"} if arch == "moe"
            else kinds - {".moe.mlp.down_proj.weight", ".moe.coefficient.bias"})
    reference = _reference(arch)
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits
        generated = model.generate(reference["input_ids"], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)
    assert torch.equal(generated, reference["generated"])
