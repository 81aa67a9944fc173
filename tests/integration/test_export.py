"""Export from DeepSpeed checkpoints (ZeRO-3 shards gathered), every exported folder (ours, stock Mixtral and Llama)
loading without the package, bad input refused in one line, and generation from a checkpoint."""

import json

import pytest
import torch
from helpers.common import ROOT, write_ds_config
from helpers.standalone_load import STOCK, load_without_the_package, model_card_load
from transformers import AutoModelForCausalLM

from adaptive_ds.ds_checkpoint import load_checkpoint
from adaptive_ds.export.convert import main
from adaptive_ds.generate import main as generate_main
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.training import train

FIXTURES = ROOT / "tests" / "fixtures" / "final"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_run")
    config = write_ds_config(tmp, zero_stage=2, arch="moe", max_steps=3, log_steps=3)
    train(["--ds_config", config, "--output_dir", str(tmp / "run")])
    return tmp / "run"


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_export_from_a_checkpoint_equals_the_final_model(moe_run, tmp_path):
    out = tmp_path / "exported"
    main([str(moe_run), str(out)])
    assert (out / "model.safetensors").exists()
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))
    ids = torch.randint(5, 100, (2, 20))
    exported = AutoModelForCausalLM.from_pretrained(out)
    final = AutoModelForCausalLM.from_pretrained(moe_run / "final")
    torch.testing.assert_close(_logits(exported, ids), _logits(final, ids), rtol=0, atol=0)
    model, tokenizer = load_checkpoint(str(moe_run / "checkpoints"))
    assert tokenizer.eos_token == "<eos>" and model.config.moe_ep_size == 1


def test_export_refuses_a_used_folder_and_a_non_checkpoint(moe_run, tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="already holds files"):
        main([str(moe_run), str(used)])
    with pytest.raises(SystemExit, match="is not a checkpoint"):
        main([str(tmp_path), str(tmp_path / "new")])
    assert (used / "keep.txt").read_text() == "x"


@pytest.mark.slow  # a second interpreter
def test_exported_folders_load_with_torch_and_transformers_alone(moe_run, tmp_path):
    """`python -m adaptive_ds.export`'s folders where neither adaptive_ds nor deepspeed can be imported: ours (with
    remote code, as the model card says) and the stock Mixtral from the MoE run's checkpoint, and the stock Llama from
    a dense final/, each with the package-side model's logits and greedy continuation."""
    exports = [  # --to, its source, how it loads, its model class's module, the package-side model
        ("adaptive_ds", moe_run, model_card_load(), "transformers_modules.", moe_run / "final"),
        ("mixtral", moe_run, STOCK, "transformers.models.mixtral.", moe_run / "final"),
        ("llama", FIXTURES / "dense", STOCK, "transformers.models.llama.", FIXTURES / "dense"),
        ("mistral", FIXTURES / "dense", STOCK, "transformers.models.mistral.", FIXTURES / "dense"),
    ]
    for to, src, *_ in exports:
        main(["--to", to, str(src), str(tmp_path / to)])
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    loaded = load_without_the_package(tmp_path, [(tmp_path / to, load, ids) for to, _, load, *_ in exports],
                                      generate=True)
    for (to, _, _, module, reference), result in zip(exports, loaded, strict=True):
        assert result.module.startswith(module), (to, result.module)
        assert result.eos == [result.eos_token_id], to  # the tokenizer came along
        model = AdaptiveDSForCausalLM.from_pretrained(reference).eval()
        torch.testing.assert_close(result.logits, _logits(model, ids), rtol=0, atol=1e-5, msg=to)
        greedy = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert torch.equal(result.generated, greedy), to


def test_generate_cli_samples_from_a_checkpoint(moe_run, capsys):
    generate_main([str(moe_run / "final"), "[count] 3 4", "--max_new_tokens", "4", "--temperature", "0.8",
                   "--top_k", "5", "--top_p", "0.9"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[count] 3 4") and 3 < len(line.split()) <= 7  # generation may stop at <eos>


@pytest.mark.slow
def test_zero3_shards_are_gathered_for_final_and_export(tmp_path, run_command, tiny_ds_config):
    config = tiny_ds_config(zero_stage=3, max_steps=2)
    out = tmp_path / "run"
    result = run_command(["torchrun", "--nproc_per_node", "2", "launchers/train.py", "--ds_config",
                          config, "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    main([str(out), str(tmp_path / "exported")])
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    summary = json.loads((out / "summary.json").read_text())
    assert sum(p.numel() for p in final.parameters()) == summary["total_parameters"]
    ids = torch.randint(5, 100, (1, 12))
    torch.testing.assert_close(_logits(exported, ids), _logits(final, ids), rtol=0, atol=0)
