"""Text corpora through Hugging Face `datasets`: Hub datasets (streamed) and local files, read lazily.

Every source is a `datasets.IterableDataset` of rows (`document_rows`), so sharding over ranks
(`split_dataset_by_node`) and resumable positions (`state_dict`) are the library's. Local JSON lines
(`.jsonl`, `.json`, `.json.gz`: C4's format) are read by a generator that checks each record on its own, so one
bad record (invalid UTF-8, not JSON, no text field, a text field that is not a string) or a truncated gzip member
costs that record or the rest of that file, with a counted warning, never the run. Each file is one shard of the
dataset. A source that holds no usable document at all is refused when it is opened (`open_documents`).

Documents are tokenized as their tokenizer's family frames them (`Framing`: a BOS first where the tokenizer adds
one, an EOS last), joined and cut into `seq_len` blocks. A fixed share of documents (chosen by a seeded hash of
their text) is held out for validation.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import itertools
import json
import logging
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

if TYPE_CHECKING:
    from datasets import IterableDataset

logger = logging.getLogger(__name__)

# datasets builders by file ending
BUILDERS = {".jsonl": "json", ".json": "json", ".json.gz": "json", ".jsonl.gz": "json", ".parquet": "parquet",
            ".txt": "text", ".txt.gz": "text"}
BPE_EOS = "<|endoftext|>"
BPE_PAD = "<|pad|>"
SKIP = "_skip"  # the column that carries why a record was skipped (empty when it is a document)
SKIP_REASONS = ("empty", "invalid_utf8", "not_json", "missing_field", "not_text", "truncated_file")
GZIP_MAGIC = b"\x1f\x8b"
FRAMING_PROBE = "a b"  # any text: what the tokenizer puts around it is what it puts around every document


def _builder(path: str) -> str:
    """The `datasets` builder of a local file, by its ending. A .gz file must start as gzip does (an empty one holds
    no records, and one cut short is read up to the cut): another file named .gz is refused, not read as damage."""
    for ending, builder in sorted(BUILDERS.items(), key=lambda kv: -len(kv[0])):
        if path.endswith(ending):
            if ending.endswith(".gz"):
                with open(path, "rb") as f:
                    head = f.read(len(GZIP_MAGIC))
                if head and head != GZIP_MAGIC:
                    raise ValueError(f"data file {path!r} ends in .gz but is not gzip-compressed; compress it "
                                     "(gzip) or drop the .gz from its name")
            return builder
    raise ValueError(f"data file {path!r}: unknown format; valid endings: {', '.join(BUILDERS)}")


def file_format(files: list[str], source: str) -> str:
    """The one `datasets` builder of `source`'s local `files` (ValueError for an unknown, damaged or mixed format)."""
    builders = {_builder(f) for f in files}
    if len(builders) > 1:
        raise ValueError(f"data {source!r} mixes formats ({', '.join(sorted(builders))}); use one")
    return builders.pop()


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


