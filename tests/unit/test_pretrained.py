"""--init_from's checks: a bad folder and each Llama / Mixtral feature the model lacks are refused in one line, the
content hash follows the weights and not the path, the model card records the base model, and a TinyLlama-shaped
Llama upcycles to b1 moe and hybrid with the planner's parameter counts (on the meta device). The imported and
upcycled models' logits against transformers' stock models: tests/integration/test_upcycling.py."""

import fnmatch
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.pretrained_folders import llama_folder, mixtral_folder
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from adaptive_ds.export.hub import model_card
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.pretrained import Source, problems
from adaptive_ds.training.checkpoint import CheckpointError, check_compatible

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "final"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("llama"))


def _one_line(found: list[str], *words: str) -> None:
    assert len(found) == 1 and "\n" not in found[0], found
    for word in words:
        assert word in found[0], found


def test_bad_folders_are_refused_in_one_line_each(tmp_path, llama):
    _one_line(problems(str(tmp_path / "missing"), "dense", {}, None), "no such folder")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "n_embd": 32}')
    _one_line(problems(str(gpt2), "dense", {}, None), "'gpt2'", "llama", "mixtral", "adaptive_ds")
    _one_line(problems(str(llama), "dense", {}, "b1"), "preset b1", "hidden_size 32 (preset b1: 2048)",
              "num_hidden_layers 2 (preset b1: 22)", "none matches")
    assert problems(str(llama), "moe", {}, None) == []
    _one_line(problems(str(llama), "dense", {"hidden_size": 64}, None), "hidden_size")
    _one_line(problems(str(FIXTURES / "moe"), "dense", {}, None), "starts --arch moe only")


@pytest.mark.parametrize("feature, words", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_llama_features_the_model_lacks_are_refused_in_one_line_each(tmp_path, feature, words):
    folder = llama_folder(tmp_path / "llama", **feature)
    _one_line(problems(str(folder), "dense", {}, None), words)


def test_a_sliding_window_shorter_than_the_runs_sequence_is_refused(tmp_path):
    folder = mixtral_folder(tmp_path / "mixtral", sliding_window=16)  # the run's seq_len: max_position 64
    _one_line(problems(str(folder), "moe", {}, None), "sliding window of 16 tokens", "seq_len 64")
    assert problems(str(mixtral_folder(tmp_path / "wide", sliding_window=64)), "moe", {}, None) == []
    _one_line(problems(str(mixtral_folder(tmp_path / "plain")), "dense", {}, None), "starts --arch moe only")


def test_the_content_hash_follows_the_weights_not_the_path(tmp_path, llama):
    moved = tmp_path / "moved"
    shutil.copytree(llama, moved)
    assert Source.open(str(moved)).content_hash == Source.open(str(llama)).content_hash
    (moved / "README.md").write_text("not read by a run")
    shutil.copy(moved / "model.safetensors", moved / "consolidated.safetensors")  # weights the run does not read
    assert Source.open(str(moved)).content_hash == Source.open(str(llama)).content_hash
    weights = load_file(moved / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, moved / "model.safetensors")
    assert Source.open(str(moved)).content_hash != Source.open(str(llama)).content_hash


def test_the_model_card_records_the_base_model():
    card = model_card({"arch": "moe", "base_model": "TinyLlama/TinyLlama-1.1B", "base_model_sha256": "sha256:ab"},
                      "adaptive-ds train")
    assert "\nbase_model: TinyLlama/TinyLlama-1.1B\n---" in card and "| base model | TinyLlama/TinyLlama-1.1B" in card
    local = model_card({"arch": "moe", "base_model": "/data/models/tiny", "base_model_sha256": "sha256:ab"}, "x")
    assert "base_model:" not in local and "| base model | tiny (a local folder, sha256:ab) |" in local
    assert "/data/models" not in local
    assert "base model" not in model_card({"arch": "dense"}, "x")


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_a_tinyllama_shaped_llama_upcycles_to_b1_with_the_planners_counts(arch):
    """TinyLlama-1.1B's shape is b1's: on the meta device (no memory), its upcycled model holds the tensors the
    upcycling makes of the stock model's, and the planner's parameter count (so its memory) is that model's."""
    from transformers import LlamaConfig

    from adaptive_ds.ds_config import load
    from adaptive_ds.models.upcycling import initial_tensors
    from adaptive_ds.tools.plan import plan

    tinyllama = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                            num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    source = Source("TinyLlama/TinyLlama-1.1B", "", tinyllama, "llama")
    assert source.matching_preset() == "b1" and source.seq_len("b1") == 2048
    config = source.model_config(arch, "b1", 32000)
    with torch.device("meta"):
        stock = LlamaForCausalLM(tinyllama).state_dict()
        model = AdaptiveDSForCausalLM(config)
    state = dict(initial_tensors(model, "dense", lambda name, index=None: stock[name]))
    own = model.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in own.items()}
    total = sum(p.numel() for p in model.parameters())
    planned = plan("b1", arch, "a100", load("b1_a100.json"))
    assert planned.total_parameters == total
    assert planned.peak_gib > 0


