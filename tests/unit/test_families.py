"""The model family registry (adaptive_ds/models/families): a config's model_type finds its family and the
architecture it imports as, an unknown one is refused in one line naming the supported ones, each stock family's
weights map to ours and back to the stock model's state dict tensor for tensor, and a family registered from
outside is one `--init_from` and `--to` take without a change to pretrained.py or export/convert.py."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from helpers.architecture_branches import architecture_branches
from helpers.common import tiny_config
from helpers.own_mlp import GELUMLP
from helpers.pretrained_folders import llama_folder, perturbed
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from adaptive_ds import pretrained
from adaptive_ds.export.convert import convert
from adaptive_ds.export.final import model_source_files
from adaptive_ds.models import ARCHITECTURES, AdaptiveDSConfig, AdaptiveDSForCausalLM
from adaptive_ds.models.families import ADAPTIVE_DS, FAMILIES, LLAMA, MIXTRAL, exportable, family_of, register_family
from adaptive_ds.models.spec import ARCH_SPECS, ArchitectureSpec, register_architecture
from adaptive_ds.models.upcycling import (
    STRUCTURAL_FIELDS,
    copies_experts,
    fixed_fields,
    initial_tensors,
    starts,
    upcycled_settings,
    upcycles,
)
from adaptive_ds.pretrained import Source

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5)  # vocab a multiple of 64: no padding


def test_a_configs_model_type_finds_its_family_and_architecture():
    for config, family, arch in [(LlamaConfig(**SHAPE), LLAMA, "dense"), (MixtralConfig(**SHAPE), MIXTRAL, "moe"),
                                 (AdaptiveDSConfig(arch="hybrid"), ADAPTIVE_DS, "hybrid")]:
        assert family_of(config.model_type) is family and family.architecture(config) == arch
    assert list(FAMILIES)[:7] == ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "adaptive_ds"]
    assert exportable()[:6] == ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"]
    assert "adaptive_ds" not in exportable()  # ours exports as itself (export.final), not through a conversion
    for family in FAMILIES.values():  # the stock classes as transformers' Auto classes name them
        if family is ADAPTIVE_DS:
            continue
        assert family.class_name == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family.model_type]
        assert family.config_class is CONFIG_MAPPING[family.model_type]


def test_an_unknown_model_type_is_refused_in_one_line_naming_the_supported_ones():
    with pytest.raises(ValueError) as error:
        family_of("gpt2")
    message = str(error.value)
    assert "\n" not in message and "'gpt2'" in message
    assert ("llama (LlamaForCausalLM), mistral (MistralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 "
            "(Qwen3ForCausalLM), mixtral (MixtralForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), adaptive_ds "
            "(AdaptiveDSForCausalLM)") in message
    with pytest.raises(ValueError, match="registered already") as error:
        register_family(LLAMA)
    assert "\n" not in str(error.value)


def _imported(family, stock_config, stock_state: dict, source_state: dict | None = None) -> AdaptiveDSForCausalLM:
    """An adaptive_ds model of the architecture `family` imports as, its weights read through the family's
    mapping from `source_state` (the tensors as a folder holds them; default: the stock model's own)."""
    source_state = stock_state if source_state is None else source_state

    def read(name, index=None):
        return source_state[name] if index is None else source_state[name][index]

    arch = family.architecture(stock_config)
    model = AdaptiveDSForCausalLM(Source("stock", "", stock_config, family.model_type).model_config(
        arch, None, stock_config.vocab_size))
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in initial_tensors(model, arch, family.reader(read, set(source_state))):
            own[name].copy_(tensor)
    return model


def _assert_same_state(exported: dict, stock: dict) -> None:
    assert exported.keys() == stock.keys()
    different = [name for name in stock if not torch.equal(exported[name], stock[name])]
    assert different == []


def test_a_llama_round_trips_through_adaptive_ds_tensor_for_tensor():
    torch.manual_seed(0)
    stock = perturbed(LlamaForCausalLM(LlamaConfig(**SHAPE)))
    model = _imported(LLAMA, stock.config, stock.state_dict())
    assert model.config.arch == "dense" and model.config.rms_norm_eps == 1e-5
    _assert_same_state(LLAMA.to_stock(model).state_dict(), stock.state_dict())


@pytest.mark.parametrize("saved", [False, True], ids=["in-memory layout", "saved layout"])
def test_a_mixtral_round_trips_through_adaptive_ds_tensor_for_tensor(tmp_path, saved):
    """Mixtral's experts as transformers holds them (gate_up_proj stacked) and as save_pretrained writes them
    (block_sparse_moe.experts.E.w1 / w2 / w3): transformers' own conversion is the reference for the second."""
    torch.manual_seed(0)
    stock = perturbed(MixtralForCausalLM(MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)))
    folder = None
    if saved:
        stock.save_pretrained(tmp_path)
        folder = load_file(tmp_path / "model.safetensors")
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in folder
    model = _imported(MIXTRAL, stock.config, stock.state_dict(), folder)
    assert (model.config.arch, model.config.num_local_experts, model.config.num_experts_per_tok) == ("moe", 4, 2)
    assert not model.config.moe_drop_tokens  # Mixtral's routing: dropless
    _assert_same_state(MIXTRAL.to_stock(model).state_dict(), stock.state_dict())


