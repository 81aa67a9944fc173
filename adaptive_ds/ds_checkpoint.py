"""A checkpoint the trainer wrote, read without the trainer: its file names, its one-line error, and the model in it.

OUTPUT_DIR/checkpoints/<tag>/ holds DeepSpeed's files and `run.json` (the run's state, its identity with the model's
config); OUTPUT_DIR/checkpoints/latest names the newest complete one. `export` and `generate` read checkpoints
through this module, which imports neither the training code nor DeepSpeed (but lazily, for a ZeRO-3 checkpoint's
partitions); the training code writes them (training/checkpoint/) with the same names.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from transformers import AutoTokenizer, GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME

from .models import AdaptiveDSConfig, AdaptiveDSForCausalLM

CHECKPOINTS = "checkpoints"
LATEST = "latest"
RUN_STATE = "run.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed, saved or read: one line; no checkpoint is deleted."""


def resolve_tag_dir(path: str) -> str:
    """A checkpoint directory from a tag directory, a checkpoints/ directory or a run's OUTPUT_DIR."""
    if os.path.isfile(os.path.join(path, RUN_STATE)):
        return path
    for root in (os.path.join(path, CHECKPOINTS), path):
        latest = os.path.join(root, LATEST)
        if os.path.isfile(latest):
            with open(latest) as f:
                return os.path.join(root, f.read().strip())
    raise CheckpointError(f"{path!r} is not a checkpoint: expected OUTPUT_DIR, OUTPUT_DIR/checkpoints or "
                          "OUTPUT_DIR/checkpoints/<tag> (with a run.json)")


def load_checkpoint(path: str) -> tuple[AdaptiveDSForCausalLM, object]:
    """The model (all experts, ep_size 1, with the checkpoint's generation config) and tokenizer of a DeepSpeed
    checkpoint written by the trainer."""
    tag_dir = resolve_tag_dir(path)
    try:
        with open(os.path.join(tag_dir, "run.json")) as f:
            run = json.load(f)
        name = "mp_rank_00_model_states.pt"
        if not os.path.exists(os.path.join(tag_dir, name)):
            name = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO-3 writes one per rank
        states = torch.load(os.path.join(tag_dir, name), map_location="cpu", weights_only=False)
        if states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0) == 3:
            # ZeRO-3 keeps each parameter only in its ranks' fp32 partitions: reassemble them
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            module = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(tag_dir), os.path.basename(tag_dir))
        else:
            module = states["module"]
        for expert_file in sorted(glob.glob(os.path.join(tag_dir, "layer_*_expert_*_mp_rank_00_model_states.pt"))):
            module.update(torch.load(expert_file, map_location="cpu", weights_only=False))
    except (OSError, RuntimeError, EOFError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {tag_dir!r} cannot be read ({type(e).__name__}: {e})") from None
    config_dict = dict(run["identity"]["model"])
    config_dict.pop("model_type", None)
    config = AdaptiveDSConfig.from_dict({**config_dict, "moe_ep_size": 1})
    model = AdaptiveDSForCausalLM(config)
    model.load_state_dict(module, strict=True)
    if os.path.isfile(os.path.join(tag_dir, GENERATION_CONFIG_NAME)):  # written since checkpoints carry it
        model.generation_config = GenerationConfig.from_pretrained(tag_dir)
    return model.to(next(iter(module.values())).dtype), AutoTokenizer.from_pretrained(
        os.path.join(tag_dir, "tokenizer"))