@pytest.mark.parametrize("kind, arch", [("llama", "hybrid"), ("mixtral", "moe")])
def test_the_planner_plans_the_model_an_init_from_run_trains(tmp_path, capsys, kind, arch):
    import json

    from helpers.pretrained_folders import DEBUG

    from adaptive_ds.tools.plan import main

    folder = (llama_folder if kind == "llama" else mixtral_folder)(tmp_path / kind, shape=DEBUG)
    main(["--init_from", str(folder), "--arch", arch, "--gpu", "t4", "--json"])
    planned = json.loads(capsys.readouterr().out)
    source = Source.open(str(folder))
    with torch.device("meta"):
        model = AdaptiveDSForCausalLM(source.model_config(arch, "debug", source.config.vocab_size))
    assert planned["preset"] == "debug" and planned["total_parameters"] == sum(p.numel() for p in model.parameters())
    with pytest.raises(SystemExit, match="preset b1 contradicts"):
        main(["--init_from", str(folder), "--arch", arch, "--gpu", "t4", "--preset", "b1"])


def test_the_planner_reads_a_hub_models_config_without_fetching_its_weights(tmp_path, capsys, monkeypatch):
    """A plan of TinyLlama needs its config.json, not its 2.2 GB of weights: the planner asks the HF cache (or the
    Hub) for the config, tokenizer and index files only, where a training run then fetches the weights too."""
    import json

    import huggingface_hub
    from helpers.pretrained_folders import DEBUG

    from adaptive_ds.pretrained import CHAT_FILES, SOURCE_FILES
    from adaptive_ds.tools.plan import main

    folder = llama_folder(tmp_path / "snapshot", shape=DEBUG)
    asked = []

    def snapshot(repo_id, allow_patterns):
        asked.append(allow_patterns)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    main(["--init_from", "TinyLlama/TinyLlama_v1.1", "--arch", "moe", "--gpu", "t4", "--json"])
    assert json.loads(capsys.readouterr().out)["preset"] == "debug"
    files = [*SOURCE_FILES, *CHAT_FILES]  # config, tokenizer, index; chat template and generation config
    assert asked == [files] and not any(fnmatch.fnmatch("model.safetensors", p) for p in asked[0])
    Source.open("TinyLlama/TinyLlama_v1.1")  # a run's source: the weights the index names, after the config
    assert asked[1:] == [files, ["model.safetensors"]]


