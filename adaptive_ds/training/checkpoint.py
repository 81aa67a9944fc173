"""DeepSpeed training checkpoints: periodic, atomic, pruned, and checked before they are resumed.

Layout: OUTPUT_DIR/checkpoints/<tag>/ holds DeepSpeed's files (module, ZeRO optimizer shards, expert files,
scheduler, loss scaler), each rank's RNG state and `run.json` (step, data position, what the run was);
OUTPUT_DIR/checkpoints/latest names the newest *complete* checkpoint. It is replaced atomically only after
every rank has finished writing, so a process killed at any moment leaves `latest` at a complete checkpoint
and the next start resumes from it (a partial tag directory is ignored, and removed by the next prune).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import random
import shutil
import zipfile

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)

from .. import distributed

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: one line, the files left as they were."""


def resolve_tag_dir(path: str) -> str:
    """A checkpoint directory from a tag directory, a checkpoints/ directory or a run's OUTPUT_DIR."""
    if os.path.isfile(os.path.join(path, "run.json")):
        return path
    for root in (os.path.join(path, CHECKPOINTS), path):
        latest = os.path.join(root, LATEST)
        if os.path.isfile(latest):
            with open(latest) as f:
                return os.path.join(root, f.read().strip())
    raise CheckpointError(f"{path!r} is not a checkpoint: expected OUTPUT_DIR, OUTPUT_DIR/checkpoints or "
                          "OUTPUT_DIR/checkpoints/<tag> (with a run.json)")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def latest_tag(output_dir: str) -> str | None:
    path = os.path.join(checkpoint_root(output_dir), LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, output_dir: str, step: int, run_state: dict, keep_last: int, tokenizer,
         data_state: dict | None = None) -> str:
    """Save a checkpoint at `step` (collective), then point `latest` at it and prune to `keep_last`.

    `data_state`: this rank's data position beyond the step count (a streamed source's), as `data_rank{r}.json`.

    The tokenizer is saved beside DeepSpeed's files, so `python -m adaptive_ds.export` needs nothing else.
    """
    root = checkpoint_root(output_dir)
    tag = f"step{step:08d}"
    client_state = {"run": run_state}
    if not engine.has_moe_layers:
        # lets deepspeed.checkpoint.ds_to_universal convert it, to resume on another number of processes
        # (DeepSpeed reserves this key in its MoE checkpoint path, which the universal converter does not handle)
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
    rank = distributed.rank()
    torch.save(_rng_state(), os.path.join(root, tag, f"rng_rank{rank}.pt"))
    if data_state is not None:
        _write_atomic(os.path.join(root, tag, f"data_rank{rank}.json"), json.dumps(data_state))
    dist.barrier()  # every rank's files are on disk
    if rank == 0:
        tokenizer.save_pretrained(os.path.join(root, tag, "tokenizer"))
        _write_atomic(os.path.join(root, tag, "run.json"), json.dumps(run_state, indent=2))
        _write_atomic(os.path.join(root, LATEST), tag)
        _prune(root, tag, keep_last)
        logger.info("saved checkpoint %s", os.path.join(root, tag))
    dist.barrier()
    return tag


