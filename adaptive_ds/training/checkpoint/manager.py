"""A checkpoint's collective save, load and resume (the `Checkpointer` in checkpointer.py decides when and what).

A checkpoint is the union of the state of the run's stateful parts, as torchtitan's CheckpointManager and litgpt's
state dict keep it: DeepSpeed's engine (model, optimizer, schedule, loss scaler) in its own files; the states every
rank shares in run.json; each rank's own states in <name>_rank{r}.json (a streamed source's position); the RNG per
rank in rng_rank{r}.pt; and the tokenizer and generation_config.json, so that an export needs nothing else.

Save: every rank writes its files, then the manifest's checksums are computed in parallel (file i, by size, on rank
i % world, so their cost on one rank does not grow with the world size), and manifest.json, run.json and `latest`
are written last, each atomically: a process killed at any moment leaves `latest` at a complete checkpoint. A save
that fails to write (a full disk) removes its own partial directory and raises CheckpointSaveError.

Resume: the newest checkpoint is checked against its manifest before DeepSpeed reads it; one that fails, or that
DeepSpeed cannot load, is renamed `<tag>.corrupt-<time>` (evidence, never pruned) with one warning, and the
previous complete one is tried. A checkpoint written on another number of processes or expert-parallel size loads
through DeepSpeed's universal format. Every rank must see the checkpoint directory (shared storage).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import zipfile

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)

from ... import distributed
from . import consolidate, storage
from .identity import changes_layout, check_resumable
from .storage import CORRUPT, CheckpointError, CheckpointLoadError, CheckpointSaveError, checkpoint_root, latest_tag
from .universal import check_param_groups, universal_tag

logger = logging.getLogger(__name__)


def save(engine, output_dir: str, step: int, run_state: dict, keep_last: int, tokenizer,
         rank_states: dict | None = None, progress=None) -> str:
    """Save a checkpoint at `step` (collective), then point `latest` at it and prune to `keep_last`.

    `run_state`: run.json's dict. `rank_states`: this rank's own states by name (a state of None writes no file).
    `progress` (stop.Progress): records the checkpoint once it is complete. Raises CheckpointSaveError
    (on every rank) when a rank cannot write its files: the partial directory is removed (it never became a
    checkpoint), `latest` and the previous checkpoints are untouched.
    """
    root, tag, rank = checkpoint_root(output_dir), storage.tag_of(step), distributed.rank()
    where = os.path.join(root, tag)
    if rank == 0 and os.path.isdir(where) and tag != latest_tag(output_dir):
        shutil.rmtree(where)  # left by a save of this step that was cut off: it never became a checkpoint
    client_state = {"run": run_state}
    if not engine.has_moe_layers:
        # lets deepspeed.checkpoint.ds_to_universal convert it, to resume on another number of processes (DeepSpeed
        # reserves this key in its MoE checkpoint path; MoE checkpoints are converted by universal.py instead)
        client_state[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    written = _write_files(engine, root, tag, client_state, tokenizer, rank_states or {})
    failed = storage.first_failure(distributed.all_gather_object(written))
    if failed is None:
        failed = _commit(root, tag, run_state, keep_last, progress)
    if failed is not None:
        previous, free = latest_tag(output_dir), storage.free_space(root)
        if rank == 0 and tag != previous:
            shutil.rmtree(where, ignore_errors=True)
        dist.barrier()
        raise CheckpointSaveError(
            f"checkpoint {tag} could not be saved in {root!r} ({failed}); {storage.human(free)} free there when it "
            f"failed; the partial {tag} was removed and `latest` still names {previous or 'no checkpoint'}", failed)
    if progress is not None:
        progress.checkpoint = where
    return tag


def _write_files(engine, root: str, tag: str, client_state: dict, tokenizer, rank_states: dict) -> str | None:
    """This rank's files of the checkpoint; returns what failed (None: all written)."""
    try:
        engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as e:
        if distributed.lost_contact(e):
            raise
        dist.barrier()  # stands in for the closing barrier of DeepSpeed's save, where the other ranks wait
        return storage.one_line(e)
    rank = distributed.rank()
    try:
        torch.save(storage.rng_state(), os.path.join(root, tag, f"rng_rank{rank}.pt"))
        for name, state in rank_states.items():
            if state is not None:
                storage.write_json(os.path.join(root, tag, storage.rank_state_file(name, rank)), state)
        if rank == 0:
            tokenizer.save_pretrained(os.path.join(root, tag, "tokenizer"))
            # what final/ will carry (--init_from's eos ids and sampling defaults), for an export of this checkpoint
            engine.module.generation_config.save_pretrained(os.path.join(root, tag))
            consolidate.install_scripts(root)  # over DeepSpeed's zero_to_fp32.py, which cannot read MoE checkpoints
    except (OSError, RuntimeError) as e:
        return storage.one_line(e)
    return None