def test_the_preset_is_the_folders_shape_when_none_is_named(tmp_path, llama):
    import json

    from helpers.pretrained_folders import DEBUG

    from adaptive_ds.training.arguments import ConfigError, parse

    config = tmp_path / "ds.json"  # a ds_config whose block names no preset
    config.write_text(json.dumps({"adaptive_ds": {"max_steps": 2, "tokenizer": "bpe:64"},
                                  "train_micro_batch_size_per_gpu": 2,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    debug_shaped = llama_folder(tmp_path / "debug", shape=DEBUG)
    settings, _ = parse(["--ds_config", str(config), "--init_from", str(debug_shaped), "--preset", "debug"], 1)
    assert settings.preset == "debug" and settings.tokenizer == str(debug_shaped)  # the folder's, not the block's
    settings, _ = parse(["--ds_config", str(config), "--init_from", str(debug_shaped)], 1)
    assert settings.preset == "debug"
    settings, _ = parse(["--ds_config", str(config), "--init_from", str(llama), "--arch", "moe"], 1)
    assert settings.preset is None  # no preset has the tiny shape: none is claimed
    with pytest.raises(ConfigError, match="preset b1 contradicts") as error:
        parse(["--ds_config", str(config), "--init_from", str(debug_shaped), "--preset", "b1"], 1)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="preset debug contradicts"):  # named by the ds_config's block
        block = tmp_path / "named.json"
        block.write_text(json.dumps({**json.loads(config.read_text()), "adaptive_ds": {"preset": "debug"}}))
        parse(["--ds_config", str(block), "--init_from", str(llama)], 1)


def test_a_hub_id_is_resolved_through_the_hf_cache_and_a_missing_one_refused_in_one_line(monkeypatch, llama):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from adaptive_ds.pretrained import CHAT_FILES, SOURCE_FILES, resolve

    asked = []

    def snapshot(repo_id, allow_patterns):
        asked.append((repo_id, allow_patterns))
        return str(llama)  # the snapshot folder the cache holds

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert resolve("TinyLlama/TinyLlama_v1.1") == str(llama)
    # config, tokenizer (chat template and generation config too) and index first, then only the weights they name:
    # not every *.safetensors of the repository
    hub_id = "TinyLlama/TinyLlama_v1.1"
    assert asked == [(hub_id, [*SOURCE_FILES, *CHAT_FILES]), (hub_id, ["model.safetensors"])]
    assert not any(fnmatch.fnmatch("consolidated.safetensors", p) for p in [*SOURCE_FILES, *CHAT_FILES])

    def offline(repo_id, allow_patterns):
        raise LocalEntryNotFoundError("not in the cache and the Hub cannot be reached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    _one_line(problems("TinyLlama/TinyLlama_v1.1", "dense", {}, None), "no Hub model in the HF cache")


def test_upcycle_noise_without_a_dense_model_upcycled_to_experts_is_refused(tmp_path, llama):
    """The noise perturbs the expert copies of an upcycled dense model; anywhere else it would do nothing."""
    import json

    from adaptive_ds.training.arguments import ConfigError, parse

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"adaptive_ds": {"max_steps": 2}, "train_micro_batch_size_per_gpu": 2,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    base = ["--ds_config", str(config), "--upcycle_noise", "0.01"]
    for extra in ([], ["--init_from", str(llama), "--arch", "mod"],
                  ["--init_from", str(mixtral_folder(tmp_path / "mixtral")), "--arch", "moe"]):
        with pytest.raises(ConfigError, match="upcycle_noise 0.01") as error:
            parse(base + extra, 1)
        assert "\n" not in str(error.value)
    settings, _ = parse(base + ["--init_from", str(llama), "--arch", "hybrid"], 1)
    assert settings.upcycle_noise == 0.01


def test_loading_the_weights_does_not_hash_the_folder(monkeypatch, llama):
    """Every rank loads the weights, rank 0 alone hashes the folder for the run identity: a hash in the load would
    make every rank read every file of the source once more."""
    import adaptive_ds.pretrained as pretrained_module

    def refuse(folder):
        raise AssertionError("the load hashed the folder")

    source = Source.open(str(llama))
    monkeypatch.setattr(pretrained_module, "content_hash", refuse)
    model = AdaptiveDSForCausalLM(source.model_config("dense", "debug", source.config.vocab_size))
    source.load_into(model)
    assert torch.equal(model.model.norm.weight, load_file(llama / "model.safetensors")["model.norm.weight"])


def test_a_resume_of_an_unchanged_folder_takes_the_recorded_hash_without_reading_the_weights(tmp_path, llama,
                                                                                              monkeypatch):
    """The identity records each file's name, size and mtime_ns beside the hash: a resume that finds the same list
    takes the recorded hash (a 93 GB folder is not read again); a changed list is hashed, and a new hash shows."""
    import adaptive_ds.pretrained as pretrained_module

    folder = tmp_path / "llama"
    shutil.copytree(llama, folder)
    recorded = Source.open(str(folder)).identity(None)
    assert recorded["sha256"] == Source.open(str(llama)).content_hash
    assert ["model.safetensors", os.path.getsize(folder / "model.safetensors"),
            os.stat(folder / "model.safetensors").st_mtime_ns] in recorded["files"]

    def refuse(folder):
        raise AssertionError("the resume read the weights again")

    with monkeypatch.context() as patched:
        patched.setattr(pretrained_module, "content_hash", refuse)
        assert Source.open(str(folder)).identity(recorded) == recorded
    os.utime(folder / "config.json")  # touched, the same content: hashed again, and still the run's source
    assert Source.open(str(folder)).identity(recorded)["sha256"] == recorded["sha256"]
    # the same weights by another path (relative, or moved): the resume's identity check takes them by their hash,
    # and the new record names the new path, so that the next resume reads nothing again
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    now = Source.open(os.path.relpath(moved)).identity(recorded)
    assert now["sha256"] == recorded["sha256"] and now["source"] == os.path.relpath(moved)
    check_compatible({"base_model": recorded}, {"base_model": now}, "")
    with monkeypatch.context() as patched:
        patched.setattr(pretrained_module, "content_hash", refuse)
        assert Source.open(os.path.relpath(moved)).identity(now) == now
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    size = os.path.getsize(folder / "model.safetensors")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    stat = os.stat(folder / "model.safetensors")
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert os.path.getsize(folder / "model.safetensors") == size  # only the content and mtime changed
    changed = Source.open(str(folder)).identity(recorded)
    assert changed["sha256"] != recorded["sha256"]
    with pytest.raises(CheckpointError, match="base_model.sha256"):
        check_compatible({"base_model": recorded}, {"base_model": changed}, "")


def test_a_folder_of_no_presets_shape_trains_at_its_own_context_up_to_2048(tmp_path):
    """No preset named and none of the folder's shape: seq_len is max_position_embeddings up to 2048 (not the default
    preset's 256), the expert count and top-k the architecture's defaults, and the model card claims no preset."""
    long = Source.open(str(llama_folder(tmp_path / "long", max_position_embeddings=4096)))
    short = Source.open(str(llama_folder(tmp_path / "short", max_position_embeddings=1024)))
    assert long.matching_preset() is None and (long.seq_len(None), short.seq_len(None)) == (2048, 1024)
    assert (long.seq_len("debug"), short.seq_len("b1")) == (256, 1024)  # a named preset's, up to the folder's
    config = long.model_config("moe", None, long.config.vocab_size)
    assert (config.num_local_experts, config.num_experts_per_tok, config.max_position_embeddings) == (8, 2, 4096)
    card = model_card({"arch": "dense", "preset": None, "base_model": "org/tiny", "base_model_sha256": "sha256:ab"},
                      "x")
    assert "None" not in card and "debug" not in card and "\n# adaptive_ds dense\n" in card
    assert "| preset | none (the shape of the weights it started from) |" in card


def test_an_init_from_checkpoint_saved_before_the_config_recorded_its_family_and_token_ids_resumes():
    """`source_model_type` and the special tokens' ids are what the config records beside the model's function: an
    identity without them (or with the token ids of before) resumes; a field of the function still does not."""
    from adaptive_ds.models import AdaptiveDSConfig
    from adaptive_ds.training.checkpoint.identity import with_new_model_fields

    now = AdaptiveDSConfig(source_model_type="llama", bos_token_id=1, pad_token_id=2).to_dict()
    before = {k: v for k, v in now.items() if k != "source_model_type"} | {"bos_token_id": None, "pad_token_id": None}
    check_compatible(with_new_model_fields({"model": before}), {"model": now}, "")
    with pytest.raises(CheckpointError, match="model.hidden_size"):
        check_compatible(with_new_model_fields({"model": {**before, "hidden_size": 64}}), {"model": now}, "")


def test_an_embedded_tier_starts_from_a_folder_of_its_own_tokenizer_and_no_other():
    """The data's tokenizer must be the folder's: a run's final/ on the embedded corpus (tests/fixtures/final, trained
    on its base tier) continues on that tier; the hard tier, whose tokenizer is another, is refused in one line that
    says what to start from."""
    from adaptive_ds.data.tokenizer import embedded_tokenizer

    source = Source.open(str(FIXTURES / "dense"))
    source.check_tokenizer(embedded_tokenizer(), "embedded")
    with pytest.raises(ValueError) as error:
        source.check_tokenizer(embedded_tokenizer("hard"), "embedded:hard")
    _one_line([str(error.value)], "is not the tokenizer of init_from", "embedded:hard has its own tokenizer",
              "the final/ of a run on embedded:hard")
