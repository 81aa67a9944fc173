"""final/ is self-contained: it loads and generates with torch and transformers alone (no deepspeed, no adaptive_ds),
with `trust_remote_code=True` or through the Auto classes that importing adaptive_ds registers.

tests/fixtures/final/<arch> are such folders (written by tests/helpers/make_final_fixtures.py at commit 6e3cb93,
the copied source files left out): a tiny model of each architecture trained for four steps, and
reference.safetensors with its logits (fp32, eval) on fixed input ids and its greedy continuation of them, as the
training environment computed them."""

import json

import pytest
import torch
from helpers.common import ROOT
from helpers.standalone_load import load_without_the_package, model_card_load
from safetensors.torch import load_file
from transformers import AutoTokenizer

from adaptive_ds.models import ARCHITECTURES, AdaptiveDSForCausalLM
from adaptive_ds.training.final import save_final

FIXTURES = ROOT / "tests" / "fixtures" / "final"

# The Auto classes that importing adaptive_ds.models registers, without trust_remote_code.
REGISTERED = """
import adaptive_ds.models
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "OWNER/NAME"
model = AutoModelForCausalLM.from_pretrained(repo)
tokenizer = AutoTokenizer.from_pretrained(repo)
"""


def _reference(arch: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / arch / "reference.safetensors")


@pytest.mark.slow  # a second interpreter
def test_final_folders_load_and_generate_with_torch_and_transformers_alone(tmp_path):
    """Each architecture's final/ (written by save_final from the trained fixture's weights), loaded as the Hub
    model card says where neither deepspeed nor adaptive_ds can be imported: the copied sources' classes, the
    training environment's logits to 1e-5 (fp32) and its greedy continuation."""
    folders = []
    for arch in ARCHITECTURES:
        model = AdaptiveDSForCausalLM.from_pretrained(FIXTURES / arch)
        del model.config.auto_map  # a trained model's config has none
        final = tmp_path / arch
        save_final(model, AutoTokenizer.from_pretrained(FIXTURES / arch), str(final), is_writer=True)
        assert "auto_map" not in model.config.to_dict()  # the live model's config is left as it was
        assert json.loads((final / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
            "modeling.AdaptiveDSForCausalLM"
        folders.append((final, model_card_load(), _reference(arch)["input_ids"]))
    loaded = load_without_the_package(tmp_path, folders, generate=True)
    for arch, result in zip(ARCHITECTURES, loaded, strict=True):
        assert result.module.startswith("transformers_modules."), result.module
        assert result.eos == [result.eos_token_id]
        reference = _reference(arch)
        torch.testing.assert_close(result.logits, reference["logits"], rtol=0, atol=1e-5, msg=arch)
        assert torch.equal(result.generated, reference["generated"]), arch


@pytest.mark.slow  # a second interpreter
def test_the_auto_classes_importing_adaptive_ds_models_registers_load_final_folders_without_deepspeed(tmp_path):
    loaded = load_without_the_package(
        tmp_path, [(FIXTURES / arch, REGISTERED, _reference(arch)["input_ids"]) for arch in ARCHITECTURES],
        generate=True, hidden=("deepspeed",))
    assert [result.module for result in loaded] == ["adaptive_ds.models.modeling"] * 4
    for arch, result in zip(ARCHITECTURES, loaded, strict=True):
        assert result.eos == [result.eos_token_id]
        reference = _reference(arch)
        torch.testing.assert_close(result.logits, reference["logits"], rtol=0, atol=1e-5, msg=arch)
        assert torch.equal(result.generated, reference["generated"]), arch
