"""Streamed text, for corpora too big to prepare: each rank reads only its shard of the source, shuffled within
windows, with its position saved in every checkpoint so a resume seeks instead of replaying.

The rank's stream is `split_dataset_by_node` of the source's `datasets.IterableDataset` (whole files dealt to
ranks when the file count divides by the number of ranks, else every rank keeps one record in `world`). It is
cut into windows of `window_docs` records; a window's documents are shuffled by a seeded permutation of
(seed, rank, window), tokenized in one batch, framed as their tokenizer frames a document (`text.Framing`: a BOS
where it adds one, an EOS after each), joined and packed into `seq_len` blocks (the last one padded). Windows are
made by DataLoader workers in turn (worker w makes windows w, w + workers, ...; each reads the stream, only its own
windows are tokenized) and the DataLoader returns them in window order, so the blocks do not depend on the number
of workers.

Why windows rather than `IterableDataset.shuffle`'s buffer: `datasets` does not save the buffer's content in
its `state_dict` (it is refilled on resume, so the order after a resume differs from an uninterrupted run's).
A window restarts from the stream's `state_dict` at its first record: resuming costs at most re-reading and
re-tokenizing one window, whatever the run's length, and the blocks are exactly the uninterrupted run's.

A rank's stream that holds no record, or a whole epoch of it that gives no training block (every record skipped
or held out for validation), ends the run with one line: starting another epoch would read the same nothing forever.
So does a source without a held-out document, whose validation loss would be NaN.

A streamed run's steps depend on the number of ranks (each reads its own shard); it resumes on the same
number only. Prepared data (`adaptive_ds.data.prepare`) has neither limit.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from datasets.distributed import split_dataset_by_node
from torch.utils.data import IterableDataset, get_worker_info

from ..ds_config import ConfigError
from .loader import TrainingData, _tensors
from .text import Framing, checked_text, document_rows, is_validation

logger = logging.getLogger(__name__)

WINDOW_DOCS = 1024


class _Windows(IterableDataset):
    """Items: {"epoch", "window", "stream_state" (at the window's first record), "records", "blocks", "skipped"}.
    Ends (in every worker alike: each reads the whole rank stream) when an epoch of the stream holds no record."""

    def __init__(self, data: StreamingData, rank: int, world_size: int, start: dict):
        self.data, self.rank, self.world_size, self.start = data, rank, world_size, start

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, window, stream_state = self.start["epoch"], self.start["window"], self.start["stream_state"]
        while True:  # epochs
            stream = split_dataset_by_node(self.data.rows(), self.rank, self.world_size)
            resumed, epoch_start = stream_state is not None, window
            if resumed:
                stream.load_state_dict(stream_state)
            # `iter(batch_size)`, not `iter(stream)`: the latter would deal the stream's shards to the DataLoader
            # workers, and every worker here reads the whole rank stream (making only its own windows)
            for columns in stream.iter(batch_size=self.data.window_docs):
                chunk = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
                if (window - self.start["window"]) % workers == worker:
                    yield {"epoch": epoch, "window": window, "stream_state": stream_state, "records": len(chunk),
                           **self.data.pack(chunk, self.rank, window)}
                window += 1
                stream_state = stream.state_dict()  # the next window's first record
            if window == epoch_start and not resumed:  # the loader ends, and the training process says why
                return
            epoch, stream_state = epoch + 1, None


class StreamingData(TrainingData):
    """Text streamed from local files or the Hub (see the module docstring)."""

    def __init__(self, source: str, tokenizer, seq_len: int, seed: int, text_field: str, hub_config: str | None,
                 validation_share: float, epoch_blocks: int | None = None, workers: int = 1,
                 window_docs: int = WINDOW_DOCS):
        super().__init__(tokenizer, seq_len, seed, workers=workers)
        if epoch_blocks is not None:
            raise ValueError("--epochs with a token budget repeats a subset, which needs random access: prepare the "
                             "corpus (python -m adaptive_ds.data.prepare) and pass --data DIR")
        self.source, self.text_field, self.hub_config = source, text_field, hub_config
        self.framing = Framing.of(tokenizer)
        self.validation_share, self.window_docs = validation_share, window_docs
        # Built here, once: a `datasets` builder takes a file lock, which a forked DataLoader worker may find held
        self._rows = document_rows(source, text_field, hub_config)
        self._start: dict | None = None  # a loaded position
        self._position: dict | None = None  # after the last block yielded

    def rows(self):
        return self._rows

    def _texts(self, rows: list[dict], skipped: Counter, split: str) -> list[str]:
        texts = [checked_text(row, self.text_field, skipped) for row in rows]
        held_out = split == "validation"
        return [t for t in texts if t is not None and is_validation(t, self.seed, self.validation_share) == held_out]

    def _blocks(self, texts: list[str]) -> list[np.ndarray]:
        stream = np.array([t for doc in self.framing.documents(self.tokenizer, texts) for t in doc], dtype=np.int32)
        return [stream[i:i + self.seq_len] for i in range(0, len(stream), self.seq_len)]

    def pack(self, rows: list[dict], rank: int, window: int) -> dict:
        """One window of the rank's stream as training blocks, its documents in a seeded order."""
        skipped = Counter()
        texts = self._texts(rows, skipped, "train")
        order = np.random.default_rng([self.seed, rank, window]).permutation(len(texts))
        return {"blocks": self._blocks([texts[i] for i in order]), "skipped": dict(skipped)}

    def validation_blocks(self) -> Iterator[np.ndarray]:
        """The held-out documents' blocks, in one pass over the source; a source without one is refused (its
        validation loss would be NaN)."""
        records, skipped, blocks = 0, Counter(), 0
        for rows in _chunks(iter(self.rows()), self.window_docs):
            records += len(rows)
            for block in self._blocks(self._texts(rows, skipped, "validation")):
                blocks += 1
                yield block
        if not blocks:
            raise ConfigError(f"data {self.source!r} holds no document held out for validation (--validation_share "
                              f"{self.validation_share} of {records - sum(skipped.values())} usable records); pass a "
                              "larger --validation_share or more documents")

    def state_dict(self) -> dict | None:
        return self._position

    def load_state_dict(self, state: dict | None) -> None:
        self._start = state

    def step_batches(self, first_step: int, rows_per_step: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        if rows_per_step % world_size:
            raise ValueError(f"{rows_per_step} rows per step do not split over {world_size} ranks")
        start = self._start or {"epoch": 0, "window": 0, "stream_state": None, "offset": 0,
                                "world_size": world_size}
        if start["world_size"] != world_size:
            raise ValueError(f"a streamed run resumes only on its own number of processes ({start['world_size']}, "
                             f"not {world_size}); prepare the corpus (python -m adaptive_ds.data.prepare) to change it")
        if first_step and self._start is None:
            raise ValueError(f"resuming at step {first_step} of a streamed run needs the data position saved in the "
                             "checkpoint (data_rank*.json), and there is none")
        per_rank = rows_per_step // world_size
        rows: list[np.ndarray] = []
        skip = start["offset"]
        epoch = _Epoch(self.source, rank, world_size, start)
        # items stay numpy (pickled through the worker queue): a window's many blocks as tensors would each need
        # a shared-memory file descriptor
        for item in self.loader(_Windows(self, rank, world_size, start), None, _as_is):
            epoch.read(item)
            self.skipped.update(item["skipped"])
            for offset, block in enumerate(item["blocks"][skip:], skip):
                rows.append(block)
                if len(rows) == per_rank:
                    self._position = {"epoch": item["epoch"], "window": item["window"],
                                      "stream_state": item["stream_state"], "offset": offset + 1,
                                      "world_size": world_size}
                    yield _tensors({k: v.numpy() for k, v in self._batch(rows).items()})
                    rows = []
            skip = 0
        raise ConfigError(f"data {self.source!r} has no records for rank {rank} of {world_size}; pass a source with "
                          "at least as many records as processes")


class _Epoch:
    """Watches the windows of a rank's stream, in order, and refuses an epoch that gave no training block (the
    next would give none either). Raised in the training process, as a ConfigError: the run's one line."""

    def __init__(self, source: str, rank: int, world_size: int, start: dict):
        self.source, self.rank, self.world_size = source, rank, world_size
        self.number, self.records, self.blocks = start["epoch"], 0, 0
        # a resumed epoch is read from a window on, and its rest may well hold no block
        self.partial = start["stream_state"] is not None

    def read(self, item: dict) -> None:
        if item["epoch"] != self.number:
            if not self.blocks and not self.partial:
                raise ConfigError(f"data {self.source!r} gave rank {self.rank} of {self.world_size} no training block "
                                  f"in a whole epoch of {self.records} records: each was skipped or held out for "
                                  "validation; pass more documents or a smaller --validation_share")
            self.number, self.records, self.blocks, self.partial = item["epoch"], 0, 0, False
        self.records += item["records"]
        self.blocks += len(item["blocks"])


def _as_is(item: dict) -> dict:
    return item


def _chunks(rows: Iterator[dict], size: int) -> Iterator[list[dict]]:
    while chunk := list(itertools.islice(rows, size)):
        yield chunk
