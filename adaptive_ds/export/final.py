"""Writing a model as a self-contained `save_pretrained` folder (torch and transformers only).

The folder carries the model's source files and an `auto_map`, so `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)` loads it where only torch and transformers are installed (the model files import nothing
else; an MoE layer is its plain modules there, under the names DeepSpeed's layer gave its tensors in training).
`final/`, the Hub snapshots and `python -m adaptive_ds.export` all write it through `save_with_code`; a run's
experts and ZeRO-3 shards are gathered into one plain model first, on the training side (training/final.py).
`save_standalone` writes any model the project hands on (an export, a fine-tuned model's merged/): ours through
`save_with_code`, a stock transformers class as save_pretrained writes it.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil

from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.dynamic_module_utils import get_relative_import_files

from ..models import AdaptiveDSConfig, AdaptiveDSForCausalLM, AdaptiveDSModel
from ..models import modeling as modeling_module

logger = logging.getLogger(__name__)

def model_source_files() -> list[str]:
    """modeling.py and every file it imports relatively, found the way transformers finds them when loading."""
    return [modeling_module.__file__, *get_relative_import_files(modeling_module.__file__)]


def auto_map() -> dict[str, str]:
    """The config's `auto_map`: each Auto class to "<source file>.<class>" in the copied sources."""
    classes = {"AutoConfig": AdaptiveDSConfig, "AutoModel": AdaptiveDSModel,
               "AutoModelForCausalLM": AdaptiveDSForCausalLM}
    return {auto: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}" for auto, cls in classes.items()}


def save_with_code(model: AdaptiveDSForCausalLM, tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    """save_pretrained (safetensors) + tokenizer + the model's source files and `auto_map`, for
    `trust_remote_code=True` loading without this package. The model's own config is left without `auto_map`."""
    model.save_pretrained(path, safe_serialization=True)
    config = copy.deepcopy(model.config)  # after save_pretrained, which records dtype and architectures in it
    config.auto_map = auto_map()
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for source in model_source_files():
        shutil.copyfile(source, os.path.join(path, os.path.basename(source)))


def save_standalone(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    """A folder that loads where only torch and transformers are installed: an adaptive_ds model with its source
    files (`save_with_code`; a config loaded from such a folder keeps its `auto_map`, which needs them), a stock
    transformers model (a `--to` conversion, a fine-tuned export) as save_pretrained writes it, its code being
    transformers' own."""
    if isinstance(model, AdaptiveDSForCausalLM):
        save_with_code(model, tokenizer, path)
        return
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
