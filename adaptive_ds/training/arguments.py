"""Command line and ds_config of a training run: parsed, validated as a whole, and split for DeepSpeed.

A ds_config may hold one namespaced block, ``"adaptive_ds": {...}``, naming the preset, architecture and run
settings. It is removed before DeepSpeed sees the config; command-line flags override it.

`RunSettings` is the one definition of those settings: each field's type, default, help and valid choices
generate its ``--flag``, its checks in `validate()` and the settings table of docs/training.md (`settings_markdown()`).

This module imports neither torch, transformers nor DeepSpeed (the model configuration, the data sources and
`--init_from`'s folder are imported where they are checked), so that `preflight()` can refuse a misspelt flag, a bad
value or a broken ds_config in a second, before the run imports them (training/__main__.py); a test keeps it so.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import os
import re
import sys
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from difflib import get_close_matches
from typing import TYPE_CHECKING

from .. import ds_config as ds_config_reader
from ..ds_config import ConfigError
from ..presets import (
    ARCHITECTURES,
    NO_PRESET_SEQ_LEN,
    PRESETS,
    RENAMED_VARIANTS,
    VARIANTS,
    unused_fields,
    variant_overrides,
)
from .controller import ControllerSettings, controller_settings

if TYPE_CHECKING:
    from ..models.configuration import AdaptiveDSConfig
    from ..presets import ArchVariant

__all__ = ["ConfigError", "RunSettings", "build_parser", "check_precision", "parse", "preflight", "settings_markdown",
           "validate"]

NAMESPACE = "adaptive_ds"
ACCELERATE_DS_CONFIG = "ACCELERATE_DEEPSPEED_CONFIG_FILE"  # set by `accelerate launch` with the DeepSpeed plugin
REPORTERS = ("none", "tensorboard", "wandb")
REPORTER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # report_to -> the package it imports

logger = logging.getLogger(__name__)


def setting(default, help: str, choices: tuple = (), at_least: float | None = None,
            above: float | None = None) -> Field:
    """A RunSettings field: its default, one line of help, and the checks `validate()` applies to it."""
    metadata = {"help": help, "choices": tuple(choices), "at_least": at_least, "above": above}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class RunSettings:
    """Everything about a run that is not DeepSpeed's: the keys allowed in the ``adaptive_ds`` block, each also
    a flag that overrides it."""

    preset: str = setting("debug", "model size (adaptive_ds/presets.py)", choices=tuple(PRESETS))
    arch: str = setting("dense", "architecture", choices=ARCHITECTURES)
    # adaptive_ds.data.EMBEDDED, spelt here because that package imports torch (a test keeps the two the same)
    data: str = setting("embedded", "'embedded' (the built-in corpus; 'embedded:hard' its hard tier), a prepared "
                                    "directory (python -m adaptive_ds.data.prepare), a mixture 0.7:DIR_A,0.3:DIR_B, or "
                                    "local files (.jsonl, .json.gz, .parquet, .txt; a glob or folder) or a Hub dataset "
                                    "to stream")
    data_workers: int = setting(1, "DataLoader worker processes that make batches ahead of the loop (0: in the "
                                   "loop)", at_least=0)
    data_config: str | None = setting(None, "Hub dataset config, e.g. en for allenai/c4")
    text_field: str = setting("text", "text data: the field that holds each document")
    tokenizer: str = setting("bpe:8192", "text data: bpe:N trains a byte-level BPE offline, else a tokenizer "
                                         "name or path")
    validation_share: float = setting(0.01, "text data: share of documents held out", above=0)
    tokens: int | str | None = setting(None, "token budget: a number or chinchilla (20 x total parameters); sets "
                                             "max_steps")
    epochs: int = setting(1, "with a token budget: passes over a subset of budget / epochs tokens", at_least=1)
    max_steps: int = setting(100, "optimizer steps", at_least=1)
    output_dir: str | None = setting(None, "new or empty directory for metrics, summary and the final model "
                                           "(unset: runs/PRESET-ARCH-TIME)")
    seed: int = setting(1234, "seed of the weights and the data order")
    warmup_steps: int = setting(20, "linear learning-rate warm-up steps", at_least=0)
    min_lr_ratio: float = setting(0.1, "the cosine decays to this fraction of the peak learning rate", at_least=0)
    log_steps: int = setting(10, "a metrics.jsonl record every N steps", at_least=1)
    eval_batches: int = setting(8, "held-out batches of each validation loss", at_least=1)
    mod_capacity_warmup_steps: int = setting(0, "MoD capacity anneals linearly from 1.0 to the model's "
                                                "mod_capacity over these steps", at_least=0)
    eval_steps: int = setting(0, "validation loss every N steps (0: only at the end)", at_least=0)
    save_steps: int = setting(0, "DeepSpeed checkpoint every N steps (0: only at the end)", at_least=0)
    keep_last: int = setting(2, "checkpoints kept", at_least=1)
    max_failed_saves: int = setting(3, "checkpoint saves that may fail in a row (a full disk, no permission) before "
                                       "the run stops with one line naming the cause and the last good checkpoint; "
                                       "each failure is a warning, the previous checkpoint stays the latest and the "
                                       "next save point tries again", at_least=1)
    stop_grace_s: int = setting(30, "seconds after SIGTERM or SIGINT (a preemption notice, Ctrl-C) within which the "
                                    "run still saves a checkpoint where the ranks agree to stop (within two steps); "
                                    "a further signal within them only marks the request again, one after them "
                                    "stops the run at once",
                                at_least=0)
    collective_timeout_s: int = setting(1800, "seconds a collective may wait on a hung process before the run "
                                              "stops with one line (long enough for rank-0-only work such as a "
                                              "large checkpoint's universal conversion)", at_least=1)
    resume: str = setting("auto", "auto: continue from OUTPUT_DIR's latest checkpoint if there is one",
                          choices=("auto", "never"))
    report_to: str = setting("none", "also mirror metrics there (metrics.jsonl is always written)",
                             choices=REPORTERS)
    push_to_hub: str | None = setting(None, "Hub repo id: the final model is pushed with a model card")
    push_every_save: bool = setting(False, "also push at every checkpoint, in the background")
    activation_checkpointing: bool = setting(False, "recompute each block in backward (the controller may turn "
                                                    "it on)")
    micro_batch: int | str | None = setting(None, "rows per forward pass, overriding the ds_config's (gradient "
                                                  "accumulation follows, so the global batch stays; also when "
                                                  "resuming), or auto: start at the whole step's rows per rank and "
                                                  "halve on out-of-memory")
    compile: bool = setting(False, "torch.compile the model through DeepSpeed's engine.compile() (inductor); the "
                                   "first steps pay the compilation")
    gpu_memory_gib: float | None = setting(None, "cap each process's CUDA allocator here (e.g. 15 to rehearse a "
                                                 "T4 on a larger GPU)", above=0)
    controller: dict = setting({}, "ControllerSettings fields (adaptive_ds/training/controller.py)")
    variant: str | None = setting(None, "a named variant of adaptive_ds/presets.py (VARIANTS; python -m "
                                        "adaptive_ds.presets lists them), e.g. mod:half, MoD capacity 0.5 in every "
                                        "block: it sets its architecture (an arch beside it must be the same; the "
                                        "flag replaces the block's arch) and its model and controller overrides, "
                                        "over the architecture's defaults and under the model and controller "
                                        "settings", choices=tuple(VARIANTS))
    model: dict = setting({}, "overrides of AdaptiveDSConfig fields, e.g. {\"mod_capacity\": 0.25}")
    init_from: str | None = setting(None, "start from pretrained weights, not from random ones: a folder (or Hub id) "
                                          "of a stock LlamaForCausalLM, a MixtralForCausalLM or an adaptive_ds "
                                          "final/; its config gives the shape (a preset named here or in the "
                                          "ds_config must agree; none named: the preset of that shape, else none, "
                                          "and the run claims none), seq_len is the preset's up to its "
                                          "max_position_embeddings (no preset: max_position_embeddings up to "
                                          f"{NO_PRESET_SEQ_LEN}), its tokenizer must be the data's; a "
                                          "dense model starts moe, mod or hybrid upcycled (adaptive_ds/pretrained.py); "
                                          "a fresh optimizer, schedule and data position")
    upcycle_noise: float = setting(0.0, "with init_from a dense model and arch moe or hybrid: each expert copy's "
                                        "weights times 1 + N(0, noise^2), so the copies differ from the first step "
                                        "(0: exact copies, the first forward pass the dense model's)", at_least=0)


def _types(cls: type) -> dict[str, object]:
    """The evaluated annotations of `cls`'s own fields (a base class's may name types imported only for type
    checking, which typing.get_type_hints cannot resolve)."""
    namespace = vars(sys.modules[cls.__module__])
    return {name: eval(hint, namespace) if isinstance(hint, str) else hint  # our own annotations, as typing would
            for name, hint in vars(cls)["__annotations__"].items()}


def _members(hint) -> tuple:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _matches(value, hint) -> bool:
    """Whether a JSON value fits a field's annotation (an int fits a float; a list fits a tuple)."""
    if isinstance(hint, types.UnionType):
        return any(_matches(value, member) for member in typing.get_args(hint))
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if origin is tuple:  # JSON has no tuples: a list of the right length and kinds
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(
            _matches(v, a) for v, a in zip(value, args, strict=True))
    return isinstance(value, origin) if isinstance(origin, type) else True


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object",
               type(None): "null"}


