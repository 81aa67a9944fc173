"""A user's fine-tuning of our final/ folders with transformers' Trainer and its own DeepSpeed integration
(`TrainingArguments(deepspeed=...)`, ZeRO-2), where adaptive_ds is not installed: every architecture trains."""

import json

import pytest
from helpers.common import ROOT, free_port
from helpers.hidden_packages import without
from transformers import AutoTokenizer

from adaptive_ds.export.final import save_with_code
from adaptive_ds.models import ARCHITECTURES, AdaptiveDSForCausalLM

FIXTURES = ROOT / "tests" / "fixtures" / "final"
HELPER = ROOT / "tests" / "helpers" / "hf_trainer_finetune.py"
STEPS = 8


@pytest.mark.slow  # DeepSpeed engines in a second interpreter
def test_the_trainers_deepspeed_integration_fine_tunes_every_architecture(tmp_path, run_command):
    folders = []
    for arch in ARCHITECTURES:  # each trained checkpoint as a final/ folder with the model's code
        folder = tmp_path / arch
        save_with_code(AdaptiveDSForCausalLM.from_pretrained(FIXTURES / arch),
                       AutoTokenizer.from_pretrained(FIXTURES / arch), str(folder))
        folders.append(str(folder))
    out = tmp_path / "losses.json"
    script = without(("adaptive_ds",), f"import runpy\nsys.argv = {[str(HELPER), str(out), str(STEPS), *folders]!r}\n"
                                       f"runpy.run_path({str(HELPER)!r}, run_name='__main__')\n")
    # what a launcher sets: accelerate and DeepSpeed on CPU build a gloo process group from them
    launcher = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = run_command(["python", "-I", "-c", script], HF_MODULES_CACHE=str(tmp_path / "modules"),
                         HF_HUB_OFFLINE="1", **launcher)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = json.loads(out.read_text())
    for arch, folder in zip(ARCHITECTURES, folders, strict=True):
        report = reports[folder]
        assert (report["engine"], report["zero_stage"]) == ("DeepSpeedEngine", 2), arch
        steps = report["losses"]
        assert len(steps) == STEPS, arch
        # the same 8 sequences every other step: the loss falls as the model learns them
        assert sum(steps[-2:]) < sum(steps[:2]) - 0.2, (arch, steps)
