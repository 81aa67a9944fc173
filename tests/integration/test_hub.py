"""--push_to_hub against a local stand-in of the Hub API (no network): the final and save-time pushes upload the
model and its card; a failed push leaves the local run intact."""

import json
import os

from helpers.common import write_ds_config
from helpers.local_hub import LocalHub

from adaptive_ds.training import train


def _config(tmp_path, **block):
    return write_ds_config(tmp_path, **{"arch": "moe", "log_steps": 2, **block})


def test_final_and_save_time_pushes_upload_the_model_and_card(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    hub = LocalHub(tmp_path / "hub")
    out = tmp_path / "run"
    summary = train(["--ds_config", _config(tmp_path, save_steps=2), "--output_dir", str(out),
                     "--push_to_hub", "me/tiny-moe", "--push_every_save"], hub_api=hub)
    assert [message for message, _ in hub.commits] == ["checkpoint at step 2", "final model"]
    final_files = hub.commits[-1][1]
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(final_files)
    for commit, (_, files) in enumerate(hub.commits):  # both pushes carry the model code and its auto_map
        assert {"configuration.py", "modeling.py", "moe.py", "mod.py"} <= set(files)
        config = json.loads((tmp_path / "hub" / "me/tiny-moe" / f"commit{commit}" / "config.json").read_text())
        assert config["auto_map"] == {"AutoConfig": "configuration.AdaptiveDSConfig",
                                      "AutoModel": "modeling.AdaptiveDSModel",
                                      "AutoModelForCausalLM": "modeling.AdaptiveDSForCausalLM"}
    card = (tmp_path / "hub" / "me/tiny-moe" / "commit1" / "README.md").read_text()
    assert "| architecture | moe |" in card and "| preset | debug |" in card
    assert f"{summary['total_parameters']:,}" in card and f"{summary['validation_loss']:.4f}" in card
    assert "Command:" in card and "trust_remote_code=True" in card
    assert summary["hub_push"] == {"repo": "me/tiny-moe", "pushed": ["checkpoint at step 2", "final model"],
                                   "failures": []}
    for root, _, files in os.walk(tmp_path):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith((".pt", ".safetensors", ".png")) and "tensorboard" not in path:
                assert "hf_secret_token_value" not in open(path, errors="ignore").read(), path


def test_a_failed_push_is_reported_and_the_local_run_is_intact(tmp_path):
    out = tmp_path / "run"
    summary = train(["--ds_config", _config(tmp_path), "--output_dir", str(out), "--push_to_hub", "me/x"],
                    hub_api=LocalHub(tmp_path / "hub", fail=True))
    assert summary["hub_push"]["pushed"] == [] and "hub unreachable" in summary["hub_push"]["failures"][0]
    assert (out / "final" / "model.safetensors").exists() and (out / "checkpoints" / "latest").exists()