def _type_name(hint, article: bool = True) -> str:
    names = [_TYPE_NAMES.get(typing.get_origin(m) or m, "a list") for m in _members(hint)]
    return " or ".join(names if article else [re.sub(r"^an? ", "", name) for name in names])


def _type_problems(cls: type, values: dict, prefix: str = "") -> dict[str, str]:
    """{name: problem} for every value that does not fit the type `cls` declares for it."""
    hints = _types(cls)
    return {name: f"{prefix}{name} must be {_type_name(hints[name])}, got {value!r}"
            for name, value in values.items() if name in hints and not _matches(value, hints[name])}


def _field_problems(settings: RunSettings) -> list[str]:
    """Types, choices and bounds of every field, as RunSettings declares them."""
    values = {f.name: getattr(settings, f.name) for f in fields(RunSettings)}
    wrong_type = _type_problems(RunSettings, values)
    found = list(wrong_type.values())
    for f in fields(RunSettings):
        value, meta = values[f.name], f.metadata
        if f.name in wrong_type or value is None:
            continue
        if meta["choices"] and value not in meta["choices"]:
            found.append(f"unknown {f.name} {value!r}; valid choices: {', '.join(meta['choices'])}")
        if meta["at_least"] is not None and value < meta["at_least"]:
            found.append(f"{f.name} must be >= {meta['at_least']}, got {value}")
        if meta["above"] is not None and value <= meta["above"]:
            found.append(f"{f.name} must be > {meta['above']}, got {value}")
    return found


