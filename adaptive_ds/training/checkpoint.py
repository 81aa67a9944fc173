"""DeepSpeed training checkpoints: periodic, atomic, verified, pruned; a corrupt one is set aside at resume.

Layout: OUTPUT_DIR/checkpoints/<tag>/ holds DeepSpeed's files (module, ZeRO optimizer shards, expert files,
scheduler, loss scaler), each rank's RNG state, the tokenizer, `manifest.json` (every other file's relative path,
size and CRC-32) and `run.json` (step, data position, what the run was); OUTPUT_DIR/checkpoints/latest names the
newest *complete* checkpoint. manifest.json, then run.json, then `latest` are written (each atomically) only after
every rank has finished writing, so a process killed at any moment leaves `latest` at a complete checkpoint and
the next start resumes from it (a partial tag directory, without run.json, is never loaded and is removed by the
next prune).

Save: the manifest's checksums are computed in parallel (file i, by size, on rank i % world), so their cost on
one rank does not grow with the world size. A save that fails to write (a full disk) removes its own partial
directory, leaves the previous checkpoint and `latest` as they were, and raises `CheckpointSaveError`.

Resume: `resume_candidate` checks the newest checkpoint's files against its manifest before DeepSpeed reads them;
a checkpoint that fails (or, through `restore_newest`, one DeepSpeed cannot load) is renamed to
`<tag>.corrupt-<time>` (kept as evidence, never pruned), with one warning, and the previous complete one is tried.
Checkpoints written before manifests existed still load: only their run.json is checked, not sizes or checksums.
Every rank must see the checkpoint directory (shared storage), as `latest` already requires.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import zipfile
import zlib
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)

from .. import distributed
from ..data import EMBEDDED, tokenizer_identity
from ..models import AdaptiveDSConfig
from . import consolidate, universal

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
RUN_STATE = "run.json"
CORRUPT = ".corrupt-"  # <tag>.corrupt-<time>: a checkpoint set aside at resume
_TAG = re.compile(r"step\d{8}")
_CHUNK = 16 << 20

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed or saved: one line; no checkpoint is deleted."""


class CheckpointSaveError(CheckpointError):
    """A save that could not be written (e.g. a full disk); the previous checkpoint and `latest` are intact."""


class CheckpointLoadError(CheckpointError):
    """Files that DeepSpeed could not load (on some rank): `restore_newest` sets them aside and falls back."""


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
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def save(engine, output_dir: str, step: int, run_state: dict, keep_last: int, tokenizer,
         data_state: dict | None = None) -> str:
    """Save a checkpoint at `step` (collective), then point `latest` at it and prune to `keep_last`.

    `data_state`: this rank's data position beyond the step count (a streamed source's), as `data_rank{r}.json`.

    The tokenizer is saved beside DeepSpeed's files, so `python -m adaptive_ds.export` needs nothing else.
    Raises CheckpointSaveError (on every rank) when a rank cannot write its files: the partial directory is
    removed (it never became a checkpoint), `latest` and the previous checkpoints are untouched.
    """
    root = checkpoint_root(output_dir)
    tag = f"step{step:08d}"
    where = os.path.join(root, tag)
    rank = distributed.rank()
    if rank == 0 and os.path.isdir(where) and tag != latest_tag(output_dir):
        shutil.rmtree(where)  # left by a save of this step that was cut off: it never became a checkpoint
    client_state = {"run": run_state}
    if not engine.has_moe_layers:
        # lets deepspeed.checkpoint.ds_to_universal convert it, to resume on another number of processes (DeepSpeed
        # reserves this key in its MoE checkpoint path; MoE checkpoints are converted by universal.py instead)
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    written = _write_files(engine, root, tag, client_state, tokenizer, data_state)
    failed = _first_failure(distributed.all_gather_object(written))
    if failed is None:
        failed = _commit(root, tag, run_state, keep_last)
    if failed is not None:
        previous, free = latest_tag(output_dir), shutil.disk_usage(root).free
        if rank == 0 and tag != previous:
            shutil.rmtree(where, ignore_errors=True)
        dist.barrier()
        raise CheckpointSaveError(
            f"checkpoint {tag} could not be saved in {root!r} ({failed}); {_human(free)} free there when it failed; "
            f"the partial {tag} was removed and `latest` still names {previous or 'no checkpoint'}")
    distributed.progress.checkpoint = where
    return tag


