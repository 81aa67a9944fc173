"""One set of defaults: a config built directly is the model `--arch` builds, and `config_version` keeps a config
saved before it (final/ folders, tests/fixtures, checkpoint identities) meaning the model it described."""

import json

import pytest
from helpers.common import ROOT

from adaptive_ds.models import ARCHITECTURES, AdaptiveDSConfig
from adaptive_ds.presets import VARIANTS, model_config
from adaptive_ds.training import checkpoint

FINAL = ROOT / "tests" / "fixtures" / "final"
# The fields an architecture's defaults set, and what each architecture ships with (written out: BENCHMARKS.md's
# measured settings), and what they meant before config_version (the field defaults of then)
FIELDS = ("mod_capacity", "mod_layer_interval", "num_experts_per_tok", "moe_drop_tokens")
SHIPPED = {"dense": (0.5, 1, 2, True), "moe": (0.5, 1, 2, True), "mod": (0.125, 2, 2, True),
           "hybrid": (0.125, 2, 1, False)}
UNVERSIONED = (0.5, 1, 2, True)


def _fields(config) -> tuple:
    return tuple(getattr(config, name) for name in FIELDS)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_config_built_directly_is_what_the_arch_flag_builds(arch):
    direct = AdaptiveDSConfig(arch=arch)
    assert _fields(direct) == SHIPPED[arch]
    preset = model_config("debug", arch, 256)  # what `--arch` trains
    assert set(VARIANTS[arch].model) <= set(FIELDS)
    assert {name: getattr(direct, name) for name in VARIANTS[arch].model} == VARIANTS[arch].model
    assert _fields(direct) == _fields(preset)
    sized = AdaptiveDSConfig(**{k: v for k, v in preset.to_dict().items() if k not in FIELDS})  # sizes only
    assert sized.to_dict() == preset.to_dict()
    assert _fields(AdaptiveDSConfig(arch=arch, mod_capacity=0.25)) == (0.25, *SHIPPED[arch][1:])  # set: kept


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_saved_final_folder_without_config_version_means_what_it_meant(arch):
    saved = json.loads((FINAL / arch / "config.json").read_text())
    assert "config_version" not in saved and "moe_eval_capacity_factor" in saved  # written before both changes
    config = AdaptiveDSConfig.from_pretrained(FINAL / arch)
    own = [k for k in vars(AdaptiveDSConfig)["__annotations__"] if k in saved]  # the model's fields it holds
    assert set(FIELDS) <= set(own)
    assert {k: getattr(config, k) for k in own} == {k: saved[k] for k in own}  # each as the folder has it
    assert not hasattr(config, "moe_eval_capacity_factor")  # the removed field is dropped on read
    assert "moe_eval_capacity_factor" not in config.to_dict()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_config_without_config_version_reads_its_unset_fields_as_then(arch):
    old = AdaptiveDSConfig.from_dict({"arch": arch, "hidden_size": 64, "moe_eval_capacity_factor": 2.0})
    assert _fields(old) == UNVERSIONED  # a hand-written mod config without mod_capacity: 0.5 in every block
    assert old.mod_causal_routing == ("predictor" if arch in ("mod", "hybrid") else "router")  # as before
    again = AdaptiveDSConfig.from_dict(json.loads(old.to_json_string()))  # saved again: the same model
    assert again.to_dict() == old.to_dict() and again.config_version == old.config_version == 2
    new = AdaptiveDSConfig.from_dict({"arch": arch, "hidden_size": 64, "config_version": 2})
    assert _fields(new) == SHIPPED[arch] and new.mod_causal_routing == "router"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_config_saved_now_round_trips(arch, tmp_path):
    config = AdaptiveDSConfig(arch=arch, hidden_size=64)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["config_version"] == 2 and all(name in saved for name in FIELDS)
    assert AdaptiveDSConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_checkpoint_identity_from_before_config_version_still_resumes(arch):
    # An identity records every model field (to_dict) but no config_version, and the removed field; the run
    # resuming it records config_version and not the removed field: the same model, so the resume goes on.
    current = {"arch": arch, "model": json.loads(json.dumps(model_config("debug", arch, 256).to_dict()))}
    saved = {"arch": arch, "model": {**{k: v for k, v in current["model"].items() if k != "config_version"},
                                     "moe_eval_capacity_factor": 2.0}}
    checkpoint.check_compatible(checkpoint.with_new_model_fields(saved), current, "ckpt")


def test_a_config_of_a_newer_config_version_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^config_version 3 is newer than this adaptive_ds reads \(2\); upgrade "
                                         r"adaptive_ds to load it$"):
        AdaptiveDSConfig.from_dict({"arch": "dense", "config_version": 3})
