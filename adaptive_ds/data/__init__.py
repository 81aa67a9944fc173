"""Training data: token blocks for each data-parallel rank, and the tokenizer that made them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from .embedded import CorpusStatistics, block, corpus_statistics
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
    """Blocks of `seq_len` tokens and the tokenizer that made them. Batches are dicts of `input_ids` and
    `labels` (padding as -100). `statistics` is the corpus's entropy floor where it is known (the embedded
    corpus)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                 statistics: CorpusStatistics | None = None):
        self.tokenizer, self.seq_len, self.seed, self.statistics = tokenizer, seq_len, seed, statistics

    def step_batches(self, first_step: int, rows_per_step: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's rows of every optimizer step from `first_step` (0-based) on: `rows_per_step` is the
        global batch in rows, and each rank gets `rows_per_step / world_size` of them."""
        raise NotImplementedError

    def validation_blocks(self) -> Iterator[list[int]]:
        raise NotImplementedError

    def _batch(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), self.seq_len), pad, dtype=torch.long)
        labels = torch.full((len(rows), self.seq_len), -100, dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)
            labels[i, : len(row)] = input_ids[i, : len(row)]
        return {"input_ids": input_ids, "labels": labels}

    def _batches(self, blocks: Iterator[list[int]], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        while rows := list(itertools.islice(blocks, batch_size)):
            yield self._batch(rows)

    def validation_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """The same held-out batches on every rank and every call (fewer if the held-out data is smaller)."""
        return list(itertools.islice(self._batches(self.validation_blocks(), batch_size), num_batches))


class EmbeddedData(TrainingData):
    """The built-in grammar corpus. Block i of a stream is a function of (seed, i) alone (`embedded.block`), so
    the global batch of step s is blocks [s * rows, (s + 1) * rows) and each rank takes its contiguous slice:
    one process, two processes or any micro-batch split train on the same tokens, and a resume is a seek."""

    def _ids(self, namespace: str, index: int) -> list[int]:
        vocab = self.tokenizer.get_vocab()
        return [vocab[t] for t in block(namespace, index, self.seq_len).tokens]

    def step_batches(self, first_step: int, rows_per_step: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        if rows_per_step % world_size:
            raise ValueError(f"{rows_per_step} rows per step do not split over {world_size} ranks")
        per_rank = rows_per_step // world_size
        namespace = _train_namespace(self.seed)
        for step in itertools.count(first_step):
            start = step * rows_per_step + rank * per_rank
            yield self._batch([self._ids(namespace, i) for i in range(start, start + per_rank)])

    def validation_blocks(self) -> Iterator[list[int]]:
        namespace = _validation_namespace(self.seed)
        return (self._ids(namespace, i) for i in itertools.count())


class TextData(TrainingData):
    """A text corpus (`adaptive_ds.data.text`): EOS-joined documents, validation held out by document,
    round-robin rank shards, epochs repeated over the first `epoch_blocks` blocks of each rank's share.

    Streamed: each rank reads its own share in the source's order, so a run on another number of ranks sees
    other batches, and a resume re-reads the steps before it."""

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

    def step_batches(self, first_step: int, rows_per_step: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        batches = self._batches(self.train_blocks(rank, world_size), rows_per_step // world_size)
        return itertools.islice(batches, first_step, None)

    def validation_blocks(self) -> Iterator[list[int]]:
        return self._split_blocks("validation")


def _train_namespace(seed: int) -> str:
    return f"train-{seed}"


def _validation_namespace(seed: int) -> str:
    # Distinct from the training stream's, so validation never shares a block with training.
    return f"validation-{seed}"


def build_training_data(source: str, seq_len: int, seed: int, tokenizer: str = "bpe:8192",
                        text_field: str = "text", hub_config: str | None = None, validation_share: float = 0.01,
                        epoch_blocks: int | None = None, tokenizer_sample_docs: int = 2000) -> TrainingData:
    """`source` is `embedded` (the built-in corpus, the default), local files or a Hub dataset name.

    For text sources `tokenizer` is `bpe:N` (trained on the first `tokenizer_sample_docs` documents) or a
    pretrained tokenizer's name or path.
    """
    if source == EMBEDDED:
        statistics = corpus_statistics(seq_len, _validation_namespace(seed))
        return EmbeddedData(embedded_tokenizer(), seq_len, seed, statistics)
    if looks_like_path(source) and not local_files(source):
        raise ValueError(f"data path {source!r} does not exist; valid choices: '{EMBEDDED}', local files "
                         f"({', '.join(BUILDERS)}) or a Hub dataset name")
    sample = itertools.islice(open_documents(source, text_field, hub_config), tokenizer_sample_docs)
    tok = load_tokenizer(tokenizer, sample)
    return TextData(source, tok, seq_len, seed, text_field, hub_config, validation_share, epoch_blocks)
