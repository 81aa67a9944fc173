"""Training data: token blocks for each data-parallel rank, and the tokenizer that made them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from .embedded import CorpusStatistics, corpus_statistics, document_stream
from .packing import pack_documents
from .text import (
    BUILDERS,
    documents_for,
    limited,
    load_tokenizer,
    local_files,
    looks_like_path,
    open_documents,
    token_blocks,
)
from .tokenizer import embedded_tokenizer

EMBEDDED = "embedded"


class TrainingData:
    """Packed blocks of `seq_len` tokens for each rank. Batches are dicts of `input_ids` and `labels`
    (padding as -100). `statistics` is the corpus's entropy floor where it is known (the embedded corpus)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                 statistics: CorpusStatistics | None = None):
        self.tokenizer, self.seq_len, self.seed, self.statistics = tokenizer, seq_len, seed, statistics

    def train_blocks(self, rank: int, world_size: int) -> Iterator[list[int]]:
        raise NotImplementedError

    def validation_blocks(self) -> Iterator[list[int]]:
        raise NotImplementedError

    def _batches(self, blocks: Iterator[list[int]], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        pad = self.tokenizer.pad_token_id
        while True:
            rows = list(itertools.islice(blocks, batch_size))
            if not rows:
                return
            input_ids = torch.full((len(rows), self.seq_len), pad, dtype=torch.long)
            labels = torch.full((len(rows), self.seq_len), -100, dtype=torch.long)
            for i, row in enumerate(rows):
                input_ids[i, : len(row)] = torch.tensor(row)
                labels[i, : len(row)] = input_ids[i, : len(row)]
            yield {"input_ids": input_ids, "labels": labels}

    def train_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[dict]:
        """An endless stream of micro-batches, distinct for each data-parallel rank and fixed by the seed."""
        return self._batches(self.train_blocks(rank, world_size), batch_size)

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """The same held-out batches on every rank and every call (fewer if the held-out data is smaller)."""
        return list(itertools.islice(self._batches(self.validation_blocks(), batch_size), num_batches))


class EmbeddedData(TrainingData):
    """The built-in grammar corpus: whole documents packed per block, so the entropy floor is exact."""

    def _blocks(self, seed: str) -> Iterator[list[int]]:
        vocab = self.tokenizer.get_vocab()
        docs = (([vocab[t] for t in doc.tokens],) for doc in document_stream(seed))
        for (ids,) in pack_documents(docs, self.seq_len):
            yield ids

    def train_blocks(self, rank: int, world_size: int) -> Iterator[list[int]]:
        return self._blocks(f"train-{self.seed}-rank{rank}-of{world_size}")

    def validation_blocks(self) -> Iterator[list[int]]:
        return self._blocks(_validation_seed(self.seed))


class TextData(TrainingData):
    """A text corpus (`adaptive_ds.data.text`): EOS-joined documents, validation held out by document,
    round-robin rank shards, epochs repeated over the first `epoch_blocks` blocks of each rank's share."""

    def __init__(self, source: str, tokenizer, seq_len: int, seed: int, text_field: str, hub_config: str | None,
                 validation_share: float, epoch_blocks: int | None):
        super().__init__(tokenizer, seq_len, seed)
        self.source, self.text_field, self.hub_config = source, text_field, hub_config
        self.validation_share, self.epoch_blocks = validation_share, epoch_blocks

    def _split_blocks(self, split: str, rank: int = 0, world_size: int = 1) -> Iterator[list[int]]:
        docs = documents_for(open_documents(self.source, self.text_field, self.hub_config), split, self.seed,
                             self.validation_share, rank, world_size)
        return token_blocks(docs, self.tokenizer, self.seq_len)

    def train_blocks(self, rank: int, world_size: int) -> Iterator[list[int]]:
        while True:  # epochs
            yield from limited(self._split_blocks("train", rank, world_size), self.epoch_blocks)

    def validation_blocks(self) -> Iterator[list[int]]:
        return self._split_blocks("validation")


def _validation_seed(seed: int) -> str:
    # Distinct from every training stream's seed, so validation never shares a document with training.
    return f"validation-{seed}"


def build_training_data(source: str, seq_len: int, seed: int, tokenizer: str = "bpe:8192",
                        text_field: str = "text", hub_config: str | None = None, validation_share: float = 0.01,
                        epoch_blocks: int | None = None, tokenizer_sample_docs: int = 2000) -> TrainingData:
    """`source` is `embedded` (the built-in corpus, the default), local files or a Hub dataset name.

    For text sources `tokenizer` is `bpe:N` (trained on the first `tokenizer_sample_docs` documents) or a
    pretrained tokenizer's name or path.
    """
    if source == EMBEDDED:
        return EmbeddedData(embedded_tokenizer(), seq_len, seed, corpus_statistics(seq_len, _validation_seed(seed)))
    if looks_like_path(source) and not local_files(source):
        raise ValueError(f"data path {source!r} does not exist; valid choices: '{EMBEDDED}', local files "
                         f"({', '.join(BUILDERS)}) or a Hub dataset name")
    sample = itertools.islice(open_documents(source, text_field, hub_config), tokenizer_sample_docs)
    tok = load_tokenizer(tokenizer, sample)
    return TextData(source, tok, seq_len, seed, text_field, hub_config, validation_share, epoch_blocks)
