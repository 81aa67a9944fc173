"""Command line and ds_config of a training run: parsed, validated as a whole, and split for DeepSpeed.

A ds_config may hold one namespaced block, ``"adaptive_ds": {...}``, naming the preset, architecture and run
settings. It is removed before DeepSpeed sees the config; command-line flags override it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass, field, fields

from ..data import EMBEDDED, source_problems
from ..models.configuration import ARCHITECTURES, AdaptiveDSConfig
from ..presets import PRESETS
from .controller import controller_settings

NAMESPACE = "adaptive_ds"
ACCELERATE_DS_CONFIG = "ACCELERATE_DEEPSPEED_CONFIG_FILE"  # set by `accelerate launch` with the DeepSpeed plugin


@dataclass
class RunSettings:
    """Everything about a run that is not DeepSpeed's: the keys allowed in the ``adaptive_ds`` block."""

    preset: str = "debug"
    arch: str = "dense"
    data: str = EMBEDDED  # "embedded", a prepared directory, "0.7:DIR_A,0.3:DIR_B", local files or a Hub name
    data_workers: int = 1  # DataLoader worker processes that make batches ahead of the loop (0: in the loop)
    data_config: str | None = None  # Hub dataset config, e.g. "en" for allenai/c4
    text_field: str = "text"
    tokenizer: str = "bpe:8192"  # text data: "bpe:N" trains a byte-level BPE offline, else a name or path
    validation_share: float = 0.01  # text data: share of documents held out
    tokens: str | None = None  # token budget: a number or "chinchilla" (20 x total parameters); sets max_steps
    epochs: int = 1  # with a budget: passes over a subset of budget / epochs tokens
    max_steps: int = 100
    output_dir: str | None = None  # default: runs/<preset>-<arch>-<time>
    seed: int = 1234
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of the peak learning rate
    log_steps: int = 10
    eval_batches: int = 8  # held-out batches of the final validation loss
    mod_capacity_warmup_steps: int = 0  # MoD capacity anneals linearly from 1.0 to the preset's over these steps
    eval_steps: int = 0  # validation loss every N steps (0: only at the end)
    save_steps: int = 0  # DeepSpeed checkpoint every N steps (0: only at the end)
    keep_last: int = 2  # checkpoints kept
    resume: str = "auto"  # "auto": continue from OUTPUT_DIR's latest checkpoint if there is one; "never"
    report_to: str = "none"  # also mirror metrics to "tensorboard" or "wandb" (metrics.jsonl is always written)
    push_to_hub: str | None = None  # Hub repo id: the final model is pushed with a model card
    push_every_save: bool = False  # also push at every checkpoint, in the background
    activation_checkpointing: bool = False  # recompute each block in backward (the controller may turn it on)
    micro_batch: str | None = None  # "auto": start at the whole step's rows per rank and halve on out-of-memory
    compile: bool = False  # torch.compile the model through DeepSpeed's engine.compile() (inductor)
    gpu_memory_gib: float | None = None  # cap each process's CUDA allocator here: a smaller GPU on a larger one
    controller: dict = field(default_factory=dict)  # ControllerSettings fields (adaptive_ds/training/controller.py)
    model: dict = field(default_factory=dict)  # overrides of AdaptiveDSConfig fields