def test_the_upcycled_settings_keep_the_first_forward_pass_the_dense_models():
    assert upcycled_settings("dense", "mod", {"num_experts_per_tok": 2}) == {
        "mod_straight_through": True, "moe_renormalize_top1": False}
    assert upcycled_settings("dense", "hybrid", {"num_experts_per_tok": 1}) == {
        "mod_straight_through": True, "moe_renormalize_top1": True}
    assert upcycled_settings("dense", "moe", {"num_experts_per_tok": 1, "moe_expert_granularity": 2}) == {
        "mod_straight_through": False, "moe_renormalize_top1": False}  # top-2 of the fine-grained experts
    assert upcycled_settings("dense", "dense", {}) == upcycled_settings("moe", "moe", {}) == {}


@pytest.fixture
def toy_family():
    """Llama's entry under another model_type, registered from outside the package for the test's length."""
    toy = register_family(dataclasses.replace(LLAMA, model_type="toy_llama", class_name="ToyLlamaForCausalLM"))
    yield toy
    del FAMILIES["toy_llama"]


def test_a_registered_family_is_one_init_from_and_the_export_take(tmp_path, toy_family):
    folder = llama_folder(tmp_path / "toy")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "toy_llama"}))
    source = Source.open(str(folder))
    assert source.family is toy_family and source.arch == "dense"
    assert source.problems("moe", {}, None) == []
    assert "starts --arch moe only" not in " ".join(source.problems("hybrid", {}, None))
    model = AdaptiveDSForCausalLM(source.model_config("hybrid", None, source.config.vocab_size))
    source.load_into(model)
    stock = load_file(folder / "model.safetensors")
    attention = {name.replace(".block.", "."): tensor for name, tensor in model.state_dict().items()
                 if ".self_attn." in name}
    assert len(attention) == 8 and all(torch.equal(tensor, stock[name]) for name, tensor in attention.items())
    assert "toy_llama" in exportable()
    dense = AdaptiveDSForCausalLM(source.model_config("dense", None, source.config.vocab_size))
    source.load_into(dense)
    assert torch.equal(convert(dense, "toy_llama").model.norm.weight, stock["model.norm.weight"])


def test_the_standalone_model_code_does_not_carry_the_registry():
    """final/ folders copy modeling.py and what it imports (for users without adaptive_ds); the registry, which
    imports every stock family's transformers classes, is the harness's, not the model's."""
    models = Path(model_source_files()[0]).parent
    assert not any(Path(path).relative_to(models).parts[0] == "families" for path in model_source_files())
    assert {Path(path).name for path in model_source_files()} >= {"modeling.py", "configuration.py"}


def test_init_from_and_the_export_tell_no_architecture_or_family_apart_by_name():
    """pretrained.py and export/ ask the registry (and the upcycling rules); a family added in models/ needs no
    branch there (the detector knows the families' names beside the architectures')."""
    assert [what for _, what, _ in architecture_branches('if kind == "mixtral" or {"llama": 1}.get(kind): pass')] \
        == ["compares with mixtral", "looks up a table keyed by names"]
    assert architecture_branches('if kind == AdaptiveDSConfig.model_type and x == "dense model": pass') == []
    package = Path(pretrained.__file__).parent
    files = [package / "pretrained.py", *sorted((package / "export").glob("*.py"))]
    assert {path: architecture_branches(path.read_text()) for path in files} == dict.fromkeys(files, [])


def test_the_upcycling_rules_name_which_source_starts_which_architecture():
    assert [arch for arch in ARCHITECTURES if starts("dense", arch)] == list(ARCHITECTURES)
    assert [arch for arch in ARCHITECTURES if starts("mod", arch)] == ["mod"]
    assert [arch for arch in ARCHITECTURES if copies_experts("dense", arch)] == ["moe", "hybrid"]
    assert not copies_experts("moe", "moe")
    assert "moe_expert_granularity" in fixed_fields("moe") and "moe_expert_granularity" not in fixed_fields("dense")


@pytest.fixture
def own_mlp():
    """An architecture registered with an MLP of its own for the test's length (its name)."""
    yield register_architecture(ArchitectureSpec("gelu", mlp=GELUMLP)).name
    ARCH_SPECS.pop("gelu")


def test_an_architecture_with_its_own_mlp_is_started_by_no_plain_source_and_exports_to_no_llama(tmp_path, own_mlp):
    # the rules agree: a dense model starts the SwiGLU architectures only, and upcycles into none of its own MLP
    assert not starts("dense", own_mlp) and not upcycles("dense", own_mlp) and not copies_experts("dense", own_mlp)
    assert upcycled_settings("dense", own_mlp, {"num_experts_per_tok": 1}) == {}
    assert starts(own_mlp, own_mlp) and fixed_fields(own_mlp) == STRUCTURAL_FIELDS
    assert not starts(own_mlp, "dense")
    folder = llama_folder(tmp_path / "llama")
    source = Source.open(str(folder))
    assert source.problems(own_mlp, {}, None) == [
        f"init_from {str(folder)!r} is a dense model (LlamaForCausalLM); it starts --arch dense, moe, mod, hybrid; "
        f"--arch gelu has an MLP of its own, which a dense model has no weights for"]
    model = AdaptiveDSForCausalLM(tiny_config(own_mlp))  # exporting it: refused in one line, not a load error
    for model_type, reason in (("llama", "arch is 'gelu': its MLP is its own, not a Llama's SwiGLU"),
                               ("mixtral", "arch is 'gelu', not 'moe'")):
        with pytest.raises(ValueError, match=re.escape(reason)) as refused:
            convert(model, model_type)
        assert "\n" not in str(refused.value)