def _commit(root: str, tag: str, run_state: dict, keep_last: int, progress=None) -> str | None:
    """Manifest (checksums in parallel), run.json, `latest`, prune (collective); returns what failed, on every rank."""
    where = os.path.join(root, tag)
    rank, world = distributed.rank(), distributed.world_size()
    files = distributed.broadcast_object(storage.list_files(where) if rank == 0 else None)
    try:
        mine, failed = {path: storage.file_entry(where, path) for path in files[rank::world]}, None
    except OSError as e:
        mine, failed = {}, storage.one_line(e)
    gathered = distributed.gather_object((mine, failed))
    if rank == 0:
        failed = storage.first_failure([f for _, f in gathered])
        if failed is None:
            entries = {path: entry for part, _ in gathered for path, entry in part.items()}
            failed = storage.publish(root, tag, {path: entries[path] for path in files}, run_state)
        if failed is None:
            if progress is not None:
                progress.checkpoint = where  # complete from here on, even if a peer is lost now
            storage.prune(root, tag, keep_last)
            logger.info("saved checkpoint %s", where)
    return distributed.broadcast_object(failed)


def resume_candidate(output_dir: str) -> str | None:
    """The newest checkpoint whose files match their manifest (collective; rank 0 decides, every rank gets it).

    None when OUTPUT_DIR has no checkpoint. Starting at `latest`, each checkpoint that fails verification (a file
    missing, truncated or changed since the save; no run.json) is set aside with one warning, and the previous
    complete one is tried; CheckpointError when none is left. The checksums are read in parallel (file i on rank
    i % world). Checkpoints without a manifest (written before manifests existed) pass on their run.json alone.
    """
    root = checkpoint_root(output_dir)
    candidates = distributed.broadcast_object(storage.candidates(root) if distributed.rank() == 0 else None)
    problems = []
    for tag in candidates:
        problem = _verify(os.path.join(root, tag))
        if problem is None:
            dist.barrier()  # rank 0 has finished renaming and repointing `latest`
            return tag
        problems.append(f"{tag}: {problem}")
        if distributed.rank() == 0:
            storage.set_aside(root, tag, problem)
    if not candidates:
        return None
    raise CheckpointError(f"no complete checkpoint left in {root!r} to resume ({'; '.join(problems)}); the "
                          f"corrupt ones were moved aside to <tag>{CORRUPT}<time>; start a new --output_dir")


def _verify(where: str) -> str | None:
    """What is wrong with checkpoint directory `where`, or None (collective; every rank gets rank 0's answer)."""
    rank, world = distributed.rank(), distributed.world_size()
    files, problem = distributed.broadcast_object(storage.read_manifest(where) if rank == 0 else None)
    if problem is None and files:
        mine = (storage.check_file(where, path, entry) for path, entry in files[rank::world])
        problems = distributed.gather_object(next((p for p in mine if p), None))
        problem = next((p for p in problems if p), None) if rank == 0 else None
    return distributed.broadcast_object(problem)


def load(engine, output_dir: str, tag: str, rng_tag: str | None = None) -> dict:
    """Restore engine, optimizer, scheduler, loss scaler and this rank's RNG; returns the run state.

    `rng_tag`: where the RNG states are (the original checkpoint when `tag` is its universal conversion);
    a rank that did not exist when the checkpoint was written keeps its seeded RNG. Raises CheckpointLoadError on
    every rank when any rank cannot load its files (the files are left as they were).
    """
    root = checkpoint_root(output_dir)
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
        failed = storage.one_line(e)
    failed = storage.first_failure(distributed.all_gather_object(failed))
    if failed is not None:
        raise CheckpointLoadError(f"checkpoint {os.path.join(root, tag)!r} cannot be loaded ({failed})")
    if rng is not None:
        storage.set_rng_state(rng)
    return client.get("run", {})


def restore(engine, output_dir: str, tag: str, identity: dict) -> dict:
    """Load checkpoint `tag` into `engine` (checked by `check_resumable`); returns its run state.

    A checkpoint written on another number of processes or expert-parallel size (the one a run resumed from on a
    new layout stays the latest until the run's first save of its own) is converted to DeepSpeed's universal
    format first, and loaded with the engine's universal loading switched on for that load only.
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