def _write_files(engine, root: str, tag: str, client_state: dict, tokenizer, data_state: dict | None) -> str | None:
    """This rank's files of the checkpoint (with its data position, where the source needs one); returns what
    failed (None: all written)."""
    try:
        engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as e:
        if distributed.lost_contact(e):
            raise
        dist.barrier()  # stands in for the closing barrier of DeepSpeed's save, where the other ranks wait
        return _one_line(e)
    try:
        torch.save(_rng_state(), os.path.join(root, tag, f"rng_rank{distributed.rank()}.pt"))
        if data_state is not None:
            _write_atomic(os.path.join(root, tag, f"data_rank{distributed.rank()}.json"), json.dumps(data_state))
        if distributed.rank() == 0:
            tokenizer.save_pretrained(os.path.join(root, tag, "tokenizer"))
            consolidate.install_scripts(root)  # over DeepSpeed's zero_to_fp32.py, which cannot read MoE checkpoints
    except (OSError, RuntimeError) as e:
        return _one_line(e)
    return None


def _first_failure(failures: list[str | None]) -> str | None:
    ranked = [f"rank {r}: {f}" if len(failures) > 1 else f for r, f in enumerate(failures) if f]
    return ranked[0] if ranked else None


def _commit(root: str, tag: str, run_state: dict, keep_last: int) -> str | None:
    """Manifest (checksums in parallel), run.json, `latest`, prune (collective); returns what failed, on every rank."""
    where = os.path.join(root, tag)
    rank, world = distributed.rank(), distributed.world_size()
    files = distributed.broadcast_object(_list_files(where) if rank == 0 else None)
    try:
        mine, failed = {path: _file_entry(where, path) for path in files[rank::world]}, None
    except OSError as e:
        mine, failed = {}, _one_line(e)
    gathered = distributed.gather_object((mine, failed))
    if rank == 0:
        failed = _first_failure([f for _, f in gathered])
        if failed is None:
            entries = {path: entry for part, _ in gathered for path, entry in part.items()}
            failed = _publish(root, tag, {path: entries[path] for path in files}, run_state)
        if failed is None:
            _prune(root, tag, keep_last)
            logger.info("saved checkpoint %s", where)
    return distributed.broadcast_object(failed)


def _publish(root: str, tag: str, entries: dict, run_state: dict) -> str | None:
    """Rank 0: manifest.json, run.json, then `latest`, each atomically; returns what failed (None: published).

    `entries` keep the listing's order (largest first), which is also how verification shares the files out.
    """
    where = os.path.join(root, tag)
    try:
        _write_atomic(os.path.join(where, MANIFEST), json.dumps({"files": entries}, indent=1))
        _write_atomic(os.path.join(where, RUN_STATE), json.dumps(run_state, indent=2))
        _write_atomic(os.path.join(root, LATEST), tag)
    except OSError as e:
        return _one_line(e)
    distributed.progress.checkpoint = where  # complete from here on, even if a peer is lost now
    return None


def _list_files(where: str) -> list[str]:
    """Every file under `where` (relative paths), largest first, so that i % world shares the bytes evenly."""
    paths = [os.path.relpath(os.path.join(top, name), where) for top, _, names in os.walk(where) for name in names]
    paths = [p for p in paths if p not in (MANIFEST, RUN_STATE)]
    return sorted(paths, key=lambda p: (-os.path.getsize(os.path.join(where, p)), p))


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_entry(where: str, path: str) -> dict:
    full = os.path.join(where, path)
    return {"size": os.path.getsize(full), "crc32": _crc32(full)}


