"""The one reader of a DeepSpeed config: batch geometry, precision, ZeRO stage and offload, as training, the
planner and the grid understand them.

DeepSpeed reads the same JSON itself; this module answers our questions about it (how many rows per rank, how
many bytes per weight, which states are partitioned or offloaded) and names what is wrong with it before any
process group exists. `problems()` collects every issue; `read()` raises them as one `ConfigError`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "bf16")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


class ConfigError(ValueError):
    """Bad user input: one line that names the problem and the valid choices."""


# The configs that ship with the package (package data): the repository's ds_configs/ is this folder.
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_configs")


def shipped() -> list[str]:
    """The file names of the shipped configs."""
    return sorted(name for name in os.listdir(SHIPPED_DIR) if name.endswith(".json"))


def resolve(path: str) -> str:
    """The file a `--ds_config` names: the path itself where it exists; otherwise a shipped config named by its file
    name alone (b1_t4.json) or as the repository's commands write it (ds_configs/b1_t4.json), so that they run from
    any working directory, an installed wheel's included. Anything else is returned as given (`load` names it)."""
    if os.path.isfile(path):
        return path
    name = os.path.basename(path)
    if os.path.normpath(path) in (name, os.path.join("ds_configs", name)) and name in shipped():
        return os.path.join(SHIPPED_DIR, name)
    return path


def load(path: str) -> dict:
    """The JSON object in the ds_config file that `path` names (see `resolve`)."""
    given, path = path, resolve(path)
    if not os.path.isfile(path):
        raise ConfigError(f"ds_config {given!r} does not exist; pass a JSON file, or the name of a shipped config: "
                          f"{', '.join(shipped())}")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"ds_config {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"ds_config {path!r} must hold a JSON object, not {type(config).__name__}")
    return config


@dataclass(frozen=True)
class DeepSpeedLayout:
    """What a ds_config says about batches, precision and where the model states live."""

    micro_batch: int  # train_micro_batch_size_per_gpu: rows per rank per forward
    accumulation: int  # gradient_accumulation_steps
    train_batch_size: int | None  # rows per optimizer step over all ranks, when the config fixes it
    precision: str  # one of PRECISIONS
    zero_stage: int
    offload_optimizer: str  # one of OFFLOAD_DEVICES
    offload_param: str

    @property
    def half_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def rows_per_rank_step(self) -> int:
        return self.micro_batch * self.accumulation

    def implied_world_size(self) -> int | None:
        """The number of ranks train_batch_size was written for (None: the config does not fix it)."""
        return None if self.train_batch_size is None else self.train_batch_size // self.rows_per_rank_step


def _section(ds_config: dict, key: str) -> dict:
    value = ds_config.get(key, {})
    return value if isinstance(value, dict) else {}


def _enabled(ds_config: dict) -> list[str]:
    """The half precisions the config enables (DeepSpeed also accepts "bfloat16" as the bf16 section's name)."""
    bf16 = _section(ds_config, "bf16").get("enabled") or _section(ds_config, "bfloat16").get("enabled")
    return [name for name, on in (("fp16", _section(ds_config, "fp16").get("enabled")), ("bf16", bf16)) if on]


def _offload(zero: dict, key: str) -> str:
    section = zero.get(key) or {}
    return str(section.get("device", "none")) if isinstance(section, dict) else "none"


def precision(ds_config: dict) -> str:
    """fp32, fp16 or bf16 (the first of the two a config that enables both names: `problems()` reports it)."""
    return (_enabled(ds_config) or ["fp32"])[0]


def problems(ds_config: dict, world_size: int | None = None) -> list[str]:
    """Everything wrong with the ds_config's batch sizes, precision and ZeRO section; with `world_size`, also
    whether train_batch_size = micro-batch x accumulation x world size."""
    found = []
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accum = ds_config.get("gradient_accumulation_steps", 1)
    total = ds_config.get("train_batch_size")
    if micro is None:
        found.append("the ds_config must set train_micro_batch_size_per_gpu")
    else:
        sizes = (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum),
                 *((("train_batch_size", total),) if total is not None else ()))
        bad = [f"{k}={v!r}" for k, v in sizes if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            found.append(f"batch sizes must be positive integers: {', '.join(bad)}")
        elif total is not None and world_size is not None and total != micro * accum * world_size:
            found.append(f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                         f"gradient_accumulation_steps {accum} x world size {world_size} = "
                         f"{micro * accum * world_size}; fix one or drop train_batch_size")
    if len(_enabled(ds_config)) > 1:
        found.append("fp16 and bf16 are both enabled; enable at most one")
    zero = _section(ds_config, "zero_optimization")
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES or isinstance(stage, bool):
        found.append(f"zero_optimization.stage {stage!r} is not one of {', '.join(map(str, ZERO_STAGES))}")
    for key in ("offload_optimizer", "offload_param"):
        device = _offload(zero, key)
        if device not in OFFLOAD_DEVICES:
            found.append(f"zero_optimization.{key}.device {device!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
    if _offload(zero, "offload_param") != "none" and stage != 3:
        found.append(f"zero_optimization.offload_param needs ZeRO stage 3 (DeepSpeed ignores it at stage {stage!r}); "
                     "set stage 3 or remove offload_param")
    return found


def read(ds_config: dict) -> DeepSpeedLayout:
    """The layout of a ds_config; a ConfigError names everything `problems()` finds in it."""
    found = problems(ds_config)
    if found:
        raise ConfigError("; ".join(found))
    zero = _section(ds_config, "zero_optimization")
    return DeepSpeedLayout(
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        accumulation=ds_config.get("gradient_accumulation_steps", 1),
        train_batch_size=ds_config.get("train_batch_size"),
        precision=precision(ds_config), zero_stage=zero.get("stage", 0),
        offload_optimizer=_offload(zero, "offload_optimizer"), offload_param=_offload(zero, "offload_param"))


def keep_global_batch(ds_config: dict, rows: int, world_size: int, micro_batch: int | None = None,
                      written_on: int | None = None) -> dict:
    """`ds_config` re-split so that one optimizer step is still `rows` rows over `world_size` processes: the
    micro-batch `micro_batch` (default: the config's), and the gradient accumulation that makes up the rest (a
    warning says so). A resume on another number of processes keeps its checkpoint's global batch this way, so it
    continues on the same samples at the same steps; `written_on`: the number of processes the checkpoint was
    written on, for the warning. The config itself when it already makes `rows`; a ConfigError when `rows` does
    not split into micro-batches of `micro_batch` on `world_size` processes."""
    if read(ds_config).rows_per_rank_step * world_size == rows:
        return ds_config
    micro = micro_batch or ds_config["train_micro_batch_size_per_gpu"]
    if rows % (micro * world_size):
        raise ConfigError(f"the checkpoint's global batch of {rows} rows does not split into micro-batches "
                          f"of {micro} on {world_size} processes; pass a --micro_batch that divides "
                          f"{rows // world_size}")
    accumulation = rows // (micro * world_size)
    logger.warning("resuming a %d-process run on %d: gradient accumulation %d keeps its global batch of %d "
                   "rows", written_on or world_size, world_size, accumulation, rows)
    kept = {**ds_config, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation}
    kept.pop("train_batch_size", None)
    return kept
