"""Training data: token blocks for each data-parallel rank, and the tokenizer that made them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from .embedded import CorpusStatistics, corpus_statistics, document_stream
from .packing import pack_documents
from .tokenizer import embedded_tokenizer

EMBEDDED = "embedded"


@dataclass
class TrainingData:
    """Packed blocks of `seq_len` tokens. Batches are dicts of `input_ids` and `labels` (pads as -100)."""

    tokenizer: PreTrainedTokenizerBase
    seq_len: int
    seed: int
    statistics: CorpusStatistics | None

    def _blocks(self, seed: str) -> Iterator[list[int]]:
        vocab = self.tokenizer.get_vocab()
        docs = (([vocab[t] for t in doc.tokens],) for doc in document_stream(seed))
        for (ids,) in pack_documents(docs, self.seq_len):
            yield ids

    def _batches(self, blocks: Iterator[list[int]], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        pad = self.tokenizer.pad_token_id
        while True:
            rows = [next(blocks) for _ in range(batch_size)]
            input_ids = torch.full((batch_size, self.seq_len), pad, dtype=torch.long)
            labels = torch.full((batch_size, self.seq_len), -100, dtype=torch.long)
            for i, row in enumerate(rows):
                input_ids[i, : len(row)] = torch.tensor(row)
                labels[i, : len(row)] = input_ids[i, : len(row)]
            yield {"input_ids": input_ids, "labels": labels}

    def train_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[dict]:
        """An endless stream of micro-batches, distinct for each data-parallel rank and fixed by the seed."""
        return self._batches(self._blocks(f"train-{self.seed}-rank{rank}-of{world_size}"), batch_size)

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """The same held-out batches on every rank and every call."""
        stream = self._batches(self._blocks(_validation_seed(self.seed)), batch_size)
        return [next(stream) for _ in range(num_batches)]


def _validation_seed(seed: int) -> str:
    # Distinct from every training stream's seed, so validation never shares a document with training.
    return f"validation-{seed}"


def build_training_data(source: str, seq_len: int, seed: int) -> TrainingData:
    """`source` is `embedded` (the built-in corpus, the default)."""
    if source != EMBEDDED:
        if not os.path.exists(source):
            raise ValueError(f"data path {source!r} does not exist; valid choices: '{EMBEDDED}'")
        raise ValueError(f"data {source!r}: only the embedded corpus is supported so far; valid choices: '{EMBEDDED}'")
    stats = corpus_statistics(seq_len, _validation_seed(seed))
    return TrainingData(embedded_tokenizer(), seq_len, seed, stats)
