"""Training data: token blocks for each data-parallel rank, and the tokenizer that made them.

Three sources, one interface (`TrainingData.step_batches`): the embedded corpus and prepared token shards
(`adaptive_ds.data.prepare`) are indexed (the global batch of step s is global samples [s * rows, (s + 1) * rows)
and each rank takes its slice, so the tokens of a step do not depend on the number of ranks and a resume is a
seek); text streamed from files or the Hub (`adaptive_ds.data.streaming`) for corpora too big to prepare. Batches
come from a `torch.utils.data.DataLoader` with worker processes, prefetch and pinned memory on CUDA.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .embedded import TIERS, CorpusStatistics, block, corpus_statistics
from .loader import TrainingData, _as_is, _tensors
from .prepared import Mixture, PreparedCorpus, is_prepared, read_manifest, shuffled_block
from .text import BUILDERS, file_format, load_tokenizer, local_files, looks_like_path, open_documents
from .tokenizer import embedded_tokenizer

EMBEDDED = "embedded"
# --data value -> embedded corpus tier: `embedded` is the base tier, `embedded:TIER` another
EMBEDDED_SOURCES = {EMBEDDED if tier == "base" else f"{EMBEDDED}:{tier}": tier for tier in TIERS}


class _Steps(Dataset):
    """Item s: this rank's rows of step s, from global samples [s * rows, (s + 1) * rows)."""

    def __init__(self, data: IndexedData, rows_per_step: int, rank: int, world_size: int):
        if rows_per_step % world_size:
            raise ValueError(f"{rows_per_step} rows per step do not split over {world_size} ranks")
        self.data, self.rows_per_step, self.per_rank, self.rank = data, rows_per_step, rows_per_step // world_size, rank

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        start = step * self.rows_per_step + self.rank * self.per_rank
        batch = self.data._batch([self.data.sample(g) for g in range(start, start + self.per_rank)])
        return {k: v.numpy() for k, v in batch.items()}


