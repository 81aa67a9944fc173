"""DeepSpeed training checkpoints: periodic, atomic, verified, pruned; a corrupt one is set aside at resume.

    checkpointer.py  Checkpointer: the one owner of where a run resumes, when it saves, its rollbacks and its stop save
    manager.py   the collective save, load and resume
    storage.py   the files: names, atomic writes, the manifest, pruning, setting a bad checkpoint aside
    identity.py  what a run is, so that only the run that wrote a checkpoint resumes it
    universal.py DeepSpeed's universal format, for a resume on another number of processes or ep_size (MoE too)
    consolidate.py  the zero_to_fp32.py / zero_to_torch.py installed in OUTPUT_DIR/checkpoints, for every architecture

Layout: OUTPUT_DIR/checkpoints/<tag>/ holds DeepSpeed's files (module, ZeRO optimizer shards, expert files,
scheduler, loss scaler), each rank's RNG state and data position, the tokenizer and generation_config.json,
`manifest.json` (every other file's relative path, size and CRC-32) and `run.json` (the states every rank shares);
OUTPUT_DIR/checkpoints/latest names the newest complete checkpoint.
"""

from ...ds_checkpoint import resolve_tag_dir
from .checkpointer import Checkpointer, Resume
from .identity import (
    LAYOUT_KEYS,
    changes_layout,
    check_compatible,
    check_resumable,
    run_identity,
    with_new_model_fields,
)
from .manager import load, restore, resume_candidate, save
from .storage import (
    CHECKPOINTS,
    LATEST,
    MANIFEST,
    RUN_STATE,
    CheckpointError,
    CheckpointLoadError,
    CheckpointSaveError,
    SavesFailedError,
    checkpoint_root,
    latest_tag,
    read_rank_state,
    read_run_state,
    write_json,
)
from .universal import check_param_groups, universal_tag

__all__ = [
    "CHECKPOINTS", "LATEST", "MANIFEST", "RUN_STATE", "LAYOUT_KEYS", "CheckpointError", "CheckpointLoadError",
    "CheckpointSaveError", "SavesFailedError", "Checkpointer", "changes_layout", "check_compatible",
    "check_param_groups", "check_resumable", "checkpoint_root", "latest_tag", "load", "read_rank_state",
    "read_run_state", "Resume", "resolve_tag_dir", "restore", "resume_candidate", "run_identity", "save",
    "universal_tag", "with_new_model_fields", "write_json",
]
