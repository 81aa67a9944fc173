"""The `Family` record and the registry of families, looked up by a Hugging Face config's `model_type`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedConfig, PreTrainedModel

from ..configuration import AdaptiveDSConfig
from ..upcycling import Reader

# the model fields a config fixes under the same name in Llama's and in adaptive_ds's configs
NAMED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings")


def _no_fields(config: PreTrainedConfig) -> dict:
    return {}


def _no_settings(config: PreTrainedConfig) -> dict | None:
    return None


def _no_problems(config: PreTrainedConfig) -> list[str]:
    return []


def _same_names(read: Reader, names: set[str]) -> Reader:
    return read


@dataclass(frozen=True)
class Family:
    """A family of pretrained models a run starts from (`--init_from`) and, where `to_stock` is set, a stock class
    a trained model exports to (`python -m adaptive_ds.export --to MODEL_TYPE`).

    Importing: a folder whose config.json has `model_type` is read with `config_class`; its model is an adaptive_ds
    model of architecture `imports_as` (None: the folder's own `arch`), whose config takes `fields(config)` (shape,
    norm, RoPE and context: what every architecture started from it keeps) and, over the architecture's variant
    defaults, `routing(config)` (the family's routing, where it has one). `own_settings(config)` is the whole
    AdaptiveDSConfig of a folder that is one of ours (None for a stock family), which a model of the same
    architecture takes as it is. `feature_problems(config)` names each feature of the folder the model does not
    have, one line each without the folder's name ("has attention_bias true; ..."). `reader(read, names)` maps the
    weights: given the folder's reader (tensor name -> tensor) and its tensor names, it returns a reader by the
    tensor names of an adaptive_ds model of `imports_as` (experts by their global index).

    Exporting: `export_problem(config)` says why a model cannot be one of the family's stock models (None: it can),
    and `to_stock(model)` builds that stock model with the same logits, or raises ValueError in one line.
    """

    model_type: str  # the HF config's model_type, and the name of the family (`--to`, messages)
    class_name: str  # the stock class: "LlamaForCausalLM"
    config_class: type[PreTrainedConfig]
    imports_as: str | None  # an architecture of AdaptiveDSConfig; None: the folder's config says (`arch`)
    fields: Callable[[PreTrainedConfig], dict]
    routing: Callable[[PreTrainedConfig], dict] = _no_fields
    own_settings: Callable[[PreTrainedConfig], dict | None] = _no_settings
    feature_problems: Callable[[PreTrainedConfig], list[str]] = _no_problems
    reader: Callable[[Reader, set[str]], Reader] = _same_names
    export_problem: Callable[[AdaptiveDSConfig], str | None] | None = None
    to_stock: Callable[[PreTrainedModel], PreTrainedModel] | None = None
    # the family an MoE model upcycled from one of this family's dense models exports to (`--to auto`): the MoE
    # sibling with the same attention (Llama's and Mistral's: Mixtral; Qwen3's: Qwen3-MoE); None: none
    upcycled_model_type: str | None = None

    def architecture(self, config: PreTrainedConfig) -> str:
        """The architecture the folder of `config` holds."""
        return self.imports_as or config.arch


FAMILIES: dict[str, Family] = {}  # model_type -> family, in the order they were registered


def register_family(family: Family, replace: bool = False) -> Family:
    """Add `family` to the registry under its model_type; a second family of a model_type needs `replace`."""
    if family.model_type in FAMILIES and not replace:
        raise ValueError(f"a family of model_type {family.model_type!r} is registered already "
                         f"({FAMILIES[family.model_type].class_name})")
    FAMILIES[family.model_type] = family
    return family


def supported() -> str:
    """The registered families, as a message lists them: 'llama (LlamaForCausalLM), ...'."""
    return ", ".join(f"{family.model_type} ({family.class_name})" for family in FAMILIES.values())


def family_of(model_type: str | None) -> Family:
    """The family of a config's `model_type`; ValueError in one line, naming the supported ones, for another."""
    if model_type not in FAMILIES:
        raise ValueError(f"a {model_type!r} model, of no supported family; supported model types: {supported()}")
    return FAMILIES[model_type]


def exportable() -> list[str]:
    """The model types a trained model can be converted to (the families with a `to_stock`)."""
    return [family.model_type for family in FAMILIES.values() if family.to_stock is not None]


def auto_export_model_type(config: AdaptiveDSConfig) -> str | None:
    """The stock family `--to auto` converts a model of `config` to: the family its weights came from
    (`source_model_type`), or, for an MoE model upcycled from a dense family, that family's MoE sibling
    (`Family.upcycled_model_type`); None where the model started from no stock family."""
    family = FAMILIES.get(config.source_model_type)
    if family is None:
        return config.source_model_type
    if config.arch_spec.moe and family.upcycled_model_type is not None:
        return family.upcycled_model_type
    return family.model_type