class IndexedData(TrainingData):
    """Data whose global sample g is a function of g alone (`sample`): steps are read by index."""

    def sample(self, index: int) -> Sequence[int]:
        raise NotImplementedError

    def step_batches(self, first_step: int, rows_per_step: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        steps = _Steps(self, rows_per_step, rank, world_size)
        for step, batch in enumerate(self.loader(steps, itertools.count(first_step), _as_is), first_step):
            self.samples_read = (step + 1) * rows_per_step
            yield _tensors(batch)


class EmbeddedData(IndexedData):
    """The built-in grammar corpus, one of its tiers. Block i of a stream is a function of (seed, i) alone
    (`embedded.block`), so the global batch of step s is blocks [s * rows, (s + 1) * rows) and each rank takes its
    contiguous slice: one process, two processes or any micro-batch split train on the same tokens, and a resume
    is a seek."""

    def __init__(self, tier: str, seq_len: int, seed: int, statistics: CorpusStatistics, workers: int = 1):
        super().__init__(embedded_tokenizer(tier), seq_len, seed, statistics, workers)
        self.tier = tier

    def _ids(self, namespace: str, index: int) -> list[int]:
        vocab = self.tokenizer.get_vocab()
        return [vocab[t] for t in block(namespace, index, self.seq_len, self.tier).tokens]

    def sample(self, index: int) -> list[int]:
        return self._ids(train_namespace(self.seed), index)

    def validation_blocks(self) -> Iterator[list[int]]:
        namespace = validation_namespace(self.seed)
        return (self._ids(namespace, i) for i in itertools.count())


class PreparedData(IndexedData):
    """Prepared token shards (`adaptive_ds.data.prepare`), one or a weighted mixture (`0.7:DIR_A,0.3:DIR_B`).
    Each source is shuffled by block with its own seeded permutation per epoch; the mixture interleaves them
    by a fixed pattern (`prepared.Mixture`). `epoch_blocks` limits each epoch to the first blocks (by weight)."""

    def __init__(self, sources: list[tuple[float, str]], seq_len: int, seed: int, workers: int = 1,
                 epoch_blocks: int | None = None):
        self.corpora = [PreparedCorpus(path) for _, path in sources]
        self.names = [path for _, path in sources]
        hashes = {c.manifest["tokenizer_sha256"] for c in self.corpora}
        if len(hashes) > 1:
            raise ValueError(f"the mixed prepared directories {', '.join(self.names)} were made with different "
                             "tokenizers; prepare them with one --tokenizer")
        super().__init__(self.corpora[0].tokenizer, seq_len, seed, workers=workers)
        self.mixture = Mixture([w for w, _ in sources])
        weights = [w / sum(w for w, _ in sources) for w, _ in sources]
        self.blocks = []
        for corpus, path, weight in zip(self.corpora, self.names, weights, strict=True):
            recorded = corpus.manifest["arguments"].get("seq_len")
            if recorded not in (None, seq_len):
                raise ValueError(f"prepared data {path!r} was prepared for seq_len {recorded}, this run's preset has "
                                 f"{seq_len}; prepare it again with --seq_len {seq_len}")
            blocks = corpus.num_blocks("train", seq_len)
            if epoch_blocks is not None:
                blocks = min(blocks, max(1, round(epoch_blocks * weight)))
            if blocks == 0 or corpus.num_blocks("validation", seq_len) == 0:
                raise ValueError(f"prepared data {path!r} has fewer than {seq_len} training or validation tokens")
            self.blocks.append(blocks)
        self.samples_read = 0
        self.skipped = Counter()
        for corpus in self.corpora:
            self.skipped.update(corpus.manifest.get("skipped", {}))

    def sample(self, index: int) -> np.ndarray:
        source, own = self.mixture.locate(index)
        # each source its own seed stream, so adding a source does not reorder another's blocks
        return self.corpora[source].block("train", shuffled_block(self.seed + source, own, self.blocks[source]),
                                          self.seq_len)

    def validation_blocks(self) -> Iterator[np.ndarray]:
        for index in itertools.count():
            source, own = self.mixture.locate(index)
            corpus = self.corpora[source]
            yield corpus.block("validation", own % corpus.num_blocks("validation", self.seq_len), self.seq_len)

    def summary(self) -> dict:
        """Besides the skipped records (counted when prepared): the share of the samples read from each source."""
        counts = self.mixture.samples_per_source(self.samples_read)
        total = max(sum(counts), 1)
        shares = {name: c / total for name, c in zip(self.names, counts, strict=True)}
        return {**super().summary(), "data_shares": shares}


def train_namespace(seed: int) -> str:
    return f"train-{seed}"


def validation_namespace(seed: int) -> str:
    # Distinct from the training stream's, so validation never shares a block with training.
    return f"validation-{seed}"


def parse_mixture(source: str) -> list[tuple[float, str]] | None:
    """`0.7:A,0.3:B` as [(0.7, A), (0.3, B)]; None for a single source."""
    parts = source.split(",")
    if len(parts) < 2 and ":" not in source.split("/")[0]:
        return None
    mixture = []
    for part in parts:
        weight, sep, path = part.partition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not sep or not math.isfinite(value) or value <= 0 or not path:
            raise ValueError(f"data mixture part {part!r} is not WEIGHT:SOURCE with a positive weight; e.g. "
                             "0.7:DIR_A,0.3:DIR_B")
        mixture.append((value, path))
    return mixture


def source_problems(source: str) -> list[str]:
    """What is wrong with a --data value (empty if nothing), for the settings check."""
    if source in EMBEDDED_SOURCES:
        return []
    if source.startswith(f"{EMBEDDED}:"):
        return [f"unknown embedded corpus tier {source!r}; valid choices: {', '.join(map(repr, EMBEDDED_SOURCES))}"]
    try:
        mixture = parse_mixture(source)
    except ValueError as e:
        return [str(e)]
    if mixture:
        bad = [path for _, path in mixture if not is_prepared(path)]
        return [f"data mixture parts {', '.join(map(repr, bad))} are not prepared directories; mixtures blend "
                "prepared data: run `python -m adaptive_ds.data.prepare` on each source"] if bad else []
    if is_prepared(source) or not looks_like_path(source):
        return []
    files = local_files(source)
    if files:
        try:
            file_format(files, source)
        except ValueError as e:
            return [str(e)]
        return []
    endings = ", ".join(BUILDERS)
    if os.path.isdir(source):
        return [f"data directory {source!r} holds no data files; valid endings: {endings}"]
    if any(c in source for c in "*?["):
        return [f"data glob {source!r} matches no file; pass a pattern that matches files ending {endings}"]
    return [f"data path {source!r} does not exist; valid choices: {', '.join(map(repr, EMBEDDED_SOURCES))}, a "
            f"prepared directory, local files ({endings}) or a Hub dataset name"]


def tokenizer_identity(source: str, tokenizer: str) -> str:
    """What names the tokenizer of a run on `source` (a checkpoint must match it): the embedded corpus's, the
    prepared data's own (`sha256:` of its tokenizer, whatever `tokenizer` says: a directory prepared again with
    another tokenizer of the same size must not resume a run), or `tokenizer`, which streamed text is tokenized
    with."""
    if source in EMBEDDED_SOURCES:
        return EMBEDDED
    mixture = parse_mixture(source)
    directory = mixture[0][1] if mixture else source
    if is_prepared(directory):  # a mixture's parts share one tokenizer (PreparedData refuses others)
        return f"sha256:{read_manifest(directory)['tokenizer_sha256']}"
    return tokenizer


def build_training_data(source: str, seq_len: int, seed: int, tokenizer: str = "bpe:8192",
                        text_field: str = "text", hub_config: str | None = None, validation_share: float = 0.01,
                        epoch_blocks: int | None = None, tokenizer_sample_docs: int = 2000,
                        workers: int = 1) -> TrainingData:
    """`source` is `embedded` (the built-in corpus, the default; `embedded:hard` its hard tier), a prepared
    directory, a mixture of prepared directories (`0.7:DIR_A,0.3:DIR_B`), or local files or a Hub dataset name to
    stream. `epoch_blocks`: the global blocks of one epoch (a subset, for --epochs).

    For streamed text `tokenizer` is `bpe:N` (trained on the first `tokenizer_sample_docs` documents) or a
    pretrained tokenizer's name or path; prepared data brings its own.
    """
    problems = source_problems(source)
    if problems:
        raise ValueError(problems[0])
    if source in EMBEDDED_SOURCES:
        tier = EMBEDDED_SOURCES[source]
        statistics = corpus_statistics(seq_len, validation_namespace(seed), tier=tier)
        return EmbeddedData(tier, seq_len, seed, statistics, workers)
    mixture = parse_mixture(source)
    if mixture or is_prepared(source):
        return PreparedData(mixture or [(1.0, source)], seq_len, seed, workers, epoch_blocks)
    # streamed text only: `datasets` (and pandas) is half a second of every process's start
    from .streaming import StreamingData

    # A source without a usable document is refused here, before the tokenizer is trained or a worker started
    sample = itertools.islice(open_documents(source, text_field, hub_config), tokenizer_sample_docs)
    tok = load_tokenizer(tokenizer, sample)
    return StreamingData(source, tok, seq_len, seed, text_field, hub_config, validation_share, epoch_blocks, workers)
