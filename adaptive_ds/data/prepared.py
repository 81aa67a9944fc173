"""Prepared token shards (`adaptive_ds.data.prepare`) read by block index, and weighted mixtures of them.

Block b of a prepared directory is tokens [b * seq_len, (b + 1) * seq_len) of its training stream (shards are
numpy memmaps; a block may span two). Global sample g of a run is, as in Megatron's GPTDataset, a block chosen
by a seeded permutation of the blocks of epoch g // blocks, so any sample is found in constant time: exact
epochs, a seeded global shuffle, and a resume that is a seek.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from functools import lru_cache

import numpy as np
from transformers import AutoTokenizer

from .text import Framing

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREPARING = "PREPARING"  # present while a prepare is writing; a directory with it and no manifest is partial
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "validation")
FORMAT_VERSION = 1


def tokenizer_hash(directory: str) -> str:
    """sha256 of the saved tokenizer's tokenizer.json (vocabulary, merges, special tokens: what makes the ids),
    or of all its files for a tokenizer without one. The same tokenizer saved twice hashes the same."""
    h = hashlib.sha256()
    root = os.path.join(directory, TOKENIZER_DIR)
    if not os.path.isdir(root):
        raise ValueError(f"prepared data {directory!r} has no {TOKENIZER_DIR}/ directory; prepare it again")
    names = ["tokenizer.json"] if os.path.isfile(os.path.join(root, "tokenizer.json")) else sorted(os.listdir(root))
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


MANIFEST_KEYS = ("arguments", "tokenizer_sha256", "dtype", *SPLITS)


def read_manifest(directory: str) -> dict:
    """The manifest of a complete prepared directory (ValueError, naming what is wrong, for a damaged one)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"prepared data {directory!r}: its {MANIFEST} is not valid JSON ({e}); prepare it "
                         "again") from None
    missing = [key for key in MANIFEST_KEYS if key not in manifest] if isinstance(manifest, dict) else ["fields"]
    if missing:
        raise ValueError(f"prepared data {directory!r}: its {MANIFEST} has no {missing[0]!r}; prepare it again")
    return manifest


def is_prepared(path: str) -> bool:
    """A directory written by `adaptive_ds.data.prepare` (complete or partial)."""
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, PREPARING))


class PreparedCorpus:
    """A complete prepared directory: its manifest checked against the files and the tokenizer beside it."""

    def __init__(self, directory: str):
        self.directory = directory
        if not os.path.isfile(os.path.join(directory, MANIFEST)):
            raise ValueError(f"{directory!r} is a partial prepare (no {MANIFEST}: it was stopped before the end); "
                             "run `python -m adaptive_ds.data.prepare` with the same arguments again")
        self.manifest = read_manifest(directory)
        found = tokenizer_hash(directory)
        if found != self.manifest["tokenizer_sha256"]:
            raise ValueError(f"prepared data {directory!r}: its tokenizer/ (sha256 {found[:12]}) is not the one its "
                             f"tokens were made with ({self.manifest['tokenizer_sha256'][:12]}); prepare it again")
        self.dtype = np.dtype(self.manifest["dtype"])
        for split in SPLITS:
            for shard in self.manifest[split]["shards"]:
                path = os.path.join(directory, shard["file"])
                size = os.path.getsize(path) if os.path.isfile(path) else -1
                if size != shard["tokens"] * self.dtype.itemsize:
                    raise ValueError(f"prepared data {directory!r}: {shard['file']} holds {size} bytes, its manifest "
                                     f"says {shard['tokens']} tokens of {self.dtype.name}; prepare it again")
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(directory, TOKENIZER_DIR))
        if "bos_token_id" not in self.manifest and Framing.of(self.tokenizer).bos is not None:
            logger.warning("prepared data %s was made before documents began with their tokenizer's BOS, and its "
                           "tokenizer has one: its documents lack it; prepare it again into a new --out to add it",
                           directory)
        self._maps: dict[str, list[np.memmap]] = {}
        self._starts = {split: np.cumsum([0] + [s["tokens"] for s in self.manifest[split]["shards"]])
                        for split in SPLITS}

    def tokens(self, split: str) -> int:
        return self.manifest[split]["tokens"]

    def num_blocks(self, split: str, seq_len: int) -> int:
        return self.tokens(split) // seq_len

    def _shards(self, split: str) -> list[np.memmap]:
        # opened on first use in each process (a DataLoader worker opens its own)
        if split not in self._maps:
            self._maps[split] = [np.memmap(os.path.join(self.directory, s["file"]), dtype=self.dtype, mode="r")
                                 for s in self.manifest[split]["shards"]]
        return self._maps[split]

    def block(self, split: str, index: int, seq_len: int) -> np.ndarray:
        """Tokens [index * seq_len, (index + 1) * seq_len) of `split`, as int64."""
        start, stop = index * seq_len, (index + 1) * seq_len
        starts, shards = self._starts[split], self._shards(split)
        first = int(np.searchsorted(starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            offset = start - starts[first]
            piece = shards[first][offset:offset + stop - start]
            pieces.append(piece)
            start += len(piece)
            first += 1
        return np.concatenate(pieces).astype(np.int64)


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, blocks: int) -> np.ndarray:
    """The order of the blocks in `epoch`: a seeded permutation (Megatron's shuffle index), made once per epoch
    (O(blocks), a few hundred milliseconds for 10M blocks) and cached."""
    return np.random.default_rng([seed, epoch]).permutation(blocks)


def shuffled_block(seed: int, sample: int, blocks: int) -> int:
    """The block that global sample `sample` reads: every block once per epoch, in a new order each epoch."""
    epoch, position = divmod(sample, blocks)
    return int(epoch_permutation(seed, epoch, blocks)[position])


class Mixture:
    """Sources blended by weight with a fixed, seeded pattern: weights are rounded to shares of a period of
    `period` samples, each period holds exactly those counts, interleaved by the largest-remainder rule (the
    sample goes to the source furthest behind its share), so source and ordinal of any sample are found in
    constant time and a mixture resumes by seeking as a single source does."""

    def __init__(self, weights: list[float], period: int = 1000):
        total = sum(weights)
        counts = [math.floor(w / total * period) for w in weights]
        behind = sorted(range(len(weights)), key=lambda i: counts[i] - weights[i] / total * period)
        for i in behind[:period - sum(counts)]:
            counts[i] += 1
        self.period, self.counts = period, counts
        pattern, ordinal, taken = [], [], [0] * len(weights)
        for position in range(period):
            source = max(range(len(weights)), key=lambda i: counts[i] * (position + 1) / period - taken[i])
            pattern.append(source)
            ordinal.append(taken[source])
            taken[source] += 1
        self.pattern, self.ordinal = pattern, ordinal

    def locate(self, sample: int) -> tuple[int, int]:
        """(source, that source's own sample index) of global sample `sample`."""
        cycle, position = divmod(sample, self.period)
        source = self.pattern[position]
        return source, cycle * self.counts[source] + self.ordinal[position]

    def samples_per_source(self, samples: int) -> list[int]:
        """How many of the first `samples` samples each source gave (constant time)."""
        cycle, rest = divmod(samples, self.period)
        partial = [0] * len(self.counts)
        for source in self.pattern[:rest]:
            partial[source] += 1
        return [cycle * c + p for c, p in zip(self.counts, partial, strict=True)]