def _flag_type(hint):
    kinds = [m for m in _members(hint) if m is not type(None)]
    if kinds == [dict]:
        return _json_object
    return kinds[0] if len(kinds) == 1 else str  # several kinds (tokens: a number or a word): validate() decides


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _flag_help(f: Field) -> str:
    meta = f.metadata
    choices = f"; one of {', '.join(meta['choices'])}" if meta["choices"] else ""
    merged = "; a JSON object whose keys override the block's" if f.default is MISSING else ""
    return f"{meta['help']}{choices}{merged} (default: {_default_json(f)})".replace("%", "%%")  # argparse formats it


class _Parser(argparse.ArgumentParser):
    """argparse, but a command-line mistake ends in one line, as every other bad input does: the problem, the flags
    it might have meant, and where all of them are listed (argparse's usage of some forty flags would bury it)."""

    def error(self, message: str):
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        meant = [match for word in re.findall(r"--[\w-]+", message) if word not in options
                 for match in get_close_matches(word, options, n=1)]
        hint = f"; did you mean {', '.join(meant)}?" if meant else ""
        self.exit(2, f"error: {message}{hint} (--help lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    """`--ds_config`, a flag per RunSettings field (unset flags are None: the block's value stands), `--ep_size`."""
    # never abbreviated: `--max_step 10` is refused, not read as `--max_steps 10`
    p = _Parser(description="Train an adaptive_ds model through the DeepSpeed engine.", allow_abbrev=False)
    p.add_argument("--ds_config", default=os.environ.get(ACCELERATE_DS_CONFIG),
                   help="DeepSpeed JSON config with an optional 'adaptive_ds' block: a path, or the name of a shipped "
                        "config (debug_cpu.json, b1_t4.json, ...: adaptive_ds/ds_configs) (default under `accelerate "
                        "launch`: the deepspeed_config_file of its config)")
    hints = _types(RunSettings)
    for f in fields(RunSettings):
        kind = _flag_type(hints[f.name])
        if kind is bool:
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, help=_flag_help(f))
        else:
            p.add_argument(f"--{f.name}", type=kind, metavar=f.name.upper(), help=_flag_help(f))
    p.add_argument("--ep_size", type=int, help="expert-parallel group size for moe / hybrid (model.moe_ep_size)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p


def _settings_from_block(block, path: str) -> RunSettings:
    if not isinstance(block, dict):
        raise ConfigError(f"'{NAMESPACE}' in {path!r} must be an object")
    valid = [f.name for f in fields(RunSettings)]
    unknown = sorted(set(block) - set(valid))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in the '{NAMESPACE}' block of {path!r}; "
                          f"valid keys: {', '.join(valid)}")
    return RunSettings(**block)


def validate(settings: RunSettings, ds_config: dict, world_size: int, preset_named: bool = True) -> None:
    """Collect every problem and raise once, naming the valid choices. `preset_named`: the preset was named (on the
    command line or in the ds_config), so that with `init_from` it must agree with the folder's shape (else it
    becomes the preset of that shape: `init_from_check`)."""
    # these import torch: here, not with this module (its docstring says why)
    from ..data import source_problems

    problems = _settings_problems(settings, ds_config, world_size)
    init_model = None
    if isinstance(settings.init_from, str) and isinstance(settings.model, dict) and settings.arch in ARCHITECTURES:
        init_model, found = init_from_check(settings, preset_named)
        problems += found
    elif settings.init_from is None and _upcycle_noise(settings):
        problems.append(_noise_needs(settings))
    if isinstance(settings.data, str):
        problems += source_problems(settings.data)
    model = init_model if settings.init_from is not None else _model(settings, problems)
    layout_problems = ds_config_reader.problems(ds_config, world_size)
    micro = settings.micro_batch
    resuming = settings.output_dir is not None and _holds_a_checkpoint(settings.output_dir)
    # a resume keeps its checkpoint's global batch, so the rows it splits are known only then (the trainer checks)
    if isinstance(micro, int) and not isinstance(micro, bool) and micro >= 1 and not layout_problems and not resuming:
        rows = ds_config_reader.read(ds_config).rows_per_rank_step
        if rows % micro:
            divisors = [d for d in range(1, rows + 1) if rows % d == 0]
            problems.append(f"micro_batch {micro} does not divide the {rows} rows each process trains per step; "
                            f"valid choices: {', '.join(map(str, divisors))}")
    if model is not None and not layout_problems:
        if model.zero3_problem is not None and ds_config_reader.read(ds_config).zero_stage == 3:
            # with experts, the stage that runs splits them over the processes (--ep_size)
            problems.append(f"arch {settings.arch}: {model.zero3_problem}; use zero_optimization stage 1 or 2"
                            + (" (with expert parallelism)" if model.num_moe_layers else ""))
        if world_size % model.expert_parallel_size:
            problems.append(f"moe_ep_size {model.moe_ep_size} does not divide the world size {world_size}; pass "
                            f"an --ep_size that divides the number of processes")
    if problems:
        raise ConfigError("; ".join(problems))


def _settings_problems(settings: RunSettings, ds_config: dict, world_size: int) -> list[str]:
    """The problems found without the model, the data or `init_from` (what `preflight` checks): each setting's type,
    choices and bounds, the controller's keys, the variant against the arch, `model` fields of another architecture
    and the ds_config's own sections."""
    problems = _field_problems(settings)
    micro = settings.micro_batch
    if micro is not None and micro != "auto" and not (isinstance(micro, int) and not isinstance(micro, bool)
                                                      and micro >= 1):
        problems.append(f"micro_batch {micro!r} is not a positive whole number or 'auto'")
    tokens = settings.tokens
    if tokens is not None and tokens != "chinchilla" and not (isinstance(tokens, int) and tokens >= 1) \
            and not (isinstance(tokens, str) and tokens.isdigit() and int(tokens) >= 1):
        problems.append(f"tokens {tokens!r} is not a positive whole number or 'chinchilla'")
    package = REPORTER_PACKAGES.get(settings.report_to)
    if package and importlib.util.find_spec(package) is None:
        problems.append(f"report_to {settings.report_to} needs the {package} package, which is not installed: pip "
                        f"install {package} (or the logging extra), or pass --report_to none")
    if isinstance(settings.controller, dict):
        controller = list(_type_problems(ControllerSettings, settings.controller, "controller.").values())
        if not controller:
            try:
                controller_settings(settings.controller)
            except ValueError as e:
                controller.append(str(e))
        problems += controller
    problems += ds_config_reader.problems(ds_config, world_size)
    variant = _variant_of_another_arch(settings)
    if variant is not None:
        same = [name for name, v in VARIANTS.items() if v.arch == settings.arch]
        problems.append(f"variant {settings.variant} is a {variant.arch} variant, and arch is {settings.arch}; leave "
                        f"arch out (the variant names it) or pick a {settings.arch} variant: {', '.join(same)}")
    elif isinstance(settings.model, dict) and settings.arch in ARCHITECTURES:
        problems += unused_fields(settings.arch, settings.model)  # e.g. mod_capacity for dense would change nothing
    if "optimizer" not in ds_config:
        problems.append("the ds_config has no 'optimizer' block; add e.g. "
                        '{"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8}}')
    return problems


def _variant_of_another_arch(settings: RunSettings) -> ArchVariant | None:
    """The variant named, where it is one of another architecture than the run's (its fields then are not the arch's,
    and that is the one problem to name); None otherwise."""
    variant = VARIANTS.get(settings.variant) if isinstance(settings.variant, str) else None
    return variant if variant is not None and variant.arch != settings.arch else None


def _holds_a_checkpoint(output_dir: str) -> bool:
    from .checkpoint import latest_tag  # the checkpoint layout's one reader

    return isinstance(output_dir, str) and latest_tag(output_dir) is not None


def _model(settings: RunSettings, problems: list[str]) -> AdaptiveDSConfig | None:
    """The model configuration the run will build (its vocabulary aside), or None after adding its problems."""
    from ..models.configuration import AdaptiveDSConfig
    from ..presets import model_config

    if not isinstance(settings.model, dict) or settings.preset not in PRESETS or settings.arch not in ARCHITECTURES:
        return None  # already reported
    if "config_version" in settings.model:
        problems.append("model field config_version is a saved config's own (what its unset fields mean), not a "
                        "setting: leave it out of --model")
        return None
    if "vocab_size" in settings.model:
        problems.append("model field vocab_size is the tokenizer's (its length, padded): leave it out of --model and "
                        "choose the tokenizer (--tokenizer)")
        return None
    valid = {f.name for f in fields(AdaptiveDSConfig)} - {"config_version"}
    unknown = sorted(set(settings.model) - valid)
    if unknown:
        problems.append(f"unknown model field(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        return None
    wrong = _type_problems(AdaptiveDSConfig, settings.model, "model.")
    if wrong:
        problems += wrong.values()
        return None
    try:
        # the tokenizer's vocabulary is not known yet; a placeholder suffices to check the architecture
        return model_config(settings.preset, settings.arch, 256, **settings.model)
    except ValueError as e:
        problems.append(f"model: {e}")
        return None


def _upcycle_noise(settings: RunSettings) -> bool:
    noise = settings.upcycle_noise
    return isinstance(noise, (int, float)) and not isinstance(noise, bool) and noise > 0


def _noise_needs(settings: RunSettings) -> str:
    return (f"upcycle_noise {settings.upcycle_noise} perturbs the expert copies of a dense model: it needs init_from "
            "a dense model and arch moe or hybrid (0 otherwise)")


def init_from_check(settings: RunSettings, preset_named: bool) -> tuple[AdaptiveDSConfig | None, list[str]]:
    """With `init_from`: the model the run will build from the folder (its vocabulary aside) and the folder's problems,
    one line each (`pretrained.Source.problems`); without a named preset, `settings.preset` becomes the preset of
    the folder's shape, or None where no preset has it (the run then claims no preset, and its seq_len is the
    folder's max_position_embeddings up to `NO_PRESET_SEQ_LEN`)."""
    from .. import pretrained
    from ..models.upcycling import copies_experts

    try:
        source = pretrained.Source.open(settings.init_from)
    except ValueError as error:
        return None, [str(error)]
    if not preset_named:
        settings.preset = source.matching_preset()
    found = source.problems(settings.arch, settings.model, settings.preset if preset_named else None)
    if _upcycle_noise(settings) and not copies_experts(source.arch, settings.arch):
        found.append(_noise_needs(settings))
    if found:
        return None, found
    try:
        return source.model_config(settings.arch, settings.preset, 256, **settings.model), []
    except ValueError as error:
        return None, [f"model: {error}"]


def check_precision(ds_config: dict, capability: tuple[int, int] | None) -> None:
    """bf16 needs compute capability 8.0 (A100 and newer). Older GPUs (T4 is 7.5) emulate it slowly while
    torch.cuda.is_bf16_supported() still says True, so the capability is checked instead."""
    if capability is not None and capability < (8, 0) and ds_config_reader.precision(ds_config) == "bf16":
        raise ConfigError(f"bf16 needs a GPU of compute capability 8.0 or newer; this one is "
                          f"{capability[0]}.{capability[1]}; use an fp16 config such as ds_configs/b1_t4.json")


def parse(argv: list[str] | None, world_size: int) -> tuple[RunSettings, dict]:
    """The run's settings (block, then flags) and the ds_config DeepSpeed gets (without our block)."""
    settings, ds_config, preset_named = _read(argv)
    validate(settings, ds_config, world_size, preset_named)
    return settings, ds_config


def preflight(argv: list[str] | None, world_size: int) -> None:
    """What `parse` checks without importing torch, transformers or DeepSpeed: the flags (argparse exits with status
    2 and one line), the ds_config (it exists, is JSON, its block's keys and batch sizes are valid, it has an
    optimizer) and every setting's type, choices and bounds. The training command runs it before it imports them
    (training/__main__.py), so that such a mistake answers in a second rather than after the imports; `parse` then
    checks everything again with the model, the data and `init_from`. ConfigError names every problem in one line."""
    settings, ds_config, _ = _read(argv, warn=False)  # `parse` warns of an old variant spelling, once
    problems = _settings_problems(settings, ds_config, world_size)
    if problems:
        raise ConfigError("; ".join(problems))


def _read(argv: list[str] | None, warn: bool = True) -> tuple[RunSettings, dict, bool]:
    """The settings (the block, the flags over it, a variant's overrides under them), the ds_config without the block,
    and whether a preset was named (on the command line or in the block)."""
    args = build_parser().parse_args(argv)
    if args.ds_config is None:
        raise ConfigError("no --ds_config given (and no deepspeed_config_file from accelerate); pass a JSON file, "
                          f"or the name of a shipped config: {', '.join(ds_config_reader.shipped())}")
    ds_config = copy.deepcopy(ds_config_reader.load(args.ds_config))
    block = ds_config.pop(NAMESPACE, {})
    settings = _settings_from_block(block, args.ds_config)
    for f in fields(RunSettings):
        value = getattr(args, f.name)
        if value is None:
            continue
        current = getattr(settings, f.name)
        # an object flag overrides the block's keys it names and keeps the others
        setattr(settings, f.name, {**current, **value} if isinstance(current, dict) else value)
    if isinstance(settings.micro_batch, str) and settings.micro_batch.isdigit():
        settings.micro_batch = int(settings.micro_batch)  # the flag's text; the block gives a number
    if args.ep_size is not None:
        settings.model = {**settings.model, "moe_ep_size": args.ep_size}
    if isinstance(settings.variant, str) and isinstance(settings.model, dict) and isinstance(settings.controller, dict):
        # an arch set where the variant is, or over it, must agree with it; a --variant flag replaces the block's arch
        _apply_variant(settings, arch_given=args.arch is not None or (args.variant is None and "arch" in block),
                       warn=warn)
    if isinstance(settings.init_from, str) and args.tokenizer is None:
        # streamed text: the folder's tokenizer, which comes with the weights (over a ds_config's bpe:N, say)
        settings.tokenizer = settings.init_from
    return settings, ds_config, args.preset is not None or "preset" in block


def _apply_variant(settings: RunSettings, arch_given: bool, warn: bool = True) -> None:
    """`variant`: its architecture where no arch is given (validate() refuses a variant of another one), then its
    model and controller overrides under the explicit ones. A renamed variant's old spelling means what it meant,
    with one warning that names the new spelling (none where `warn` is false)."""
    name = settings.variant
    log = logger.warning if warn else logger.debug
    if name in RENAMED_VARIANTS:
        new = VARIANTS[RENAMED_VARIANTS[name]]
        # the old spelling set MoD fields: with another arch that reads them (the hybrid), it sets them there
        if arch_given and settings.arch != new.arch and not unused_fields(settings.arch, new.model):
            log("--variant %s is deprecated and goes in 0.3; with arch %s it is --model '%s'", name, settings.arch,
                json.dumps(new.model))
            settings.variant, settings.model = None, {**new.model, **settings.model}
            return
        log("--variant %s is deprecated and goes in 0.3; it is now spelt --variant %s", name, RENAMED_VARIANTS[name])
        settings.variant = name = RENAMED_VARIANTS[name]
    if name not in VARIANTS:
        return  # validate() names the valid choices
    entry = variant_overrides(name)
    if not arch_given:
        settings.arch = entry.arch
    settings.model = {**entry.model, **settings.model}
    settings.controller = {**entry.controller, **settings.controller}


def _default_json(f: Field) -> str:
    return json.dumps(f.default_factory() if f.default is MISSING else f.default)


def settings_markdown() -> str:
    """The settings table of docs/training.md: block key and flag, type, default, meaning."""
    hints = _types(RunSettings)
    lines = ["| block key / flag | type | default | meaning |", "|---|---|---|---|"]
    for f in fields(RunSettings):
        meta = f.metadata
        choices = f" One of {', '.join(f'`{c}`' for c in meta['choices'])}." if meta["choices"] else ""
        bound = (f" At least {meta['at_least']}." if meta["at_least"] is not None else
                 f" Above {meta['above']}." if meta["above"] is not None else "")
        lines.append(f"| `{f.name}` / `--{f.name}` | {_type_name(hints[f.name], article=False)} | "
                     f"`{_default_json(f)}` | {meta['help'].replace('|', '/')}.{choices}{bound} |")
    return "\n".join(lines)


def write_settings_table(path: str) -> None:
    """Regenerate the settings table (docs/training.md) between its ``<!-- settings -->`` markers."""
    from ..markdown_sections import replace_section

    replace_section(path, "settings", settings_markdown(), "Run settings")
