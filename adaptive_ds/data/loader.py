"""The interface every training data source gives the loop (`TrainingData`), and the DataLoader that makes its steps
in worker processes ahead of the loop."""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .embedded import CorpusStatistics

PREFETCH_STEPS = 4  # per worker: steps made ahead of the training loop


class TrainingData:
    """Blocks of `seq_len` tokens and the tokenizer that made them. Batches are dicts of `input_ids` and
    `labels` (padding as -100). `statistics` is the corpus's entropy floor where it is known (the embedded
    corpus). `workers`: DataLoader worker processes (0: in the training process)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                 statistics: CorpusStatistics | None = None, workers: int = 1):
        self.tokenizer, self.seq_len, self.seed, self.statistics = tokenizer, seq_len, seed, statistics
        self.workers = workers
        self.skipped: Counter = Counter()  # bad records skipped, by reason

    def step_batches(self, first_step: int, rows_per_step: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's rows of every optimizer step from `first_step` (0-based) on: `rows_per_step` is the
        global batch in rows, and each rank gets `rows_per_step / world_size` of them."""
        raise NotImplementedError

    def validation_blocks(self) -> Iterator[Sequence[int]]:
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        """This rank's data position beyond the step count (streaming only), saved per rank in checkpoints."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def summary(self) -> dict:
        """Facts for summary.json."""
        return {"data_skipped": dict(self.skipped)}

    def _batch(self, rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """Rows padded on the right to `seq_len` with the tokenizer's pad token, or its EOS where it has none (Llama
        3). Padding is labelled -100, so it is in no loss, and it follows every real token of its row, so causal
        attention shows it to none."""
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        input_ids = torch.full((len(rows), self.seq_len), pad, dtype=torch.long)
        labels = torch.full((len(rows), self.seq_len), -100, dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.as_tensor(np.asarray(row, dtype=np.int64))
            labels[i, : len(row)] = input_ids[i, : len(row)]
        return {"input_ids": input_ids, "labels": labels}

    def _batches(self, blocks: Iterator[Sequence[int]], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        while rows := list(itertools.islice(blocks, batch_size)):
            yield self._batch(rows)

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """The same held-out batches on every rank and every call (fewer if the held-out data is smaller)."""
        return list(itertools.islice(self._batches(self.validation_blocks(), batch_size), num_batches))

    def loader(self, dataset, sampler, collate_fn) -> DataLoader:
        """A DataLoader of whole per-rank steps (batch_size None), made by worker processes ahead of the loop."""
        workers = self.workers
        if workers:  # forked workers tokenize in one thread each (and tokenizers warns otherwise)
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        return DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers,
                          prefetch_factor=PREFETCH_STEPS if workers else None,
                          multiprocessing_context="fork" if workers else None, collate_fn=collate_fn,
                          worker_init_fn=functools.partial(_die_with_parent, os.getpid()) if workers else None)


def _die_with_parent(parent: int, worker_id: int) -> None:
    """A worker ends when the training process does, even on SIGKILL (Linux: PR_SET_PDEATHSIG). Without it an
    orphaned worker lives on and holds the launcher's pipes open, so whoever waits for the run's output hangs.

    It ignores SIGTERM and SIGINT, which a scheduler or a terminal sends to the whole process group: the training
    process decides what they mean (a checkpoint, then a stop: adaptive_ds/training/stop.py), and a worker killed by
    them would end the run before it could save."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nothing would signal us
            os._exit(0)


def _as_is(item):
    return item


def _tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Steps cross from the workers as numpy arrays, pickled through the queue (a few hundred kB): faster than
    tensors, which each need a shared-memory file descriptor. Pinned here on CUDA, for non-blocking copies."""
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    return {k: v.pin_memory() for k, v in tensors.items()} if torch.cuda.is_available() else tensors
