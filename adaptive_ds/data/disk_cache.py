"""A small on-disk cache for figures that are expensive to derive and never change for the same inputs.

The embedded corpus's entropy floor is estimated over half a million generated tokens (seconds of pure Python
per process). It depends only on the generator's code and the statistic's arguments, so every process of
every run (each rank, each test, each grid run) would otherwise recompute the same numbers. An entry's key
is a hash of those inputs, the generator's source included, so editing the generator invalidates it.

Entries live in ``$ADAPTIVE_DS_CACHE`` or ``$XDG_CACHE_HOME/adaptive_ds`` (default ``~/.cache/adaptive_ds``),
one small JSON file each, written atomically (a temporary file renamed into place, so concurrent ranks never
read half an entry). A missing, unreadable or corrupt entry is recomputed; a cache directory that cannot be
written is skipped with a debug message: the cache only ever saves time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    if os.environ.get("ADAPTIVE_DS_CACHE"):
        return Path(os.environ["ADAPTIVE_DS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive_ds"


def source_digest(*paths: str | os.PathLike) -> str:
    """A hash of source files' bytes: part of a key, so that changing the code that computes a figure
    invalidates it."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def cached_json(name: str, key: dict, compute: Callable[[], dict]) -> dict:
    """`compute()` (a JSON-serialisable dict), read from the cache when an entry for (`name`, `key`) exists."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir() / f"{name}-{digest}.json"
    try:
        entry = json.loads(path.read_text())
        if entry.get("key") == key:
            return entry["value"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # no entry, or a damaged one: recompute
    value = compute()
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                         delete=False) as f:
            temporary = f.name
            json.dump({"key": key, "value": value}, f)
        os.replace(temporary, path)
    except OSError as error:
        logger.debug("not caching %s: %s", path, error)
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
    return value
