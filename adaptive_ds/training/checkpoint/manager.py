"""The run's checkpoints: when to save, what a checkpoint holds, and how a run comes back to one (collective).

A checkpoint is the union of the state of the run's stateful parts, as torchtitan's CheckpointManager and litgpt's
state dict keep it: DeepSpeed's engine (model, optimizer, schedule, loss scaler) in its own files; the trainer's
`state_dict()` (step, data position, identity, the controller's state) in run.json; the data's `state_dict()` (a
streamed source's position) per rank in data_rank{r}.json; the RNG per rank in rng_rank{r}.pt; and the tokenizer, so
that an export needs nothing else.

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
from .storage import (
    CORRUPT,
    CheckpointError,
    CheckpointLoadError,
    CheckpointSaveError,
    SavesFailedError,
    checkpoint_root,
    latest_tag,
)
from .universal import check_param_groups, universal_tag

logger = logging.getLogger(__name__)


def save(engine, output_dir: str, step: int, run_state: dict, keep_last: int, tokenizer,
         data_state: dict | None = None) -> str:
    """Save a checkpoint at `step` (collective), then point `latest` at it and prune to `keep_last`.

    `data_state`: this rank's data position beyond the step count (a streamed source's). Raises CheckpointSaveError
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
    written = _write_files(engine, root, tag, client_state, tokenizer, data_state)
    failed = storage.first_failure(distributed.all_gather_object(written))
    if failed is None:
        failed = _commit(root, tag, run_state, keep_last)
    if failed is not None:
        previous, free = latest_tag(output_dir), storage.free_space(root)
        if rank == 0 and tag != previous:
            shutil.rmtree(where, ignore_errors=True)
        dist.barrier()
        raise CheckpointSaveError(
            f"checkpoint {tag} could not be saved in {root!r} ({failed}); {storage.human(free)} free there when it "
            f"failed; the partial {tag} was removed and `latest` still names {previous or 'no checkpoint'}", failed)
    distributed.progress.checkpoint = where
    return tag


def _write_files(engine, root: str, tag: str, client_state: dict, tokenizer, data_state: dict | None) -> str | None:
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
        if data_state is not None:
            storage.write_json(os.path.join(root, tag, f"data_rank{rank}.json"), data_state)
        if rank == 0:
            tokenizer.save_pretrained(os.path.join(root, tag, "tokenizer"))
            consolidate.install_scripts(root)  # over DeepSpeed's zero_to_fp32.py, which cannot read MoE checkpoints
    except (OSError, RuntimeError) as e:
        return storage.one_line(e)
    return None


def _commit(root: str, tag: str, run_state: dict, keep_last: int) -> str | None:
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
            distributed.progress.checkpoint = where  # complete from here on, even if a peer is lost now
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
            distributed.progress.checkpoint = os.path.join(root, tag)
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


