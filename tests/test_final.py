"""final/ is self-contained: it loads with trust_remote_code=True where adaptive_ds cannot be imported."""

import json

import pytest
import torch
from conftest import run_command, tiny_config

from adaptive_ds.data.tokenizer import embedded_tokenizer
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.presets import pad_vocab
from adaptive_ds.training.final import save_final

# Runs in a fresh interpreter: -I drops PYTHONPATH and the working directory from sys.path, and the None entry
# blocks the editable install's finder too, so any `import adaptive_ds` in the loaded code would fail.
REMOTE_LOAD = """
import sys
sys.modules["adaptive_ds"] = None
try:
    import adaptive_ds
    sys.exit("adaptive_ds is importable")
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, ids_file, out_file = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
assert tokenizer("<eos>").input_ids == [tokenizer.eos_token_id]
with torch.no_grad():
    logits = model(input_ids=torch.load(ids_file)).logits
torch.save(logits, out_file)
loaded = sorted(name for name, module in sys.modules.items() if name.startswith("adaptive_ds") and module)
print(type(model).__module__, type(model).__name__, loaded)
"""


@pytest.mark.slow  # a second interpreter
def test_final_folder_loads_without_the_package_and_gives_the_same_logits(tmp_path):
    tokenizer = embedded_tokenizer()
    config = tiny_config("hybrid", vocab_size=pad_vocab(len(tokenizer)), moe_drop_tokens=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = AdaptiveDSForCausalLM(config)
    for name, param in model.named_parameters():  # routers that route unevenly, a MoD router that skips tokens
        if "gate.wg" in name or name.endswith("router.weight"):
            torch.nn.init.normal_(param, std=1.0)
    final = tmp_path / "final"
    save_final(model, tokenizer, str(final), is_writer=True)
    assert "auto_map" not in model.config.to_dict()  # the live model's config is left as it was
    assert json.loads((final / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "modeling.AdaptiveDSForCausalLM"

    ids = torch.randint(2, config.vocab_size, (2, 16))
    torch.save(ids, tmp_path / "ids.pt")
    result = run_command(["python", "-I", "-c", REMOTE_LOAD, str(final), str(tmp_path / "ids.pt"),
                          str(tmp_path / "logits.pt")], HF_MODULES_CACHE=str(tmp_path / "modules"),
                         HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    module, name, loaded = result.stdout.strip().splitlines()[-1].split(" ", 2)
    assert module.startswith("transformers_modules.") and name == "AdaptiveDSForCausalLM" and loaded == "[]"
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=0)
