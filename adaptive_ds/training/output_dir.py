"""Where a run without --output_dir lives. (What a directory may hold, and the checkpoint it resumes:
`Checkpointer.open`.)"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping

from .. import distributed

IDENTITY = "run_identity.json"  # what a run is (checkpoint/identity.py), written when it starts
JOB_OUTPUT_DIR = "adaptive_ds/output_dir"  # torchrun's agent store: the directory of the job's first round


def default_output_dir(preset: str | None, arch: str, environ: Mapping[str, str] = os.environ) -> str:
    """Where a run without --output_dir lives (rank 0 decides): a directory that a restart or requeue of the same
    job finds again, so that it resumes there instead of starting another run.

    Under Slurm the job's id names it (`runs/PRESET-ARCH-slurm-JOBID`: a requeued job keeps its id); under
    torchrun, the rendezvous id (`runs/PRESET-ARCH-RDZV_ID`, torchrun's --rdzv_id, a random one with
    --standalone). Otherwise a new time-stamped directory (`runs/PRESET-ARCH-YYYYmmdd-HHMMSS`); under torchrun's
    default rendezvous id ("none", shared by every job) the agent's store keeps the first round's choice, so that
    the agent's restarts of the same job find it.
    """
    name = f"runs/{preset or 'pretrained'}-{arch}"  # --init_from a folder of no preset's shape
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
