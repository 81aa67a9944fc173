"""The output directory of a run: new, empty, a checkpoint to continue, or this same run's files to start over."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping

import torch.distributed as dist

from .. import distributed
from . import checkpoint
from .arguments import ConfigError, RunSettings

logger = logging.getLogger(__name__)

IDENTITY = "run_identity.json"
JOB_OUTPUT_DIR = "adaptive_ds/output_dir"  # torchrun's agent store: the directory of the job's first round
# What a run writes before its first checkpoint: a directory holding only these (and an identity equal to this
# run's) is this same run, killed before it saved anything, and starts over.
OWN_FILES = {IDENTITY, "metrics.jsonl", "abandoned_metrics.jsonl", "decisions.jsonl", "checkpoints", "tensorboard",
             "wandb", "loss.png"}


def _saved_identity(path: str) -> dict | None:
    try:
        with open(os.path.join(path, IDENTITY)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _same_run(saved: dict | None, identity: dict) -> bool:
    """The same run, perhaps on another number of processes or ep_size (as a checkpoint may be)."""
    if saved is None:
        return False
    try:
        checkpoint.check_compatible(saved, identity, "", allowed=(*checkpoint.LAYOUT_KEYS, "rows_per_step"))
    except checkpoint.CheckpointError:
        return False
    return True


def default_output_dir(settings: RunSettings, environ: Mapping[str, str] = os.environ) -> str:
    """Where a run without --output_dir lives (rank 0 decides): a directory that a restart or requeue of the same
    job finds again, so that it resumes there instead of starting another run.

    Under Slurm the job's id names it (`runs/PRESET-ARCH-slurm-JOBID`: a requeued job keeps its id); under
    torchrun, the rendezvous id (`runs/PRESET-ARCH-RDZV_ID`, torchrun's --rdzv_id, a random one with
    --standalone). Otherwise a new time-stamped directory (`runs/PRESET-ARCH-YYYYmmdd-HHMMSS`); under torchrun's
    default rendezvous id ("none", shared by every job) the agent's store keeps the first round's choice, so that
    the agent's restarts of the same job find it.
    """
    name = f"runs/{settings.preset or 'pretrained'}-{settings.arch}"  # --init_from a folder of no preset's shape
    if environ.get("SLURM_JOB_ID"):
        return f"{name}-slurm-{_safe(environ['SLURM_JOB_ID'])}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"{name}-{_safe(run_id)}"
    path = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    store = distributed.job_store()
    if store is None:
        return path
    # the first round's rank 0 sets it; a restart round's rank 0 finds it set and keeps it
    return store.compare_set(JOB_OUTPUT_DIR, "", path).decode()


def _safe(name: str) -> str:
    """A launcher's id as a directory name: path separators and other odd characters become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def prepare_output_dir(settings: RunSettings, identity: dict) -> tuple[str, str | None]:
    """The run's directory and the checkpoint to resume (or None); agreed on by every rank, created by rank 0.

    A new or empty directory starts a run; one with a checkpoint continues it (`--resume auto`); one that holds
    only this same run's own files (checked by the identity it wrote) starts over with a warning, so the same
    command always continues; anything else is refused and left as it is.
    """
    path = settings.output_dir or (default_output_dir(settings) if distributed.rank() == 0 else None)
    path = distributed.broadcast_object(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"output_dir {path!r} is a file; pass a new or empty --output_dir")
    tag = checkpoint.latest_tag(path) if os.path.isdir(path) else None
    if tag is None and os.path.isdir(path) and os.listdir(path):
        foreign = sorted(set(os.listdir(path)) - OWN_FILES)
        if foreign or not _same_run(_saved_identity(path), identity):
            what = f"files of something else ({', '.join(foreign[:5])})" if foreign else "another run's files"
            raise ConfigError(f"output_dir {path!r} holds {what} but no checkpoint; pass a new or empty "
                              "--output_dir")
        logger.warning("output_dir %r holds this run's files from an attempt stopped before its first checkpoint; "
                       "starting over (its metrics move to abandoned_metrics.jsonl)", path)
    if tag is not None and settings.resume == "never":
        raise ConfigError(f"output_dir {path!r} holds checkpoint {tag}; pass --resume auto to continue it or a new "
                          "--output_dir")
    dist.barrier()  # every rank has checked before rank 0 creates it
    if distributed.rank() == 0:
        os.makedirs(path, exist_ok=True)
    if tag is not None:
        tag = checkpoint.resume_candidate(path)  # verified; a corrupt newest one is set aside for the previous
    return path, tag


def write_identity(path: str, identity: dict) -> None:
    checkpoint.write_json(os.path.join(path, IDENTITY), identity)
