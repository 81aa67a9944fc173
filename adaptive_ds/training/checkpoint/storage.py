"""A checkpoint on disk: its names, atomic files, the manifest that proves it complete, and setting a bad one aside.

OUTPUT_DIR/checkpoints/<tag>/ holds DeepSpeed's files, each rank's RNG state and data position, the tokenizer and
generation_config.json, `manifest.json` (every other file's relative path, size and CRC-32) and `run.json` (the
run's state); OUTPUT_DIR/checkpoints/latest names the newest complete checkpoint. Nothing here is collective:
`manager.py` shares the work out over the ranks.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import zlib

import numpy as np
import torch

from ...ds_checkpoint import CHECKPOINTS, LATEST, RUN_STATE, CheckpointError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CORRUPT = ".corrupt-"  # <tag>.corrupt-<time>: a checkpoint set aside at resume
TAG = re.compile(r"step\d{8}")
_CHUNK = 16 << 20


class CheckpointSaveError(CheckpointError):
    """A save that could not be written (e.g. a full disk); the previous checkpoint and `latest` are intact.
    `cause`: what failed, in one line (the OSError's words; the rank's too, on several processes)."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


class SavesFailedError(CheckpointError):
    """A run's saves kept failing (max_failed_saves in a row, or the save at its last step): the run stops, its one
    line naming the cause and the last good checkpoint."""


class CheckpointLoadError(CheckpointError):
    """Files that DeepSpeed could not load (on some rank): the resume sets them aside and falls back."""


def tag_of(step: int) -> str:
    return f"step{step:08d}"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def latest_tag(output_dir: str) -> str | None:
    path = os.path.join(checkpoint_root(output_dir), LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed into place: a reader never sees half a file."""
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


def write_json(path: str, obj: dict) -> None:
    """Write `obj` as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=2))


def read_run_state(output_dir: str, tag: str) -> dict:
    path = os.path.join(checkpoint_root(output_dir), tag, RUN_STATE)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {os.path.dirname(path)!r} is incomplete or corrupt ({e}); "
                              "remove it or point 'latest' at an earlier checkpoint") from None


def rank_state_file(name: str, rank: int) -> str:
    """The file of a state each rank saves for itself (`data_rank0.json`: the data position)."""
    return f"{name}_rank{rank}.json"


def read_rank_state(output_dir: str, tag: str, name: str, rank: int) -> dict | None:
    """Rank `rank`'s state `name` saved with checkpoint `tag` (None when it saved none: a source that needs no
    position)."""
    path = os.path.join(checkpoint_root(output_dir), tag, rank_state_file(name, rank))
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def free_space(path: str) -> int:
    """Free bytes on the file system that holds `path`, or would hold it (a directory a failed save never made)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def first_failure(failures: list[str | None]) -> str | None:
    """The first of the ranks' failures (None: none failed), naming its rank when there are several ranks."""
    ranked = [f"rank {r}: {f}" if len(failures) > 1 else f for r, f in enumerate(failures) if f]
    return ranked[0] if ranked else None


# the manifest
def list_files(where: str) -> list[str]:
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


def file_entry(where: str, path: str) -> dict:
    full = os.path.join(where, path)
    return {"size": os.path.getsize(full), "crc32": _crc32(full)}


def publish(root: str, tag: str, entries: dict, run_state: dict) -> str | None:
    """manifest.json, run.json, then `latest`, each atomically; returns what failed (None: published).

    `entries` keep the listing's order (largest first), which is also how verification shares the files out.
    """
    where = os.path.join(root, tag)
    try:
        write_atomic(os.path.join(where, MANIFEST), json.dumps({"files": entries}, indent=1))
        write_atomic(os.path.join(where, RUN_STATE), json.dumps(run_state, indent=2))
        write_atomic(os.path.join(root, LATEST), tag)
    except OSError as e:
        return one_line(e)
    return None


def read_manifest(where: str) -> tuple[list | None, str | None]:
    """(the manifest's [path, entry] pairs, or None for a checkpoint without one; what is wrong, or None)."""
    if not os.path.isdir(where):
        return None, "its directory is missing"
    try:
        with open(os.path.join(where, RUN_STATE)) as f:
            json.load(f)
    except FileNotFoundError:
        return None, f"no {RUN_STATE}: its save did not finish"
    except (OSError, json.JSONDecodeError) as e:
        return None, f"{RUN_STATE} is unreadable ({one_line(e)})"
    if not os.path.isfile(os.path.join(where, MANIFEST)):
        return None, None
    try:
        with open(os.path.join(where, MANIFEST)) as f:
            return list(json.load(f)["files"].items()), None
    except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
        return None, f"{MANIFEST} is unreadable ({one_line(e)})"


def check_file(where: str, path: str, entry: dict) -> str | None:
    """What is wrong with one file of a checkpoint against its manifest entry, or None."""
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
        return f"{path} cannot be read ({one_line(e)})"
    return None


# the set of checkpoints
def candidates(root: str) -> list[str]:
    """`latest`, then the older complete checkpoints, newest first."""
    latest = latest_tag(os.path.dirname(root))
    if latest is None:
        return []
    older = [t for t in os.listdir(root) if TAG.fullmatch(t) and t < latest
             and os.path.isfile(os.path.join(root, t, RUN_STATE))]
    return [latest, *sorted(older, reverse=True)]


def prune(root: str, latest: str, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; remove older ones and partial ones (never `latest`, never a
    checkpoint set aside as corrupt: that is evidence)."""
    tags = sorted(t for t in os.listdir(root)
                  if t.startswith("step") and CORRUPT not in t and os.path.isdir(os.path.join(root, t)))
    complete = [t for t in tags if t <= latest and os.path.isfile(os.path.join(root, t, RUN_STATE))]
    keep = set(complete[-keep_last:]) | {latest}
    for tag in tags:
        if tag not in keep:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)


def set_aside(root: str, tag: str, problem: str) -> None:
    """Rename a bad checkpoint out of the way (evidence, not deleted) and point `latest` at the previous complete
    one (or remove `latest` when there is none)."""
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
        previous = candidates(root)[1:2]
        if previous:
            write_atomic(os.path.join(root, LATEST), previous[0])
        else:
            os.remove(os.path.join(root, LATEST))
    logger.warning("checkpoint %s cannot be resumed (%s); %s; falling back to the previous complete checkpoint",
                   where, problem, moved)