def _prune(root: str, latest: str, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; remove older ones and partial ones (never `latest`, never a
    checkpoint set aside as corrupt: that is evidence)."""
    tags = sorted(t for t in os.listdir(root)
                  if t.startswith("step") and CORRUPT not in t and os.path.isdir(os.path.join(root, t)))
    complete = [t for t in tags if t <= latest and os.path.isfile(os.path.join(root, t, RUN_STATE))]
    keep = set(complete[-keep_last:]) | {latest}
    for tag in tags:
        if tag not in keep:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)


def resume_candidate(output_dir: str) -> str | None:
    """The newest checkpoint whose files match their manifest (collective; rank 0 decides, every rank gets it).

    None when OUTPUT_DIR has no checkpoint. Starting at `latest`, each checkpoint that fails verification (a file
    missing, truncated or changed since the save; no run.json) is set aside (renamed `<tag>.corrupt-<time>`,
    never deleted) with one warning, and the previous complete one is tried; CheckpointError when none is left.
    The checksums are read in parallel (file i on rank i % world). Checkpoints without a manifest (written before
    manifests existed) pass on their run.json alone.
    """
    root = checkpoint_root(output_dir)
    candidates = distributed.broadcast_object(_candidates(root) if distributed.rank() == 0 else None)
    problems = []
    for tag in candidates:
        problem = _verify(os.path.join(root, tag))
        if problem is None:
            dist.barrier()  # rank 0 has finished renaming and repointing `latest`
            distributed.progress.checkpoint = os.path.join(root, tag)
            return tag
        problems.append(f"{tag}: {problem}")
        if distributed.rank() == 0:
            _set_aside(root, tag, problem)
    if not candidates:
        return None
    raise CheckpointError(f"no complete checkpoint left in {root!r} to resume ({'; '.join(problems)}); the "
                          f"corrupt ones were moved aside to <tag>{CORRUPT}<time>; start a new --output_dir")


def _candidates(root: str) -> list[str]:
    """`latest`, then the older complete checkpoints, newest first."""
    latest = latest_tag(os.path.dirname(root))
    if latest is None:
        return []
    older = [t for t in os.listdir(root) if _TAG.fullmatch(t) and t < latest
             and os.path.isfile(os.path.join(root, t, RUN_STATE))]
    return [latest, *sorted(older, reverse=True)]


def _verify(where: str) -> str | None:
    """What is wrong with checkpoint directory `where`, or None (collective; every rank gets rank 0's answer)."""
    rank, world = distributed.rank(), distributed.world_size()
    files, problem = distributed.broadcast_object(_read_manifest(where) if rank == 0 else None)
    if problem is None and files:
        mine = (_check_file(where, path, entry) for path, entry in files[rank::world])
        problems = distributed.gather_object(next((p for p in mine if p), None))
        problem = next((p for p in problems if p), None) if rank == 0 else None
    return distributed.broadcast_object(problem)


def _read_manifest(where: str) -> tuple[list | None, str | None]:
    """(the manifest's [path, entry] pairs, or None for a checkpoint without one; what is wrong, or None)."""
    if not os.path.isdir(where):
        return None, "its directory is missing"
    try:
        with open(os.path.join(where, RUN_STATE)) as f:
            json.load(f)
    except FileNotFoundError:
        return None, f"no {RUN_STATE}: its save did not finish"
    except (OSError, json.JSONDecodeError) as e:
        return None, f"{RUN_STATE} is unreadable ({_one_line(e)})"
    if not os.path.isfile(os.path.join(where, MANIFEST)):
        return None, None
    try:
        with open(os.path.join(where, MANIFEST)) as f:
            return list(json.load(f)["files"].items()), None
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
        return None, f"{MANIFEST} is unreadable ({_one_line(e)})"


def _check_file(where: str, path: str, entry: dict) -> str | None:
    full = os.path.join(where, path)
    if not os.path.isfile(full):
        return f"{path} is missing"
    try:
        size = os.path.getsize(full)
        if size != entry["size"]:
            return f"{path} has {size} bytes, its manifest says {entry['size']}"
        if _crc32(full) != entry["crc32"]:
            return f"{path} fails its CRC-32 check (changed since the save)"
    except OSError as e:
        return f"{path} cannot be read ({_one_line(e)})"
    return None


def _set_aside(root: str, tag: str, problem: str) -> None:
    """Rank 0: rename a bad checkpoint out of the way (evidence, not deleted) and point `latest` at the previous
    complete one (or remove `latest` when there is none)."""
    where = os.path.join(root, tag)
    moved = "it is gone"
    if os.path.isdir(where):
        target = f"{where}{CORRUPT}{time.strftime('%Y%m%d-%H%M%S')}"
        suffix = 1
        while os.path.exists(target):
            target, suffix = f"{where}{CORRUPT}{time.strftime('%Y%m%d-%H%M%S')}-{suffix}", suffix + 1
        os.rename(where, target)
        moved = f"moved aside to {os.path.basename(target)}"
    if latest_tag(os.path.dirname(root)) == tag:
        previous = _candidates(root)[1:2]
        if previous:
            _write_atomic(os.path.join(root, LATEST), previous[0])
        else:
            os.remove(os.path.join(root, LATEST))
    logger.warning("checkpoint %s cannot be resumed (%s); %s; falling back to the previous complete checkpoint",
                   where, problem, moved)


def restore_newest(output_dir: str, tag: str, restore: Callable[[str], T]) -> T:
    """`restore(tag)` (the caller's resume: check the run state, load); when it raises CheckpointLoadError the
    checkpoint is set aside as corrupt and the previous verified one is restored instead (collective)."""
    root = checkpoint_root(output_dir)
    while True:
        try:
            return restore(tag)
        except CheckpointLoadError as error:
            if distributed.rank() == 0:
                _set_aside(root, tag, str(error))
            dist.barrier()
            tag = resume_candidate(output_dir)
            if tag is None:
                raise CheckpointError(f"no complete checkpoint left in {root!r} to resume (the last one: {error}); "
                                      f"the corrupt ones were moved aside to <tag>{CORRUPT}<time>; start a new "
                                      "--output_dir") from None


def read_run_state(output_dir: str, tag: str) -> dict:
    path = os.path.join(checkpoint_root(output_dir), tag, RUN_STATE)
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


# What may differ between a checkpoint and the run that resumes it (its files are then converted, see `resume`)
LAYOUT_KEYS = ("world_size", "model.moe_ep_size")


@functools.cache
def _warn_once(message: str) -> None:
    """One warning per process for `message` (a checkpoint is checked at start-up and again when it is loaded)."""
    if distributed.rank() == 0:
        logger.warning(message)


def check_compatible(saved: dict, current: dict, where: str, allowed: tuple[str, ...] = ()) -> None:
    """The checkpoint must come from the same model and batch layout as this run, except for the `allowed`
    keys (`key` or `key.subkey`).

    Prepared data's tokenizer is recorded by its hash (`tokenizer_identity`, "sha256:..."); an identity written
    before that holds the --tokenizer string instead, which prepared data ignores. Such an identity (on the same
    `data`, checked as any other key) is taken with one warning: which tokenizer it trained on cannot be checked."""
    differences, unchecked = [], None
    for key, value in current.items():
        old = saved.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            differences += [f"{key}.{k} {old.get(k)!r} (this run: {v!r})" for k, v in value.items()
                            if old.get(k) != v and k != "transformers_version" and f"{key}.{k}" not in allowed]
        elif (key == "tokenizer" and isinstance(old, str) and isinstance(value, str) and value.startswith("sha256:")
              and not old.startswith("sha256:") and old != EMBEDDED):
            what = f"checkpoint {where!r}" if where else "the run identity in the output directory"
            unchecked = (f"{what} records the tokenizer as --tokenizer {old!r}, as identities did before they "
                         "recorded prepared data's tokenizer by its hash: taken as this run's prepared tokenizer, "
                         "not checked")
        elif old != value and key not in allowed:
            differences.append(f"{key} {old!r} (this run: {value!r})")
    if differences:
        raise CheckpointError(f"checkpoint {where!r} does not match this run: {'; '.join(differences)}; "
                              "use a new --output_dir or the original settings")
    if unchecked:
        _warn_once(unchecked)


def changes_layout(saved: dict, current: dict) -> bool:
    """Whether identity `current` runs on another number of processes or expert-parallel size than `saved`, so
    the checkpoint loads through the universal format (`"checkpoint": {"load_universal": true}`)."""
    return (saved["world_size"] != current["world_size"]
            or saved["model"].get("moe_ep_size", 1) != current["model"].get("moe_ep_size", 1))


def universal_tag(output_dir: str, tag: str, ep_size: int = 1) -> str:
    """Convert checkpoint `tag` to DeepSpeed's universal format (once; rank 0) and return the converted tag.

    A universal checkpoint stores each parameter's fp32 weights and optimizer moments whole, so ZeRO can
    re-partition them over a different number of ranks (`"checkpoint": {"load_universal": true}`). An MoE
    checkpoint is converted by `universal.convert_moe_checkpoint`, its experts laid out for `ep_size`.
    """
    from deepspeed.checkpoint import ds_to_universal

    root = checkpoint_root(output_dir)
    experts = universal.has_experts(os.path.join(root, tag))
    converted = f"{tag}-universal-ep{ep_size}" if experts else f"{tag}-universal"
    error = None
    if distributed.rank() == 0 and not os.path.isdir(os.path.join(root, converted)):
        # written under another name and renamed when complete: an interrupted conversion is never loaded
        partial = os.path.join(root, f"{converted}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        args = argparse.Namespace(input_folder=os.path.join(root, tag), output_folder=partial,
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                  strict=True, inject_missing_state=False)
        try:
            if experts:
                universal.convert_moe_checkpoint(args.input_folder, partial, ep_size)
            else:
                ds_to_universal.main(args)
            os.replace(partial, os.path.join(root, converted))
            logger.info("converted %s to DeepSpeed's universal checkpoint %s", tag, converted)
        except (AssertionError, RuntimeError, OSError, KeyError, ValueError) as e:
            shutil.rmtree(partial, ignore_errors=True)
            error = (f"checkpoint {tag!r} cannot be converted to DeepSpeed's universal format for another number "
                     f"of processes or ep_size ({type(e).__name__}: {e})")
    error = distributed.broadcast_object(error)  # every rank fails together, none waits for rank 0
    if error:
        raise CheckpointError(error)
    return converted


def load(engine, output_dir: str, tag: str, rng_tag: str | None = None) -> dict:
    """Restore engine, optimizer, scheduler, loss scaler and this rank's RNG; returns the run state.

    `rng_tag`: where the RNG states are (the original checkpoint when `tag` is its universal conversion);
    a rank that did not exist when the checkpoint was written keeps its seeded RNG. Raises CheckpointLoadError on
    every rank when any rank cannot load its files (the files are left as they were).
    """
    root = checkpoint_root(output_dir)
    where = os.path.join(root, tag)
    rng_path = os.path.join(root, rng_tag or tag, f"rng_rank{distributed.rank()}.pt")
    failed, client, rng = None, {}, None
    try:
        load_path, client = engine.load_checkpoint(root, tag=tag)
        rng = torch.load(rng_path, weights_only=False) if os.path.exists(rng_path) else None
        if load_path is None:
            failed = "DeepSpeed found no model states"
    except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        if distributed.lost_contact(e):
            raise
        failed = _one_line(e)
    failed = _first_failure(distributed.all_gather_object(failed))
    if failed is not None:
        raise CheckpointLoadError(f"checkpoint {where!r} cannot be loaded ({failed})")
    if rng is not None:
        _set_rng_state(rng)
    return client.get("run", {})


def write_json(path: str, obj: dict) -> None:
    """Write `obj` as indented JSON, atomically (a reader never sees half a file)."""
    _write_atomic(path, json.dumps(obj, indent=2))


def run_identity(settings, world_size: int, rows_per_rank_step: int, config) -> dict:
    """What a checkpoint must match to be resumed by this run (as it reads back from JSON)."""
    identity = {"preset": settings.preset, "arch": settings.arch, "data": settings.data, "seed": settings.seed,
                "tokenizer": tokenizer_identity(settings.data, settings.tokenizer),
                "world_size": world_size, "rows_per_step": rows_per_rank_step * world_size,
                "model": config.to_dict()}
    return json.loads(json.dumps(identity))


def check_resumable(output_dir: str, tag: str, identity: dict) -> dict:
    """Checkpoint `tag`'s run state, after checking that it belongs to this run (before anything is written)."""
    saved = read_run_state(output_dir, tag)
    where = os.path.join(checkpoint_root(output_dir), tag)
    if "knobs" not in saved.get("controller", {}):
        raise CheckpointError(f"checkpoint {where!r} was written by an older adaptive_ds (no controller knobs); "
                              "resume it with that version or start a new --output_dir")
    check_compatible(with_new_model_fields(saved["identity"]), identity, where, allowed=LAYOUT_KEYS)
    return saved


def with_new_model_fields(identity: dict) -> dict:
    """`identity` with the model fields added to AdaptiveDSConfig since it was written, at what they mean for a
    config without them (`AdaptiveDSConfig.from_dict`, the one place that decides it: a new option's default, or
    the behaviour such a checkpoint was trained with), so that a new field alone does not block the resume."""
    model = identity.get("model")
    if not isinstance(model, dict):
        return identity
    completed = json.loads(json.dumps(AdaptiveDSConfig.from_dict(model).to_dict()))
    return {**identity, "model": {**completed, **model}}


def restore(engine, output_dir: str, tag: str, identity: dict) -> dict:
    """Load checkpoint `tag` into `engine` (checked by `check_resumable`); returns its run state. A resume and a
    rollback both restore through here.

    A checkpoint written on another number of processes or expert-parallel size (the one a run resumed from on a
    new layout stays the latest until the run's first save of its own) is converted to DeepSpeed's universal
    format first, and loaded with the engine's universal loading switched on for that load only; the model,
    optimizer and schedule continue exactly.
    """
    saved = check_resumable(output_dir, tag, identity)
    if not changes_layout(saved["identity"], identity):
        load(engine, output_dir, tag)
        return saved
    ep_size, written = identity["model"].get("moe_ep_size", 1), saved["identity"]
    logger.warning("loading a %d-process checkpoint (ep_size %d) on %d processes (ep_size %d) through DeepSpeed's "
                   "universal format", written["world_size"], written["model"].get("moe_ep_size", 1),
                   identity["world_size"], ep_size)
    converted = universal_tag(output_dir, tag, ep_size)
    check_param_groups(engine, os.path.join(checkpoint_root(output_dir), converted), tag)
    engine._config.load_universal_checkpoint = True  # DeepSpeed reads it when loading, and only then
    try:
        load(engine, output_dir, converted, rng_tag=tag)
    finally:
        engine._config.load_universal_checkpoint = False  # the run's own checkpoints are in its own layout
    return saved


def check_param_groups(engine, universal_dir: str, tag: str) -> None:
    """Refuse a universal checkpoint whose optimizer param groups do not pair with this run's: DeepSpeed's loader
    pairs them by position, and a group without a partner would keep its fresh weights and moments, silently.
    (MoE layers whose experts exceed one param group are grouped by ep_size: training/optim.py `moe_group_size`.)"""
    saved = torch.load(os.path.join(universal_dir, "zero", "optimizer_state.pt"), map_location="cpu",
                       weights_only=False)["param_groups"]
    current = engine.optimizer.optimizer.param_groups
    if len(saved) != len(current):
        raise CheckpointError(f"checkpoint {tag!r} holds {len(saved)} optimizer param groups and this run's layout "
                              f"{len(current)} (its MoE layers split into param groups by ep_size): resume on the "
                              f"checkpoint's moe_ep_size, or one whose layers fit one param group each")


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