def _prune(root: str, latest: str, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; remove older ones and partial ones (never `latest`)."""
    tags = sorted(t for t in os.listdir(root) if t.startswith("step") and os.path.isdir(os.path.join(root, t)))
    complete = [t for t in tags if t <= latest and os.path.isfile(os.path.join(root, t, "run.json"))]
    keep = set(complete[-keep_last:]) | {latest}
    for tag in tags:
        if tag not in keep:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)


def read_run_state(output_dir: str, tag: str) -> dict:
    path = os.path.join(checkpoint_root(output_dir), tag, "run.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {os.path.dirname(path)!r} is incomplete or corrupt ({e}); "
                              "remove it or point 'latest' at an earlier checkpoint") from None


def read_data_state(output_dir: str, tag: str, rank: int) -> dict | None:
    """Rank `rank`'s data position saved with checkpoint `tag` (None when its source needs none)."""
    path = os.path.join(checkpoint_root(output_dir), tag, f"data_rank{rank}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_compatible(saved: dict, current: dict, where: str) -> None:
    """The checkpoint must come from the same model and batch layout as this run."""
    differences = []
    for key, value in current.items():
        old = saved.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            differences += [f"{key}.{k} {old.get(k)!r} (this run: {v!r})" for k, v in value.items()
                            if old.get(k) != v and k != "transformers_version"]
        elif old != value:
            differences.append(f"{key} {old!r} (this run: {value!r})")
    if differences:
        raise CheckpointError(f"checkpoint {where!r} does not match this run: {'; '.join(differences)}; "
                              "use a new --output_dir or the original settings")


def universal_tag(output_dir: str, tag: str) -> str:
    """Convert checkpoint `tag` to DeepSpeed's universal format (once; rank 0) and return the converted tag.

    A universal checkpoint stores each parameter's fp32 weights and optimizer moments whole, so ZeRO can
    re-partition them over a different number of ranks (`"checkpoint": {"load_universal": true}`).
    """
    from deepspeed.checkpoint import ds_to_universal

    root = checkpoint_root(output_dir)
    converted = f"{tag}-universal"
    if distributed.rank() == 0 and not os.path.isdir(os.path.join(root, converted)):
        args = argparse.Namespace(input_folder=os.path.join(root, tag), output_folder=os.path.join(root, converted),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                  strict=True, inject_missing_state=False)
        try:
            ds_to_universal.main(args)
        except (AssertionError, RuntimeError, OSError, KeyError) as e:
            shutil.rmtree(os.path.join(root, converted), ignore_errors=True)
            raise CheckpointError(f"checkpoint {tag!r} cannot be converted to DeepSpeed's universal format for a "
                                  f"different number of processes ({type(e).__name__}: {e})") from None
        logger.info("converted %s to DeepSpeed's universal checkpoint %s", tag, converted)
    dist.barrier()
    return converted


def load(engine, output_dir: str, tag: str, rng_tag: str | None = None) -> dict:
    """Restore engine, optimizer, scheduler, loss scaler and this rank's RNG; returns the run state.

    `rng_tag`: where the RNG states are (the original checkpoint when `tag` is its universal conversion);
    a rank that did not exist when the checkpoint was written keeps its seeded RNG.
    """
    root = checkpoint_root(output_dir)
    where = os.path.join(root, tag)
    rng_path = os.path.join(root, rng_tag or tag, f"rng_rank{distributed.rank()}.pt")
    try:
        load_path, client = engine.load_checkpoint(root, tag=tag)
        rng = torch.load(rng_path, weights_only=False) if os.path.exists(rng_path) else None
    except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"checkpoint {where!r} cannot be loaded ({type(e).__name__}: {e}); "
                              "the files are left as they were") from None
    if load_path is None:
        raise CheckpointError(f"checkpoint {where!r} cannot be loaded; the files are left as they were")
    if rng is not None:
        _set_rng_state(rng)
    return client.get("run", {})


def write_json(path: str, obj: dict) -> None:
    """Write `obj` as indented JSON, atomically (a reader never sees half a file)."""
    _write_atomic(path, json.dumps(obj, indent=2))


def run_identity(settings, world_size: int, rows_per_rank_step: int, config) -> dict:
    """What a checkpoint must match to be resumed by this run (as it reads back from JSON)."""
    identity = {"preset": settings.preset, "arch": settings.arch, "data": settings.data, "seed": settings.seed,
                "tokenizer": settings.tokenizer if settings.data != "embedded" else "embedded",
                "world_size": world_size, "rows_per_step": rows_per_rank_step * world_size,
                "model": config.to_dict()}
    return json.loads(json.dumps(identity))


def resume(engine, output_dir: str, tag: str, identity: dict) -> dict:
    """Load checkpoint `tag` into `engine` after checking it belongs to this run; returns its run state.

    On a different number of processes the checkpoint is converted to DeepSpeed's universal format first; the
    model, optimizer and schedule continue exactly.
    """
    saved = read_run_state(output_dir, tag)
    where = os.path.join(checkpoint_root(output_dir), tag)
    if "knobs" not in saved.get("controller", {}):
        raise CheckpointError(f"checkpoint {where!r} was written by an older adaptive_ds (no controller knobs); "
                              "resume it with that version or start a new --output_dir")
    same_world = saved["identity"]["world_size"] == identity["world_size"]
    expected = identity if same_world else {**identity, "world_size": saved["identity"]["world_size"]}
    check_compatible(saved["identity"], expected, where)
    if same_world:
        load(engine, output_dir, tag)
    else:
        logger.warning("resuming a %d-process checkpoint on %d processes through DeepSpeed's universal format",
                       saved["identity"]["world_size"], identity["world_size"])
        load(engine, output_dir, universal_tag(output_dir, tag), rng_tag=tag)
    return saved


class Checkpointer:
    """Owns the save cadence: every `save_steps` steps (0: only at the end of the run), and never from weights
    that are not healthy. A boundary that falls while the loss is non-finite or spiking is postponed to the first
    healthy step after it, so every checkpoint (and so every rollback target) holds weights whose recorded loss
    was healthy."""

    def __init__(self, output_dir: str, save_steps: int, keep_last: int):
        self.output_dir, self.save_steps, self.keep_last = output_dir, save_steps, keep_last
        self.pending = False
        self.last_saved: int | None = None

    def due(self, step: int, max_steps: int) -> bool:
        """Whether a save is owed at `step` (a boundary now, or one postponed earlier)."""
        if self.save_steps and step % self.save_steps == 0 and step < max_steps:
            self.pending = True
        return self.pending

    def save(self, engine, step: int, run_state: dict, tokenizer, data_state: dict | None = None) -> None:
        save(engine, self.output_dir, step, run_state, self.keep_last, tokenizer, data_state)
        self.pending = False
        self.last_saved = step
