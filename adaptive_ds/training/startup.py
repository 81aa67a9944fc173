"""What a run does once, before its first step: the device, the data, the pretrained source and the run's length.

`Trainer.__init__` (loop.py) calls these in order; each turns bad input into one ConfigError line, before anything
is written.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from dataclasses import replace

import torch

from .. import distributed, pretrained
from ..data import build_training_data
from ..models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from ..presets import model_config, parameter_counts
from .arguments import ConfigError, RunSettings, check_precision
from .output_dir import IDENTITY

logger = logging.getLogger(__name__)


def resolve_steps(settings: RunSettings, config, tokens_per_step: int) -> RunSettings:
    """max_steps from a token budget (a number, or chinchilla: 20 tokens per parameter, Hoffmann et al. 2022)."""
    if settings.tokens is None:
        return settings
    budget = 20 * parameter_counts(config).total if settings.tokens == "chinchilla" else int(settings.tokens)
    return replace(settings, max_steps=max(1, -(-budget // tokens_per_step)))


def warn_about_warmup(settings: RunSettings) -> None:
    if settings.warmup_steps >= settings.max_steps:
        logger.warning("warmup_steps %d >= max_steps %d: the learning rate never reaches its peak; pass "
                       "--warmup_steps (e.g. %d, 5%% of the steps)", settings.warmup_steps, settings.max_steps,
                       max(1, settings.max_steps // 20))


def cap_gpu_memory(gib: float) -> None:
    """Make the CUDA allocator fail beyond `gib` (its out-of-memory is then the controller's to handle)."""
    if not torch.cuda.is_available():
        logger.warning("--gpu_memory_gib %.1f ignored: no CUDA device", gib)
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 > total:
        raise ConfigError(f"gpu_memory_gib {gib} exceeds this GPU's {total / 2**30:.1f} GiB; pass a smaller cap")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)
    logger.info("CUDA memory capped at %.1f GiB of %.1f GiB", gib, total / 2**30)


def prepare_device(settings: RunSettings, ds_config: dict) -> None:
    check_precision(ds_config, torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    if settings.gpu_memory_gib:
        cap_gpu_memory(settings.gpu_memory_gib)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls on Ampere and newer


def load_data(settings: RunSettings, seq_len: int):
    epoch_blocks = None  # global blocks per epoch: the same subset whatever the number of processes
    if settings.tokens not in (None, "chinchilla") and settings.epochs > 1:
        epoch_blocks = -(-int(settings.tokens) // (settings.epochs * seq_len))
    try:
        return build_training_data(settings.data, seq_len, settings.seed, tokenizer=settings.tokenizer,
                                   text_field=settings.text_field, hub_config=settings.data_config,
                                   validation_share=settings.validation_share, epoch_blocks=epoch_blocks,
                                   workers=settings.data_workers)
    except ValueError as error:  # bad data is bad input: one line, before anything is written
        raise ConfigError(str(error)) from None


def open_source(settings: RunSettings):
    """The pretrained model of --init_from (already checked by the settings' validation), or None."""
    if settings.init_from is None:
        return None
    try:
        return pretrained.Source.open(settings.init_from)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def saved_tokenizer(source, data_tokenizer):
    """The tokenizer checkpoints and final/ carry: --init_from's own, as its folder has it (its special tokens, its
    chat template; the data's is checked to have its vocabulary), so the trained model chats as the base did; else
    the data's."""
    if source is None:
        return data_tokenizer
    try:
        return source.tokenizer()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def model_config_of(settings: RunSettings, source, tokenizer, saved,
                    vocab_size: int | None = None) -> AdaptiveDSConfig:
    """The model's config: the preset's shape, or --init_from's (whose tokenizer must be the data's), for the data's
    vocabulary, with the special tokens of the tokenizer the model is `saved` with and the run's --model
    overrides. `vocab_size`: a vocabulary in place of the tokenizer's (a memory benchmark's, at a preset's published
    size: the tokenizer's ids lie below it)."""
    tokens = dict(bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id,
                  pad_token_id=saved.pad_token_id)
    vocab = vocab_size if vocab_size is not None else len(tokenizer)
    if source is None:
        return model_config(settings.preset, settings.arch, vocab, **tokens, **settings.model)
    try:
        source.check_tokenizer(tokenizer, settings.data)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return source.model_config(settings.arch, settings.preset, vocab, **tokens, **settings.model)


def take_generation_config(model: AdaptiveDSForCausalLM, source) -> None:
    """--init_from's generation_config.json (its eos, bos and pad ids, its sampling defaults) for `model`, which
    checkpoints and final/ save; on a resume too, which loads no weights from the folder. Without one, the model
    keeps the one transformers derives from its config."""
    try:
        generation = source.generation_config() if source is not None else None
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if generation is not None:
        model.generation_config = generation


def base_model_record(source, output_dir: str | None, rank: int) -> dict | None:
    """Where the weights came from (the source, its files' hash and stats; rank 0's, on every rank), or None
    without --init_from. A resume of an unchanged folder takes the recorded hash: the weights are not read again."""
    if source is None:
        return None
    record = source.identity(recorded_base_model(output_dir)) if rank == 0 else None
    return distributed.broadcast_object(record)


def build_model(config: AdaptiveDSConfig, settings: RunSettings, source, rank: int) -> AdaptiveDSForCausalLM:
    """The model at the run's seed, holding `source`'s weights (upcycled where its architecture asks) when given.
    DeepSpeed's expert-parallel groups are consecutive ranks: rank r holds the experts of group rank r % ep_size."""
    torch.manual_seed(settings.seed)
    model = AdaptiveDSForCausalLM(config)
    if source is not None:
        try:
            source.load_into(model, rank % config.moe_ep_size, settings.upcycle_noise, settings.seed)
        except ValueError as error:  # weights that do not match their config: bad input, one line
            raise ConfigError(str(error)) from None
    return model


def recorded_base_model(output_dir: str | None) -> dict | None:
    """The source record (`pretrained.Source.identity`) of the run in `output_dir`, if it has one."""
    if output_dir is None:
        return None
    try:
        with open(os.path.join(output_dir, IDENTITY)) as f:
            recorded = json.load(f).get("base_model")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return recorded if isinstance(recorded, dict) else None


def command() -> str:
    """The command line that started this process (the program by its name: `train.py`, `adaptive-ds train`)."""
    return " ".join([os.path.basename(sys.argv[0]), shlex.join(sys.argv[1:])]).strip()
