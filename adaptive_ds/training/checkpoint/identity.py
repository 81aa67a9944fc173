"""What a run is, so that a checkpoint is resumed only by the run that wrote it (perhaps on another layout)."""

from __future__ import annotations

import functools
import json
import logging
import os

from ... import distributed
from ...data import EMBEDDED, tokenizer_identity
from ...models import AdaptiveDSConfig
from .storage import CheckpointError, checkpoint_root, read_run_state

logger = logging.getLogger(__name__)

# What may differ between a checkpoint and the run that resumes it (its files are then converted: manager.restore)
LAYOUT_KEYS = ("world_size", "model.moe_ep_size")
# Where the --init_from weights were found, and their files' sizes and mtimes: the weights are their hash's
SOURCE_LOCATION_KEYS = ("base_model.source", "base_model.files")
# What the model's config records beside its function: the stock family its weights came from (for export --to
# auto) and the special tokens' ids (the tokenizer's, which `tokenizer` in the identity checks); a run saved before
# they were recorded resumes
MODEL_METADATA_KEYS = ("model.source_model_type", "model.bos_token_id", "model.eos_token_id", "model.pad_token_id")


def run_identity(settings, world_size: int, rows_per_rank_step: int, config, base_model: dict | None = None) -> dict:
    """What a checkpoint must match to be resumed by this run (as it reads back from JSON). `base_model`: the
    pretrained weights the run started from (--init_from: the source and its content hash), so that a resume checks
    the folder is still the one it started from; absent for a run from random weights, as before it existed."""
    identity = {"preset": settings.preset, "arch": settings.arch, "data": settings.data, "seed": settings.seed,
                "tokenizer": tokenizer_identity(settings.data, settings.tokenizer),
                "world_size": world_size, "rows_per_step": rows_per_rank_step * world_size,
                "model": config.to_dict()}
    if base_model is not None:
        identity["base_model"] = base_model
    return json.loads(json.dumps(identity))


@functools.cache
def _warn_once(message: str) -> None:
    """One warning per process for `message` (a checkpoint is checked at start-up and again when it is loaded)."""
    if distributed.rank() == 0:
        logger.warning(message)


def check_compatible(saved: dict, current: dict, where: str, allowed: tuple[str, ...] = ()) -> None:
    """The checkpoint must come from the same model and batch layout as this run, except for the `allowed`
    keys (`key` or `key.subkey`); the --init_from weights by their hash, wherever they are now.

    Prepared data's tokenizer is recorded by its hash (`tokenizer_identity`, "sha256:..."); an identity written
    before that holds the --tokenizer string instead, which prepared data ignores. Such an identity (on the same
    `data`, checked as any other key) is taken with one warning: which tokenizer it trained on cannot be checked."""
    differences, unchecked = [], None
    allowed = (*allowed, *SOURCE_LOCATION_KEYS, *MODEL_METADATA_KEYS)
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
    the checkpoint loads through DeepSpeed's universal format."""
    return (saved["world_size"] != current["world_size"]
            or saved["model"].get("moe_ep_size", 1) != current["model"].get("moe_ep_size", 1))


def with_new_model_fields(identity: dict) -> dict:
    """`identity` with the model fields added to AdaptiveDSConfig since it was written, at what they mean for a
    config without them (`AdaptiveDSConfig.from_dict`, the one place that decides it: a new option's default, or
    the behaviour such a checkpoint was trained with), so that a new field alone does not block the resume."""
    model = identity.get("model")
    if not isinstance(model, dict):
        return identity
    completed = json.loads(json.dumps(AdaptiveDSConfig.from_dict(model).to_dict()))
    return {**identity, "model": {**completed, **model}}


def kept_global_batch(saved: dict, identity: dict) -> bool:
    """Whether checkpoint run state `saved` comes from this same ds_config (its rows per process), so that a global
    batch it holds that differs from this run's is one a resume on another number of processes kept, not a change
    of batch. A checkpoint from before the state recorded it: False."""
    configured = saved.get("configured_rows_per_rank")
    return configured is not None and configured * identity["world_size"] == identity["rows_per_step"]


def check_resumable(output_dir: str, tag: str, identity: dict) -> dict:
    """Checkpoint `tag`'s run state, after checking that it belongs to this run (before anything is written). On
    another number of processes the global batch may differ: the run keeps the checkpoint's (the Trainer re-derives
    its accumulation)."""
    saved = read_run_state(output_dir, tag)
    where = os.path.join(checkpoint_root(output_dir), tag)
    if "knobs" not in saved.get("controller", {}):
        raise CheckpointError(f"checkpoint {where!r} was written by an older adaptive_ds (no controller knobs); "
                              "resume it with that version or start a new --output_dir")
    other_layout = saved["identity"].get("world_size") != identity.get("world_size")
    allowed = (*LAYOUT_KEYS, "rows_per_step") if other_layout or kept_global_batch(saved, identity) else LAYOUT_KEYS
    check_compatible(with_new_model_fields(saved["identity"]), identity, where, allowed=allowed)
    return saved
