"""Folders the project writes, loaded in a second interpreter where neither adaptive_ds nor deepspeed can be imported
(`hidden_packages`), as on a machine with torch and transformers alone: each folder's model class's module, its
logits on given input ids, and optionally its greedy continuation of them.

Each folder comes with its LOAD code, which sets `model` and `tokenizer` from `repo = "OWNER/NAME"`: the Hub model
card's snippet for our folders (`trust_remote_code=True`), `STOCK` for the stock transformers classes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from helpers.common import run_command
from helpers.hidden_packages import without
from safetensors.torch import load_file, save_file

from adaptive_ds.export.hub import model_card

HIDDEN = ("deepspeed", "adaptive_ds")


def model_card_load() -> str:
    """The Hub model card's loading instructions for our folders, as they stand."""
    load = model_card({}, "").split("```python\n")[1].split("```")[0]
    assert 'repo = "OWNER/NAME"' in load and "trust_remote_code=True" in load
    return load


# A stock class's folder, as transformers loads any: its own code, no remote code.
STOCK = """
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "OWNER/NAME"
model = AutoModelForCausalLM.from_pretrained(repo)
tokenizer = AutoTokenizer.from_pretrained(repo)
"""

RUN = """
import json

import torch
from safetensors.torch import load_file, save_file

out_file, ids_file, *folders = sys.argv[1:]
ids = load_file(ids_file)
results, reports = {}, []
for i, (folder, load) in enumerate(zip(folders, LOADS, strict=True)):
    loaded = {}
    exec(load.replace('"OWNER/NAME"', repr(folder)), loaded)
    model, tokenizer = loaded["model"].eval(), loaded["tokenizer"]
    with torch.no_grad():
        results[f"{i}.logits"] = model(input_ids=ids[str(i)]).logits
        if GENERATE:
            results[f"{i}.generated"] = model.generate(ids[str(i)], max_new_tokens=6, min_new_tokens=6,
                                                       do_sample=False)
    reports.append({"module": type(model).__module__, "eos": tokenizer("<eos>").input_ids,
                    "eos_token_id": tokenizer.eos_token_id})
save_file(results, out_file)
print(json.dumps({"folders": reports, "hidden_loaded": loaded_hidden()}))
"""


@dataclass
class Loaded:
    """One folder as the second interpreter loaded it."""

    module: str  # its model class's module
    logits: torch.Tensor
    generated: torch.Tensor | None  # its greedy continuation of the ids (6 tokens), where asked for
    eos: list[int]  # what its tokenizer makes of the text "<eos>"
    eos_token_id: int | None


def load_without_the_package(tmp_path: Path, folders: list[tuple[Path, str, torch.Tensor]], generate: bool = False,
                             hidden: tuple[str, ...] = HIDDEN) -> list[Loaded]:
    """Each (folder, LOAD code, input ids) loaded and run in one interpreter where `hidden` cannot be imported;
    fails the test unless it ends cleanly having imported none of them."""
    ids_file, out = tmp_path / "standalone_ids.safetensors", tmp_path / "standalone_results.safetensors"
    save_file({str(i): ids.clone() for i, (_, _, ids) in enumerate(folders)}, ids_file)
    loads = [load for _, load, _ in folders]
    script = without(hidden, f"LOADS = {loads!r}\nGENERATE = {generate!r}\n" + RUN)
    result = run_command(["python", "-I", "-c", script, str(out), str(ids_file), *(str(f) for f, _, _ in folders)],
                         HF_MODULES_CACHE=str(tmp_path / "standalone_modules"), HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["hidden_loaded"] == []  # nothing needed them
    results = load_file(out)
    return [Loaded(r["module"], results[f"{i}.logits"], results.get(f"{i}.generated"), r["eos"], r["eos_token_id"])
            for i, r in enumerate(report["folders"])]
