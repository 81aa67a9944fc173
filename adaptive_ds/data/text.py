"""Text corpora through Hugging Face `datasets`: Hub datasets (streamed) and local files, read lazily.

Documents are tokenized, joined with EOS and cut into `seq_len` blocks. Each document gets an index in the
source's order; a fixed share of indices (chosen by a seeded hash) is held out for validation, and the rest
are dealt round-robin to the data-parallel ranks, so within one epoch every training document is read by
exactly one rank, once. Nothing is shuffled: the order is the source's, and the same for every run.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
from collections.abc import Iterator

from datasets import load_dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

# datasets builders by file ending
BUILDERS = {".jsonl": "json", ".json": "json", ".json.gz": "json", ".jsonl.gz": "json", ".parquet": "parquet",
            ".txt": "text", ".txt.gz": "text"}
BPE_EOS = "<|endoftext|>"
BPE_PAD = "<|pad|>"


def _builder(path: str) -> str:
    for ending, builder in sorted(BUILDERS.items(), key=lambda kv: -len(kv[0])):
        if path.endswith(ending):
            return builder
    raise ValueError(f"data file {path!r}: unknown format; valid endings: {', '.join(BUILDERS)}")


def looks_like_path(source: str) -> bool:
    """A local path (or glob) rather than a Hub dataset name such as allenai/c4."""
    return (os.path.exists(source) or source.startswith((os.path.sep, ".", "~")) or any(c in source for c in "*?[")
            or source.endswith(tuple(BUILDERS)))


def local_files(source: str) -> list[str]:
    """The files a local source names: a file, a directory (its data files) or a glob; sorted."""
    if os.path.isdir(source):
        files = [f for f in glob.glob(os.path.join(source, "**", "*"), recursive=True) if os.path.isfile(f)]
        files = [f for f in files if any(f.endswith(e) for e in BUILDERS)]
    else:
        files = glob.glob(source) if any(c in source for c in "*?[") else [source]
    return sorted(f for f in files if os.path.isfile(f))


def open_documents(source: str, text_field: str = "text", hub_config: str | None = None) -> Iterator[str]:
    """Texts of `source`, streamed: local file(s) or a Hub dataset name such as allenai/c4 (config en)."""
    files = local_files(source)
    if files:
        builders = {_builder(f) for f in files}
        if len(builders) > 1:
            raise ValueError(f"data {source!r} mixes formats ({', '.join(sorted(builders))}); use one")
        dataset = load_dataset(builders.pop(), data_files=files, split="train", streaming=True)
    else:
        dataset = load_dataset(source, hub_config, split="train", streaming=True)
    for row in dataset:
        if text_field not in row:
            raise ValueError(f"data {source!r} has no field {text_field!r}; fields: {', '.join(row)}")
        yield row[text_field]


def train_bpe_tokenizer(texts: Iterator[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (as GPT-2's) trained offline on `texts`, with EOS and PAD special tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_PAD, BPE_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=BPE_EOS, pad_token=BPE_PAD,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)


def load_tokenizer(spec: str, sample: Iterator[str]):
    """`bpe:N` trains a byte-level BPE of N tokens on `sample`; anything else is a name or path for
    AutoTokenizer (offline: a local folder, or a model already in the HF cache)."""
    if spec.startswith("bpe:"):
        return train_bpe_tokenizer(sample, int(spec[4:]))
    tokenizer = AutoTokenizer.from_pretrained(spec)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {spec!r} has no EOS token to separate documents")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_validation(index: int, seed: int, share: float) -> bool:
    """Seeded, stable choice of held-out documents by their index in the source."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < share


def documents_for(texts: Iterator[str], split: str, seed: int, share: float, rank: int = 0,
                  world_size: int = 1) -> Iterator[tuple[int, str]]:
    """(index, text) of the documents of `split` ("train": this rank's round-robin share; "validation")."""
    train_position = 0
    for index, text in enumerate(texts):
        if is_validation(index, seed, share):
            if split == "validation":
                yield index, text
        else:
            if split == "train" and train_position % world_size == rank:
                yield index, text
            train_position += 1


def token_blocks(documents: Iterator[tuple[int, str]], tokenizer, seq_len: int) -> Iterator[list[int]]:
    """Documents joined with EOS and cut into blocks of `seq_len` tokens (the last one may be shorter)."""
    buffer: list[int] = []
    eos = tokenizer.eos_token_id
    for _, text in documents:
        buffer.extend(tokenizer(text, add_special_tokens=False).input_ids + [eos])
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
    if buffer:
        yield buffer


def limited(blocks: Iterator[list[int]], max_blocks: int | None) -> Iterator[list[int]]:
    return blocks if max_blocks is None else itertools.islice(blocks, max_blocks)
