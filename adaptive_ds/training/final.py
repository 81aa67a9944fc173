"""A run's final model: its experts (split over the expert-parallel ranks) and ZeRO-3 shards gathered into one
plain model (collective), then written by `export.final.save_with_code` as a self-contained folder."""

from __future__ import annotations

import copy
import logging
import re

import deepspeed
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from ..export.final import save_with_code
from ..models import AdaptiveDSForCausalLM
from .moe_adapter import expert_parallel_group

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


def _gather_experts(model: AdaptiveDSForCausalLM) -> dict:
    """The full state dict on every rank: each rank holds `num_experts / ep_size` experts, numbered locally."""
    config = model.config
    num_local = config.num_routed_experts // config.moe_ep_size
    group = expert_parallel_group(model)
    ep_rank = dist.get_rank(group)
    local = {}
    for name, tensor in model.state_dict().items():
        match = _EXPERT.match(name)
        if match:
            global_index = ep_rank * num_local + int(match.group(2))
            name = f"{match.group(1)}{global_index}{match.group(3)}"
        local[name] = tensor.detach().cpu()
    shards = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, local, group=group)
    return {k: v for shard in shards for k, v in shard.items()}


def _gather_zero3(model: AdaptiveDSForCausalLM, is_writer: bool) -> dict | None:
    """ZeRO-3 partitions every parameter over the ranks: gather them (collective) into a full state dict."""
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if is_writer else None


def save_final(model: AdaptiveDSForCausalLM, tokenizer: PreTrainedTokenizerBase, path: str, is_writer: bool,
               zero_stage: int = 0) -> None:
    """Save `model` and `tokenizer` for `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(path)`.

    Collective when experts are split over ranks (every rank must call it); only `is_writer` writes.
    The saved config has `moe_ep_size` 1, so the folder loads in a single process; the folder carries the model
    code (see `save_with_code`) and `model`'s generation config (--init_from's, where the run took one).
    """
    generation = model.generation_config
    if zero_stage == 3:
        state = _gather_zero3(model, is_writer)
        if not is_writer:
            return
        full = AdaptiveDSForCausalLM(model.config)
        full.load_state_dict(state, strict=True)
        model = full.to(next(iter(state.values())).dtype)
        model.generation_config = generation
    elif model.config.expert_parallel_size > 1:
        state = _gather_experts(model)
        if not is_writer:
            return
        config = copy.deepcopy(model.config)
        config.moe_ep_size = 1
        full = AdaptiveDSForCausalLM(config)
        full.load_state_dict(state, strict=True)
        model = full.to(next(iter(state.values())).dtype)
        model.generation_config = generation
    if is_writer:
        save_with_code(model, tokenizer, path)
        logger.info("saved the final model and tokenizer to %s", path)