def _json_line(raw: bytes, text_field: str) -> tuple[str, str]:
    """(text, "") for a good record, ("", reason) for a skipped one."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "", "invalid_utf8"
    except json.JSONDecodeError:
        return "", "not_json"
    if not isinstance(record, dict) or text_field not in record:
        return "", "missing_field"
    if not isinstance(record[text_field], str):  # a number, null, a list: the field is right, the record is bad
        return "", "not_text"
    return record[text_field], ""


_CORRUPT = (EOFError, OSError, zlib.error)  # a truncated or damaged gzip stream


def _json_lines_rows(files: list[str], text_field: str, corrupt: tuple = _CORRUPT) -> Iterator[dict]:
    """Rows {text_field, SKIP} of JSON lines files, one record at a time (a `datasets` generator: `files` are
    its shards). A truncated or corrupt gzip stream ends its file with one `truncated_file` row."""
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            try:
                for raw in f:
                    if raw.strip():
                        text, skip = _json_line(raw, text_field)
                        yield {text_field: text, SKIP: skip}
            except corrupt as e:  # bound as an argument: still there when the generator is closed at exit
                logger.warning("data file %s is truncated or corrupt (%s): its remaining records are skipped",
                               path, e)
                yield {text_field: "", SKIP: "truncated_file"}


def document_rows(source: str, text_field: str = "text", hub_config: str | None = None) -> IterableDataset:
    """`source` as a streamed `datasets.IterableDataset` of rows: local file(s), one shard per file, or a Hub
    dataset name such as allenai/c4 (config en). Read the texts with `checked_text`."""
    # imported here, not with the module: `datasets` (and pandas) cost a second at every process start, and only a
    # run on text reads it
    from datasets import IterableDataset, load_dataset

    files = local_files(source)
    if not files:
        try:
            return load_dataset(source, hub_config, split="train", streaming=True)
        except (ConnectionError, FileNotFoundError) as e:  # unreachable, offline, or no such dataset
            raise ValueError(f"data {source!r} is not a local path, and as a Hub dataset it cannot be opened "
                             f"({' '.join(str(e).split())}); pass local files, a prepared directory or a Hub dataset "
                             "name") from e
    builder = file_format(files, source)
    if builder == "json":
        return IterableDataset.from_generator(_json_lines_rows, gen_kwargs={"files": files,
                                                                            "text_field": text_field})
    return load_dataset(builder, data_files=files, split="train", streaming=True)


def checked_text(row: dict, text_field: str, skipped: Counter) -> str | None:
    """The row's text, or None (counted in `skipped` by reason, with a warning the first time) if it is not a
    usable document."""
    reason = row.get(SKIP) or ""
    text = row.get(text_field)
    if not reason and text_field not in row:
        reason = "missing_field"
    elif not reason and not isinstance(text, str):  # a null in a parquet column, say
        reason = "not_text"
    elif not reason and not text.strip():
        reason = "empty"
    if not reason:
        return text
    if not skipped[reason]:
        logger.warning("skipping a data record (%s); further ones are counted in summary.json's data_skipped",
                       reason)
    skipped[reason] += 1
    return None


def open_documents(source: str, text_field: str = "text", hub_config: str | None = None,
                   skipped: Counter | None = None) -> Iterator[str]:
    """Texts of `source`, streamed, bad records skipped and counted in `skipped`.

    Checked here, in the caller's process and before any text reaches a consumer (the tokenizer trainer, which
    would bury the error in its own traceback; DataLoader workers): a first record without `text_field` means the
    field is wrong, and a source without a usable document is refused. Reading stops at the first usable one, so
    the check costs one record of a good corpus, whatever its size.
    """
    skipped = Counter() if skipped is None else skipped
    documents = _documents(source, text_field, hub_config, skipped)
    first = next(documents, None)
    if first is None:
        records = sum(skipped.values())
        if not records:
            raise ValueError(f"data {source!r} holds no records; pass a source with documents")
        reasons = ", ".join(f"{reason} {count}" for reason, count in skipped.most_common())
        counted = f"{records} record skipped" if records == 1 else f"{records} records skipped"
        raise ValueError(f"data {source!r} holds no usable document ({counted}: {reasons}); each record needs "
                         f"non-empty text in its {text_field!r} field")
    return itertools.chain([first], documents)


def _documents(source: str, text_field: str, hub_config: str | None, skipped: Counter) -> Iterator[str]:
    for position, row in enumerate(document_rows(source, text_field, hub_config)):
        if position == 0 and (text_field not in row or row.get(SKIP) == "missing_field"):
            raise ValueError(f"data {source!r} has no field {text_field!r} in its first record; pass the field that "
                             "holds the text (--text_field)")
        text = checked_text(row, text_field, skipped)
        if text is not None:
            yield text


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
    if tokenizer.pad_token_id is None:  # Llama 3, SmolLM2: the EOS pads, and padding is never in the loss
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_validation(text: str, seed: int, share: float) -> bool:
    """Seeded, stable choice of held-out documents by a hash of their text: the same choice whatever the order,
    sharding or number of ranks that reads them (and a repeated document lands on one side only)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64 < share


@dataclasses.dataclass(frozen=True)
class Framing:
    """How a document sits in the token stream: `bos` (or nothing, where None), its text's tokens, then `eos`.

    The tokenizer says which: the BOS is its own and is put only where its own encoding puts it (the post-processor
    of its tokenizer.json: Llama 2 and 3, TinyLlama, Mistral; not Qwen2.5 or Qwen3, which have no BOS, nor GPT-2
    style tokenizers such as SmolLM2's, whose BOS is their EOS and is not added). Every document ends with the EOS,
    which separates it from the next. The text is tokenized without the tokenizer's special tokens and framed
    here, so a tokenizer that also appends an EOS of its own does not give two."""

    bos: int | None
    eos: int

    @classmethod
    def of(cls, tokenizer) -> Framing:
        """ValueError in one line for a tokenizer without an EOS: documents could not be told apart."""
        eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path or type(tokenizer).__name__!r} has no EOS token to "
                             "end documents with; pass a tokenizer that has one (eos_token)")
        plain = tokenizer(FRAMING_PROBE, add_special_tokens=False).input_ids
        framed = tokenizer(FRAMING_PROBE).input_ids
        adds_bos = bos is not None and framed[:1] == [bos] and framed[1:1 + len(plain)] == plain
        return cls(bos if adds_bos else None, eos)

    def documents(self, tokenizer, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, framed."""
        ids = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
        head = [] if self.bos is None else [self.bos]
        return [head + doc + [self.eos] for doc in ids]
