"""final/ is self-contained: it loads and generates with torch and transformers alone (no deepspeed, no adaptive_ds),
with `trust_remote_code=True` or through the Auto classes that importing adaptive_ds registers.

tests/fixtures/final/<arch> are such folders (written by tests/helpers/make_final_fixtures.py at commit 6e3cb93,
the copied source files left out): a tiny model of each architecture trained for four steps, and
reference.safetensors with its logits (fp32, eval) on fixed input ids and its greedy continuation of them, as the
training environment computed them."""

import json
import shutil

import pytest
import torch
from helpers.common import ROOT, run_command
from helpers.hidden_packages import without
from safetensors.torch import load_file
from transformers import AutoTokenizer

from adaptive_ds.export.hub import model_card
from adaptive_ds.models import ARCHITECTURES, AdaptiveDSForCausalLM
from adaptive_ds.training.final import save_final

FIXTURES = ROOT / "tests" / "fixtures" / "final"

# For each folder given: LOAD (code that sets `model` and `tokenizer` from `repo`) run on it, then the model class's
# module, its logits on the reference ids and its greedy continuation.
LOAD_AND_GENERATE = """
import json

import torch
from safetensors.torch import load_file, save_file

out_file, *folders = sys.argv[1:]
results, modules = {}, []
for i, folder in enumerate(folders):
    loaded = {}
    exec(LOAD.replace('"OWNER/NAME"', repr(folder)), loaded)
    model, tokenizer = loaded["model"].eval(), loaded["tokenizer"]
    assert tokenizer("<eos>").input_ids == [tokenizer.eos_token_id]
    ids = load_file(folder + "/reference.safetensors")["input_ids"]
    with torch.no_grad():
        results[f"{i}.logits"] = model(input_ids=ids).logits
        results[f"{i}.generated"] = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    modules.append(type(model).__module__)
save_file(results, out_file)
print(json.dumps({"modules": modules, "hidden_loaded": loaded_hidden()}))
"""

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


def _load_in_subprocess(tmp_path, folders, hidden: tuple[str, ...], load: str) -> tuple[list, list]:
    """Run LOAD_AND_GENERATE with `load` on `folders` where `hidden` are not installed: (the model classes'
    modules, [(logits, generated) of each folder])."""
    script = without(hidden, f"LOAD = {load!r}\n" + LOAD_AND_GENERATE)
    out = tmp_path / "results.safetensors"
    result = run_command(["python", "-I", "-c", script, str(out), *map(str, folders)],
                         HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["hidden_loaded"] == []  # nothing needed them
    results = load_file(out)
    return report["modules"], [(results[f"{i}.logits"], results[f"{i}.generated"]) for i in range(len(folders))]


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
        shutil.copyfile(FIXTURES / arch / "reference.safetensors", final / "reference.safetensors")
        folders.append(final)
    card = model_card({}, "")
    load = card.split("```python\n")[1].split("```")[0]  # the model card's loading instructions, as they stand
    assert 'repo = "OWNER/NAME"' in load and "trust_remote_code=True" in load
    modules, results = _load_in_subprocess(tmp_path, folders, ("deepspeed", "adaptive_ds"), load)
    for arch, module, (logits, generated) in zip(ARCHITECTURES, modules, results, strict=True):
        assert module.startswith("transformers_modules."), module
        reference = _reference(arch)
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5, msg=arch)
        assert torch.equal(generated, reference["generated"]), arch


@pytest.mark.slow  # a second interpreter
def test_the_auto_classes_importing_adaptive_ds_models_registers_load_final_folders_without_deepspeed(tmp_path):
    folders = [FIXTURES / arch for arch in ARCHITECTURES]
    modules, results = _load_in_subprocess(tmp_path, folders, ("deepspeed",), REGISTERED)
    assert modules == ["adaptive_ds.models.modeling"] * 4
    for arch, (logits, generated) in zip(ARCHITECTURES, results, strict=True):
        reference = _reference(arch)
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5, msg=arch)
        assert torch.equal(generated, reference["generated"]), arch