class ConfigError(ValueError):
    """Bad user input: one line that names the problem and the valid choices."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train an adaptive_ds model through the DeepSpeed engine.")
    p.add_argument("--ds_config", default=os.environ.get(ACCELERATE_DS_CONFIG),
                   help="DeepSpeed JSON config with an optional 'adaptive_ds' block (default under `accelerate "
                        "launch`: the deepspeed_config_file of its config)")
    p.add_argument("--preset", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--arch", help=f"one of {', '.join(ARCHITECTURES)}")
    p.add_argument("--data", help=f"'{EMBEDDED}' (the built-in corpus), a prepared directory (python -m "
                   "adaptive_ds.data.prepare), a mixture 0.7:DIR_A,0.3:DIR_B, or files or a Hub dataset to stream")
    p.add_argument("--data_workers", type=int, help="DataLoader worker processes (0: batches made in the loop)")
    p.add_argument("--data_config", help="Hub dataset config (e.g. en for allenai/c4)")
    p.add_argument("--tokenizer", help="bpe:N (trained on the data, offline) or a tokenizer name or path")
    p.add_argument("--tokens", help="token budget: a number or 'chinchilla' (20 x total parameters)")
    p.add_argument("--epochs", type=int, help="passes over a budget / epochs subset")
    p.add_argument("--max_steps", type=int, help="optimizer steps")
    p.add_argument("--output_dir", help="new or empty directory for metrics, summary and the final model")
    p.add_argument("--seed", type=int)
    p.add_argument("--warmup_steps", type=int, help="linear learning-rate warm-up steps")
    p.add_argument("--ep_size", type=int, help="expert-parallel group size for moe / hybrid")
    p.add_argument("--eval_steps", type=int, help="validation loss every N steps")
    p.add_argument("--save_steps", type=int, help="checkpoint every N steps")
    p.add_argument("--keep_last", type=int, help="checkpoints to keep")
    p.add_argument("--resume", choices=["auto", "never"], help="continue from OUTPUT_DIR's latest checkpoint")
    p.add_argument("--micro_batch", choices=["auto"], help="find the largest micro-batch that fits")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the model (DeepSpeed's engine.compile); the first steps pay the compilation")
    p.add_argument("--gpu_memory_gib", type=float,
                   help="cap the CUDA memory of each process (e.g. 15 to rehearse a T4 on a larger GPU)")
    p.add_argument("--report_to", choices=["none", "tensorboard", "wandb"], help="mirror metrics there too")
    p.add_argument("--push_to_hub", metavar="REPO_ID", help="push the final model (and a model card) to the Hub")
    p.add_argument("--push_every_save", action="store_true", default=None, help="also push at every checkpoint")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p


def _load_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"ds_config {path!r} does not exist; pass a JSON file such as ds_configs/debug_cpu.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"ds_config {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"ds_config {path!r} must hold a JSON object, not {type(config).__name__}")
    return config


def _settings_from_block(block, path: str) -> RunSettings:
    if not isinstance(block, dict):
        raise ConfigError(f"'{NAMESPACE}' in {path!r} must be an object")
    valid = [f.name for f in fields(RunSettings)]
    unknown = sorted(set(block) - set(valid))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in the '{NAMESPACE}' block of {path!r}; "
                          f"valid keys: {', '.join(valid)}")
    return RunSettings(**block)


def validate(settings: RunSettings, ds_config: dict, world_size: int) -> None:
    """Collect every problem and raise once, naming the valid choices."""
    problems = []
    if settings.preset not in PRESETS:
        problems.append(f"unknown preset {settings.preset!r}; valid choices: {', '.join(PRESETS)}")
    if settings.arch not in ARCHITECTURES:
        problems.append(f"unknown arch {settings.arch!r}; valid choices: {', '.join(ARCHITECTURES)}")
    problems += source_problems(settings.data)
    if settings.tokens is not None and settings.tokens != "chinchilla" and not str(settings.tokens).isdigit():
        problems.append(f"tokens {settings.tokens!r} is not a whole number or 'chinchilla'")
    if settings.report_to not in ("none", "tensorboard", "wandb"):
        problems.append(f"report_to {settings.report_to!r} is not one of none, tensorboard, wandb")
    if settings.epochs < 1:
        problems.append(f"epochs must be >= 1, got {settings.epochs}")
    for name in ("max_steps", "log_steps", "eval_batches", "keep_last"):
        if getattr(settings, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(settings, name)}")
    for name in ("data_workers", "warmup_steps", "eval_steps", "save_steps", "mod_capacity_warmup_steps"):
        if getattr(settings, name) < 0:
            problems.append(f"{name} must be >= 0, got {getattr(settings, name)}")
    if settings.gpu_memory_gib is not None and settings.gpu_memory_gib <= 0:
        problems.append(f"gpu_memory_gib must be > 0, got {settings.gpu_memory_gib}")
    if settings.resume not in ("auto", "never"):
        problems.append(f"resume {settings.resume!r} is not one of auto, never")
    model_fields = {f.name for f in fields(AdaptiveDSConfig)}
    unknown = sorted(set(settings.model) - model_fields)
    if unknown:
        problems.append(f"unknown model field(s) {', '.join(unknown)}; valid: {', '.join(sorted(model_fields))}")
    try:
        controller_settings(settings.controller)
    except ValueError as e:
        problems.append(str(e))
    if settings.arch in ("moe", "hybrid") and ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        problems.append(f"arch {settings.arch} uses DeepSpeed MoE, which does not run under ZeRO-3; "
                        "use zero_optimization stage 1 or 2 (with expert parallelism)")
    problems += _batch_problems(ds_config, world_size)
    if ds_config.get("fp16", {}).get("enabled") and ds_config.get("bf16", {}).get("enabled"):
        problems.append("fp16 and bf16 are both enabled; enable at most one")
    if "optimizer" not in ds_config:
        problems.append("the ds_config has no 'optimizer' block; add e.g. "
                        '{"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8}}')
    if problems:
        raise ConfigError("; ".join(problems))


def check_precision(ds_config: dict, capability: tuple[int, int] | None) -> None:
    """bf16 needs compute capability 8.0 (A100 and newer). Older GPUs (T4 is 7.5) emulate it slowly while
    torch.cuda.is_bf16_supported() still says True, so the capability is checked instead."""
    if capability is not None and capability < (8, 0) and ds_config.get("bf16", {}).get("enabled"):
        raise ConfigError(f"bf16 needs a GPU of compute capability 8.0 or newer; this one is "
                          f"{capability[0]}.{capability[1]}; use an fp16 config such as ds_configs/b1_t4.json")


def _batch_problems(ds_config: dict, world_size: int) -> list[str]:
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accum = ds_config.get("gradient_accumulation_steps", 1)
    total = ds_config.get("train_batch_size")
    if micro is None:
        return ["the ds_config must set train_micro_batch_size_per_gpu"]
    bad = [f"{k}={v!r}" for k, v in (("train_micro_batch_size_per_gpu", micro),
                                      ("gradient_accumulation_steps", accum)) if not isinstance(v, int) or v < 1]
    if bad:
        return [f"batch sizes must be positive integers: {', '.join(bad)}"]
    if total is not None and total != micro * accum * world_size:
        return [f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                f"{accum} x world size {world_size} = {micro * accum * world_size}; fix one or drop train_batch_size"]
    return []


def parse(argv: list[str] | None, world_size: int) -> tuple[RunSettings, dict]:
    """The run's settings (block, then flags) and the ds_config DeepSpeed gets (without our block)."""
    args = build_parser().parse_args(argv)
    if args.ds_config is None:
        raise ConfigError("no --ds_config given (and no deepspeed_config_file from accelerate); pass one of "
                          "ds_configs/*.json")
    raw = _load_json(args.ds_config)
    ds_config = copy.deepcopy(raw)
    settings = _settings_from_block(ds_config.pop(NAMESPACE, {}), args.ds_config)
    for name in ("preset", "arch", "data", "max_steps", "output_dir", "seed", "eval_steps", "save_steps", "keep_last",
                 "resume", "data_config", "tokenizer", "tokens", "epochs", "report_to", "push_to_hub",
                 "push_every_save", "micro_batch", "gpu_memory_gib", "compile", "warmup_steps", "data_workers"):
        value = getattr(args, name)
        if value is not None:
            setattr(settings, name, value)
    if args.ep_size is not None:
        settings.model = {**settings.model, "moe_ep_size": args.ep_size}
    validate(settings, ds_config, world_size)
    return settings, ds_config