class Checkpointer:
    """One run's checkpoints. The loop asks `should_save(step)`, calls `save(step)`, and `restore()`: at the start
    (a resume: the newest complete checkpoint, every stateful part loaded) or after a bad step (a rollback:
    `rollback_target()`, the engine and RNG only; what else the trainer restores is the trainer's choice).

    Cadence: every `save_steps` steps (0: only at the end of the run), and never from weights that are not healthy:
    a boundary met while the loss is non-finite or spiking is postponed to the first healthy step after it, so every
    checkpoint (and so every rollback target) holds weights whose recorded loss was healthy.

    A save that cannot be written (a full disk, no permission) leaves the previous checkpoint the latest; the next
    boundary tries again, until `max_failed_saves` have failed in a row (`failed_saves`; a successful save resets
    it) and the run stops.

    `parts`: the stateful parts besides the engine and RNG: "run" (run.json: the trainer's `state_dict()`, the
    controller's within it) and "data" (each rank's data position), each with `state_dict()` / `load_state_dict()`.
    """

    def __init__(self, output_dir: str, identity: dict, engine, parts: dict, tokenizer, save_steps: int,
                 keep_last: int, resume_tag: str | None = None, max_failed_saves: int = 3):
        self.output_dir, self.identity, self.engine, self.parts = output_dir, identity, engine, parts
        self.tokenizer, self.save_steps, self.keep_last, self.resume_tag = tokenizer, save_steps, keep_last, resume_tag
        self.max_failed_saves = max_failed_saves
        self.pending = False  # a boundary met unhealthy weights: the save is owed
        self.last_saved: int | None = None
        self.failed_saves = 0  # saves that failed in a row, since the last one that succeeded
        self.failed_saves_total = 0  # saves that failed since this process started the run

    def boundary(self, step: int, max_steps: int) -> bool:
        """Whether `step` is a save boundary, or a save is owed (the loop reads the step losses there)."""
        return self.pending or bool(self.save_steps and step % self.save_steps == 0 and step < max_steps)

    def should_save(self, step: int, max_steps: int, healthy: bool) -> bool:
        """At a boundary (or after one that was postponed): save now when the weights are healthy, else owe it."""
        self.pending = self.boundary(step, max_steps)
        return self.pending and healthy

    def save(self, step: int, last: bool = False) -> None:
        """Save the union of the parts' states at `step` (collective). A save that cannot be written raises
        CheckpointSaveError (the previous checkpoint stays the latest; the next boundary tries again), or
        SavesFailedError where the run cannot go on: the `max_failed_saves`-th failure in a row, or the run's `last`
        save (no boundary follows it)."""
        data = self.parts["data"].state_dict()
        try:
            save(self.engine, self.output_dir, step, self.parts["run"].state_dict(), self.keep_last, self.tokenizer,
                 data)
        except CheckpointSaveError as error:
            self.failed_saves, self.failed_saves_total = self.failed_saves + 1, self.failed_saves_total + 1
            if last or self.failed_saves >= self.max_failed_saves:
                raise self._gave_up(step, error, last) from None
            raise
        finally:
            self.pending = False  # written, or failed: the next boundary tries again
        self.failed_saves = 0
        self.last_saved = step

    def _gave_up(self, step: int, error: CheckpointSaveError, last: bool) -> SavesFailedError:
        """The run's one line when its saves stop it: the cause, the last good checkpoint, how to go on."""
        latest = latest_tag(self.output_dir)
        what = (f"the checkpoint of the run's last step {step} could not be saved" if last else
                f"{self.failed_saves} checkpoint saves in a row failed (max_failed_saves {self.max_failed_saves}), "
                f"the last at step {step}")
        good = (f"the last good checkpoint is {os.path.join(checkpoint_root(self.output_dir), latest)}" if latest
                else "no checkpoint was saved yet")
        then = "resume from it" if latest else "start again"
        return SavesFailedError(f"{what} ({error.cause}); {good}; {distributed.progress.rerun} to {then} once "
                                "that is fixed")

    def rollback_target(self) -> str | None:
        return latest_tag(self.output_dir)

    def restore(self, rollback: bool = False) -> dict | None:
        """Resume (the default): the newest complete checkpoint; one DeepSpeed cannot load is set aside for the
        previous verified one; the run's and the data's states loaded. Rollback: the latest checkpoint's engine and
        RNG. Returns its run state (None: nothing to resume); CheckpointError when nothing is left to restore."""
        if rollback:
            tag = self.rollback_target()
            if tag is None:
                return None
            saved = restore(self.engine, self.output_dir, tag, self.identity)
            self.pending = False  # a save postponed before the rollback was owed by steps now undone
            return saved
        tag, root = self.resume_tag, checkpoint_root(self.output_dir)
        while tag is not None:
            try:
                saved = restore(self.engine, self.output_dir, tag, self.identity)
            except CheckpointLoadError as error:
                if distributed.rank() == 0:
                    storage.set_aside(root, tag, str(error))
                dist.barrier()
                tag = resume_candidate(self.output_dir)
                if tag is None:
                    raise CheckpointError(f"no complete checkpoint left in {root!r} to resume (the last one: {error}); "
                                          f"the corrupt ones were moved aside to <tag>{CORRUPT}<time>; start a new "
                                          "--output_dir") from None
                continue
            self.resume_tag = tag
            self.last_saved = saved["step"]  # on disk already: a stop at this step writes nothing over it
            self.parts["run"].load_state_dict(saved)
            self.parts["data"].load_state_dict(storage.read_data_state(self.output_dir, tag, distributed.rank()))
            return saved
        return None
