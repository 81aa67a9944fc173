"""The one owner of a run's checkpoints: where it resumes, when it saves, how it rolls back, and the save of a stop.

The loop reaches checkpointing through a `Checkpointer` only, as torchtitan's does through its CheckpointManager:

    resume = Checkpointer.open(output_dir, identity)         # before the engine: where the run starts
    checkpointer = Checkpointer(engine, states={...}, resume=resume, ...)
    checkpointer.restore()                                   # the newest complete checkpoint, every state loaded
    checkpointer.maybe_save(step, healthy)                   # at its cadence, from healthy weights only
    checkpointer.roll_back()                                 # a bad step: back to the latest checkpoint
    checkpointer.save_on_stop(step, stop, healthy)           # a signal: save there, then StopRequested
    checkpointer.save_at_end(step, healthy)                  # the run's last step

A checkpoint is DeepSpeed's engine (model, optimizer, schedule, loss scaler), each rank's RNG, the tokenizer, and the
union of the `states` (any objects with `state_dict()` / `load_state_dict()`), laid out as checkpoints always were
(`_TOP_LEVEL`, `_PER_RANK`), so that old checkpoints resume.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist

from ... import distributed
from ...ds_config import ConfigError
from ..output_dir import IDENTITY, default_output_dir
from ..stop import Progress, StopRequest, StopRequested
from . import manager, storage
from .identity import LAYOUT_KEYS, check_compatible, check_resumable, run_identity
from .storage import CORRUPT, CheckpointError, CheckpointLoadError, CheckpointSaveError, SavesFailedError

logger = logging.getLogger(__name__)

# What a run writes before its first checkpoint: a directory holding only these (and an identity equal to this
# run's) is this same run, killed before it saved anything, and starts over.
OWN_FILES = {IDENTITY, "metrics.jsonl", "abandoned_metrics.jsonl", "decisions.jsonl", "checkpoints", "tensorboard",
             "wandb", "loss.svg", "loss.png"}  # loss.png: the plot of earlier versions

# Where each state lives in a checkpoint, the one place that maps states to the files. run.json (written by rank 0)
# holds the states every rank shares: the "trainer" and "metrics" states' keys at its top level, where checkpoints
# have always held them (step, data_steps, loss, identity, ...), any other state under its own name (the
# "controller"'s knobs and counters). A state that each rank holds for itself is in <name>_rank{r}.json ("data":
# the rank's position in a streamed source; a state_dict() of None writes no file).
_TOP_LEVEL, _PER_RANK = ("trainer", "metrics"), ("data",)


@dataclass(frozen=True)
class Resume:
    """Where a run starts (`Checkpointer.open`): its output directory, the checkpoint it resumes (None: it starts
    afresh) with that checkpoint's shared state, checked against the run's identity, and how the run's stop lines
    say to continue it."""

    output_dir: str
    tag: str | None
    saved: dict | None  # the checkpoint's run.json
    rerun: str

    @property
    def rows_per_step(self) -> int | None:
        """The global batch the checkpoint trained with, which a resume on another number of processes keeps."""
        return self.saved["identity"]["rows_per_step"] if self.saved else None

    @property
    def world_size(self) -> int | None:
        """The number of processes that wrote the checkpoint."""
        return self.saved["identity"]["world_size"] if self.saved else None


class Checkpointer:
    """One run's checkpoints.

    Cadence: every `save_steps` steps (0: only at the end of the run), and never from weights that are not healthy:
    a boundary met while the loss is non-finite or spiking is postponed to the first healthy step after it, so every
    checkpoint (and so every rollback target) holds weights whose recorded loss was healthy.

    A save that cannot be written (a full disk, no permission) costs a warning and leaves the previous checkpoint
    the latest; the next boundary tries again, until `max_failed_saves` have failed in a row (`failed_saves`; a
    successful save resets it) and the run stops with SavesFailedError, which `amend_record(step, counts)` records
    in the step's metrics first. `on_saved(step)` follows each save at a boundary or a stop (the Hub push).

    `states`: name -> object with `state_dict()` / `load_state_dict()`, loaded in their order at a resume. A
    rollback loads the engine and RNG only, and hands each state that has `rolled_back(state)` its saved state
    (what else comes back is that state's choice: the controller keeps its new knobs).
    """

    def __init__(self, engine, states: dict, resume: Resume, identity: dict, tokenizer, *, save_steps: int,
                 keep_last: int, max_steps: int, max_failed_saves: int = 3, stop_grace_s: float = 30,
                 progress: Progress | None = None, on_saved: Callable[[int], None] | None = None,
                 amend_record: Callable[[int, dict], None] | None = None):
        self.engine, self.states, self.identity, self.tokenizer = engine, states, identity, tokenizer
        self.output_dir, self.resume_tag = resume.output_dir, resume.tag
        self.save_steps, self.keep_last, self.max_steps = save_steps, keep_last, max_steps
        self.max_failed_saves, self.stop_grace_s = max_failed_saves, stop_grace_s
        self.progress = progress or Progress()
        self.progress.rerun = resume.rerun  # the one copy this run's lines read (`rerun`), its own and __main__'s
        self.on_saved, self.amend_record = on_saved, amend_record
        self.pending = False  # a boundary met unhealthy weights: the save is owed
        self.last_saved: int | None = None
        self.failed_saves = 0  # saves that failed in a row, since the last one that succeeded
        self.failed_saves_total = 0  # saves that failed since this process started the run
        if distributed.rank() == 0:
            storage.write_json(os.path.join(self.output_dir, IDENTITY), identity)

    @property
    def rerun(self) -> str:
        """How the run's lines say to continue it (`Progress.rerun`, which `open` decided)."""
        return self.progress.rerun

    # where the run starts; `run_identity` (what a run is, checkpoint/identity.py) is reached here, so that the loop
    # reaches checkpointing through this one class (tests/unit/test_checkpoint.py holds it)
    run_identity = staticmethod(run_identity)

    @staticmethod
    def open(output_dir: str | None, identity: dict, resume: str = "auto", progress: Progress | None = None
             ) -> Resume:
        """The run's directory and the checkpoint it resumes; agreed on by every rank, created by rank 0, checked
        before anything is written. Without `output_dir`, the job's own (`default_output_dir`).

        A new or empty directory starts a run; one with a checkpoint continues it (`resume` "auto"; "never" refuses
        it); one that holds only this same run's own files (checked by the identity it wrote) starts over with a
        warning, so the same command always continues; anything else is refused and left as it is. The newest
        checkpoint that matches its manifest is the one resumed (a corrupt newest one is set aside), and it must
        belong to this run (`check_resumable`).
        """
        path = output_dir or (default_output_dir(identity["preset"], identity["arch"]) if distributed.rank() == 0
                              else None)
        path = distributed.broadcast_object(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"output_dir {path!r} is a file; pass a new or empty --output_dir")
        tag = storage.latest_tag(path) if os.path.isdir(path) else None
        if tag is None and os.path.isdir(path) and os.listdir(path):
            _check_only_own_files(path, identity)
        if tag is not None and resume == "never":
            raise ConfigError(f"output_dir {path!r} holds checkpoint {tag}; pass --resume auto to continue it or a "
                              "new --output_dir")
        dist.barrier()  # every rank has checked before rank 0 creates it
        if distributed.rank() == 0:
            os.makedirs(path, exist_ok=True)
        rerun = "rerun the same command" if output_dir else f"rerun the same command with --output_dir {path}"
        progress = progress or Progress()
        progress.rerun = rerun
        if tag is not None:
            tag = manager.resume_candidate(path)  # verified; a corrupt newest one is set aside for the previous
        if tag is None:
            return Resume(path, None, None, rerun)
        progress.checkpoint = os.path.join(storage.checkpoint_root(path), tag)
        return Resume(path, tag, check_resumable(path, tag, identity), rerun)

    # saves
    @property
    def snapshot_dir(self) -> str:
        """Where an `on_saved` callback stages what it exports of the checkpoint just saved (the Hub push's weights):
        beside the checkpoints, where neither pruning nor a resume takes it for one (it is not a step<N> tag)."""
        return os.path.join(storage.checkpoint_root(self.output_dir), "hub_snapshot")

    def boundary(self, step: int) -> bool:
        """Whether `step` is a save boundary, or a save is owed (the loop reads the step losses there)."""
        return self.pending or bool(self.save_steps and step % self.save_steps == 0 and step < self.max_steps)

    def maybe_save(self, step: int, healthy: bool) -> bool:
        """At a boundary (or after one that was postponed): save now when the weights are healthy, else owe it.
        Returns whether a checkpoint of `step` was written."""
        self.pending = self.boundary(step)
        return self.pending and healthy and self._save_or_warn(step)

    def save_on_stop(self, step: int, stop: StopRequest, healthy: bool) -> NoReturn:
        """End the run at `step` as a signal asked: with a checkpoint where the weights are healthy and the grace
        period has not passed (collective), and a line that says how the same command resumes it."""
        name = signal.Signals(stop.signum).name
        reason = None
        if self.last_saved != step:
            if not healthy:
                reason = "its loss is not healthy"
            elif not stop.within_grace():
                reason = f"the grace period of {self.stop_grace_s} s had passed"
            else:
                self._save_or_warn(step)
        latest = storage.latest_tag(self.output_dir)
        if self.last_saved == step:
            line = f"stopped by {name} at step {step}, saved; {self.rerun} to resume from step {step}"
        else:
            resume = f"resume from {latest}" if latest else "start again (no checkpoint was saved yet)"
            line = (f"stopped by {name} at step {step} without a checkpoint there ({reason or 'its save failed'}); "
                    f"{self.rerun} to {resume}")
        raise StopRequested(line, stop.signum)

    def save_at_end(self, step: int, healthy: bool) -> None:
        """The run's last step, unless it is saved already or trained nothing; its failure stops the run
        (SavesFailedError: no boundary follows to try again)."""
        if not healthy:
            logger.warning("no checkpoint at the last step %d: its loss is not healthy", step)
        elif self.last_saved != step and step > 0:
            self._save(step, last=True)

    def _save_or_warn(self, step: int) -> bool:
        """A checkpoint at a boundary or a stop; one that cannot be written (a full disk) costs a warning, not the
        run: the previous checkpoint stays the latest, and the next boundary tries again. The max_failed_saves-th
        failure in a row stops the run (SavesFailedError, let through)."""
        try:
            self._save(step)
        except CheckpointSaveError as error:
            logger.warning("%s; training goes on and the next save point tries again (%d of max_failed_saves %d "
                           "failed in a row)", error, self.failed_saves, self.max_failed_saves)
            return False
        if self.on_saved:
            self.on_saved(step)
        return True

    def _save(self, step: int, last: bool = False) -> None:
        """Save the union of the states at `step` (collective). A save that cannot be written raises
        CheckpointSaveError (the previous checkpoint stays the latest; the next boundary tries again), or
        SavesFailedError where the run cannot go on: the `max_failed_saves`-th failure in a row, or the run's `last`
        save (no boundary follows it); its counts go into the step's metrics record first."""
        shared, own = self._state_dicts()
        try:
            manager.save(self.engine, self.output_dir, step, shared, self.keep_last, self.tokenizer, own,
                         progress=self.progress)
        except CheckpointSaveError as error:
            self.failed_saves, self.failed_saves_total = self.failed_saves + 1, self.failed_saves_total + 1
            if last or self.failed_saves >= self.max_failed_saves:
                if self.amend_record:
                    self.amend_record(step, {"failed_saves": self.failed_saves,
                                             "failed_saves_total": self.failed_saves_total})
                raise self._gave_up(step, error, last) from None
            raise
        finally:
            self.pending = False  # written, or failed: the next boundary tries again
        self.failed_saves = 0
        self.last_saved = step

    def _state_dicts(self) -> tuple[dict, dict]:
        """The states as they are written (`_TOP_LEVEL`, `_PER_RANK`): run.json's dict, and this rank's own states
        by name."""
        shared, own = {}, {}
        for name, state in self.states.items():
            if name in _PER_RANK:
                own[name] = state.state_dict()
                continue
            part = state.state_dict() if name in _TOP_LEVEL else {name: state.state_dict()}
            clash = shared.keys() & part.keys()  # run.json is one dict: a state would overwrite another's key
            assert not clash, f"state {name!r} writes run.json keys another state writes: {sorted(clash)}"
            shared.update(part)
        return shared, own

    def _state_of(self, name: str, saved: dict, tag: str):
        """State `name`'s part of a checkpoint whose run.json is `saved` (the inverse of `_state_dicts`)."""
        if name in _TOP_LEVEL:
            return saved
        if name in _PER_RANK:
            return storage.read_rank_state(self.output_dir, tag, name, distributed.rank())
        return saved[name]

    def _gave_up(self, step: int, error: CheckpointSaveError, last: bool) -> SavesFailedError:
        """The run's one line when its saves stop it: the cause, the last good checkpoint, how to go on."""
        latest = storage.latest_tag(self.output_dir)
        what = (f"the checkpoint of the run's last step {step} could not be saved" if last else
                f"{self.failed_saves} checkpoint saves in a row failed (max_failed_saves {self.max_failed_saves}), "
                f"the last at step {step}")
        good = (f"the last good checkpoint is {os.path.join(storage.checkpoint_root(self.output_dir), latest)}"
                if latest else "no checkpoint was saved yet")
        then = "resume from it" if latest else "start again"
        return SavesFailedError(f"{what} ({error.cause}); {good}; {self.rerun} to {then} once that is fixed")

    # loads
    def restore(self) -> int | None:
        """Resume: the newest complete checkpoint, every state loaded in order; one DeepSpeed cannot load is set
        aside for the previous verified one. Returns its step (None: nothing to resume); CheckpointError when
        nothing is left to restore."""
        tag, root = self.resume_tag, storage.checkpoint_root(self.output_dir)
        while tag is not None:
            try:
                saved = manager.restore(self.engine, self.output_dir, tag, self.identity)
            except CheckpointLoadError as error:
                if distributed.rank() == 0:
                    storage.set_aside(root, tag, str(error))
                dist.barrier()
                tag = manager.resume_candidate(self.output_dir)
                if tag is None:
                    raise CheckpointError(f"no complete checkpoint left in {root!r} to resume (the last one: {error}); "
                                          f"the corrupt ones were moved aside to <tag>{CORRUPT}<time>; start a new "
                                          "--output_dir") from None
                self.progress.checkpoint = os.path.join(root, tag)
                continue
            self.resume_tag = tag
            self.last_saved = saved["step"]  # on disk already: a stop at this step writes nothing over it
            for name, state in self.states.items():
                state.load_state_dict(self._state_of(name, saved, tag))
            return saved["step"]
        return None

    def roll_back(self) -> int | None:
        """Back to the latest checkpoint's engine and RNG (through the universal format when it was written on
        another layout: the checkpoint a run resumed from on a new one); each state with `rolled_back` gets its
        saved state. Returns the checkpoint's step (None: there is no checkpoint yet)."""
        tag = storage.latest_tag(self.output_dir)
        if tag is None:
            return None
        saved = manager.restore(self.engine, self.output_dir, tag, self.identity)
        self.pending = False  # a save postponed before the rollback was owed by steps now undone
        for name, state in self.states.items():
            if hasattr(state, "rolled_back"):
                state.rolled_back(self._state_of(name, saved, tag))
        return saved["step"]


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
        check_compatible(saved, identity, "", allowed=(*LAYOUT_KEYS, "rows_per_step"))
    except CheckpointError:
        return False
    return True


def _check_only_own_files(path: str, identity: dict) -> None:
    """A directory without a checkpoint that is not empty: this same run's files from an attempt stopped before its
    first checkpoint start over with a warning; anything else is refused and left as it is."""
    foreign = sorted(set(os.listdir(path)) - OWN_FILES)
    if foreign or not _same_run(_saved_identity(path), identity):
        what = f"files of something else ({', '.join(foreign[:5])})" if foreign else "another run's files"
        raise ConfigError(f"output_dir {path!r} holds {what} but no checkpoint; pass a new or empty --output_dir")
    logger.warning("output_dir %r holds this run's files from an attempt stopped before its first checkpoint; "
                   "starting over (its metrics move to abandoned_metrics.jsonl)", path)
