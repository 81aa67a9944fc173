"""Packing whole documents into fixed-length blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


def pack_documents(documents: Iterable[tuple[Sequence, ...]], seq_len: int) -> Iterator[tuple[list, ...]]:
    """Greedily fill blocks of at most `seq_len` items with whole documents, in order.

    Each document is a tuple of parallel sequences (token ids, and optionally per-token values such as
    log-probabilities); each yielded block is the same tuple, concatenated and unpadded. A document longer
    than `seq_len` fills a block of its own, truncated. No document is split across blocks, so every token
    is predicted with its whole document prefix in context.
    """
    block: tuple[list, ...] | None = None
    for doc in documents:
        length = len(doc[0])
        if block is not None and len(block[0]) + length > seq_len:
            yield block
            block = None
        if block is None:
            block = tuple([] for _ in doc)
        for column, values in zip(block, doc, strict=True):
            column.extend(values[: seq_len - len(column)])
    if block is not None and block[0]:
        yield block
