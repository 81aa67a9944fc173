"""Prepare once: tokenize a corpus into token shards on disk, as nanoGPT's prepare.py and Megatron's
preprocess_data.py do, so that training reads blocks by index (random access: a seeded global shuffle, exact
epochs, and a resume that is a seek).

    python -m adaptive_ds.data.prepare --data SRC --tokenizer bpe:32768 --out DIR [--seq_len L] [--workers N]

DIR holds `train_NNNNN.bin` and `validation_00000.bin` (flat uint16/uint32 token streams of documents framed as
their tokenizer frames them, `text.Framing`: a BOS where it adds one, an EOS after each; numpy memmaps),
`tokenizer/`, and `manifest.json` (source, tokenizer and its hash, its BOS and EOS ids as framed, token and
document counts per split, each shard's token count: the index). The manifest is written last and atomically, so a
directory without one is a partial prepare: it is never trained on, and the next prepare starts it over.
Re-running with the same arguments is a no-op; with other arguments it is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm
from transformers import AutoTokenizer

from .prepared import FORMAT_VERSION, MANIFEST, PREPARING, SPLITS, TOKENIZER_DIR, read_manifest, tokenizer_hash
from .text import Framing, is_validation, load_tokenizer, looks_like_path, open_documents

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class PrepareArguments:
    """What the prepared tokens depend on (the manifest records it; the same arguments again are a no-op)."""

    data: str
    tokenizer: str = "bpe:8192"
    seq_len: int | None = None  # recorded: training then refuses another block length
    text_field: str = "text"
    data_config: str | None = None
    validation_share: float = 0.01
    seed: int = 1234  # of the validation choice
    tokenizer_sample_docs: int = 2000


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


class _ShardWriter:
    """Appends tokens to `split_NNNNN.bin` files of at most `shard_tokens` tokens each."""

    def __init__(self, directory: str, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.documents = 0
        self._file = None

    def write(self, tokens: np.ndarray, documents: int) -> None:
        self.documents += documents
        while len(tokens):
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            tokens[:room].astype(self.dtype).tofile(self._file)
            self.shards[-1]["tokens"] += len(tokens[:room])
            tokens = tokens[room:]

    def _open_next(self) -> None:
        self.close()
        name = shard_name(self.split, len(self.shards))
        self._file = open(os.path.join(self.directory, name), "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def record(self) -> dict:
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards), "documents": self.documents}


_worker_tokenizer = None
_worker_framing: Framing | None = None


def _pool(workers: int, tokenizer_dir: str) -> multiprocessing.pool.Pool:
    """A fork pool whose workers start with SIGTERM blocked, until `_init_worker` restores its default: between the
    fork and that line they would hold the calling process's handler, and a terminate then would only be noted.
    The caller's own SIGTERM meanwhile waits, and reaches its handler when the mask is restored here."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return multiprocessing.get_context("fork").Pool(workers, _init_worker, (tokenizer_dir,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _init_worker(tokenizer_dir: str) -> None:
    """A pool worker's start. Pool.terminate() ends the workers with SIGTERM, and a Python handler inherited from the
    calling process (the training command installs one) would only note the signal: the pool would then wait on its
    workers forever. So SIGTERM is the default again here, and SIGINT is left to the calling process, which
    terminates the pool. A worker is forked with SIGTERM blocked (`_pool`), so a terminate that comes before this
    line (a pool that fails at once, on a loaded machine) stays pending until the default is back, and then ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    global _worker_tokenizer, _worker_framing
    _worker_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    _worker_framing = Framing.of(_worker_tokenizer)


def tokenize_batch(texts: list[str], seed: int, share: float) -> tuple[np.ndarray, int, np.ndarray, int]:
    """One batch in a worker: (train tokens, train documents, validation tokens, validation documents), each
    document framed (a BOS where the tokenizer adds one, its tokens, an EOS). Batched: the fast tokenizer splits a
    batch over its own threads."""
    ids = _worker_framing.documents(_worker_tokenizer, texts)
    parts: dict[bool, list[int]] = {False: [], True: []}
    counts = Counter()
    for text, doc in zip(texts, ids, strict=True):
        held_out = is_validation(text, seed, share)
        parts[held_out] += doc
        counts[held_out] += 1
    return (np.array(parts[False], dtype=np.int64), counts[False], np.array(parts[True], dtype=np.int64),
            counts[True])


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    while batch := list(itertools.islice(texts, size)):
        yield batch


def _check_output_dir(out: str, arguments: dict) -> bool:
    """True if `out` already holds this exact prepare; False if it is new, empty or a partial prepare of ours (to
    be started over); refuses anything else."""
    manifest_path = os.path.join(out, MANIFEST)
    if os.path.isfile(manifest_path):
        recorded = read_manifest(out)["arguments"]
        if recorded == arguments:
            return True
        changed = ", ".join(f"{k} {recorded.get(k)!r} (now {v!r})" for k, v in arguments.items()
                            if recorded.get(k) != v)
        raise SystemExit(f"{out!r} already holds a prepare with other arguments: {changed}; pass another --out")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, PREPARING)):
        raise SystemExit(f"--out {out!r} is a non-empty directory that is not a prepare; pass a new or empty one")
    return False


def prepare(args: PrepareArguments, out: str, workers: int | None = None, batch_docs: int = 256,
            shard_tokens: int = 1 << 28) -> dict:
    """Tokenize `args.data` into `out` (see the module docstring); returns the manifest."""
    arguments = dataclasses.asdict(args)
    if _check_output_dir(out, arguments):
        logger.info("%s is already prepared with these arguments: nothing to do", out)
        return read_manifest(out)
    # a source without a usable document is refused here, before `out` is touched
    sample = itertools.islice(open_documents(args.data, args.text_field, args.data_config),
                              args.tokenizer_sample_docs)
    if os.path.isfile(os.path.join(out, PREPARING)):
        logger.warning("%s holds a partial prepare (killed before its manifest): starting it over", out)
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, PREPARING), "w") as f:
        json.dump(arguments, f)
    tokenizer = load_tokenizer(args.tokenizer, sample)
    tokenizer.save_pretrained(os.path.join(out, TOKENIZER_DIR))
    # as the workers frame documents: with the tokenizer saved, read back
    framing = Framing.of(AutoTokenizer.from_pretrained(os.path.join(out, TOKENIZER_DIR)))
    dtype = np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32)
    writers = {split: _ShardWriter(out, split, dtype, shard_tokens) for split in SPLITS}
    skipped = Counter()
    texts = open_documents(args.data, args.text_field, args.data_config, skipped)
    workers = workers or os.cpu_count() or 1
    started = time.perf_counter()
    bar = tqdm(unit="tok", unit_scale=True, desc=f"prepare ({workers} workers)", dynamic_ncols=True)
    # Forked workers start in milliseconds; the tokenizer's own threads are off in them (one process per core).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with _pool(workers, os.path.join(out, TOKENIZER_DIR)) as pool:
        results = pool.imap(_TokenizeBatch(args.seed, args.validation_share), _batches(texts, batch_docs))
        for train_ids, train_docs, val_ids, val_docs in results:  # in the source's order: a deterministic prepare
            writers["train"].write(train_ids, train_docs)
            writers["validation"].write(val_ids, val_docs)
            bar.update(len(train_ids) + len(val_ids))
    bar.close()
    for writer in writers.values():
        writer.close()
    seconds = time.perf_counter() - started
    manifest = {"format": FORMAT_VERSION, "arguments": arguments, "source": args.data,
                "tokenizer": args.tokenizer, "tokenizer_sha256": tokenizer_hash(out), "vocab_size": len(tokenizer),
                "dtype": dtype.name, "bos_token_id": framing.bos, "eos_token_id": framing.eos,
                **{split: writers[split].record() for split in SPLITS}, "skipped": dict(skipped),
                "seconds": round(seconds, 2)}
    _write_manifest(out, manifest)
    total = manifest["train"]["tokens"] + manifest["validation"]["tokens"]
    logger.info("prepared %s: %s tokens (%s training, %s documents) in %.1f s, %.0f tokens/s%s", out, f"{total:,}",
                f"{manifest['train']['tokens']:,}", f"{manifest['train']['documents']:,}", seconds,
                total / max(seconds, 1e-9), f"; skipped {dict(skipped)}" if skipped else "")
    return manifest


@dataclasses.dataclass(frozen=True)
class _TokenizeBatch:
    """A picklable `tokenize_batch` with the validation choice bound (for Pool.imap)."""

    seed: int
    share: float

    def __call__(self, texts: list[str]):
        return tokenize_batch(texts, self.seed, self.share)


def _write_manifest(out: str, manifest: dict) -> None:
    tmp = os.path.join(out, f"{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, MANIFEST))  # the moment the prepare becomes complete
    os.remove(os.path.join(out, PREPARING))


def check(args: argparse.Namespace) -> None:
    """What main checks before it reads a document: local data that names no file, and a tokenizer path that does not
    exist (a Hub name is the prepare's to find); ValueError in one line."""
    from . import source_problems  # the training run's check of --data, and its messages

    problems = source_problems(args.data) if looks_like_path(args.data) else []
    if problems:
        raise ValueError("; ".join(problems))
    spec = args.tokenizer
    if not spec.startswith("bpe:") and not os.path.exists(spec) and (spec.count("/") > 1 or spec.startswith(
            (os.path.sep, ".", "~"))):
        raise ValueError(f"--tokenizer {spec!r}: no such folder; pass bpe:N, a tokenizer's folder or a Hub name")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="Tokenize a corpus once into token shards for `--data DIR`.")
    p.add_argument("--data", required=True, help="local files (.jsonl, .json.gz, .parquet, .txt; a glob or folder) "
                                                 "or a Hub dataset name (streamed)")
    p.add_argument("--tokenizer", default=PrepareArguments.tokenizer,
                   help="bpe:N (trained offline on the first documents) or a tokenizer name or path")
    p.add_argument("--out", required=True, help="new or empty directory (or an earlier prepare of the same)")
    p.add_argument("--seq_len", type=int, help="block length training must use (recorded in the manifest)")
    p.add_argument("--text_field", default="text")
    p.add_argument("--data_config", help="Hub dataset config (e.g. en for allenai/c4)")
    p.add_argument("--validation_share", type=float, default=PrepareArguments.validation_share)
    p.add_argument("--seed", type=int, default=PrepareArguments.seed, help="seed of the validation choice")
    p.add_argument("--tokenizer_sample_docs", type=int, default=PrepareArguments.tokenizer_sample_docs)
    p.add_argument("--workers", type=int, help="tokenizing processes (default: every CPU)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check(a)
        prepare(PrepareArguments(a.data, a.tokenizer, a.seq_len, a.text_field, a.data_config, a.validation_share,
                                 a.seed, a.tokenizer_sample_docs), a.out, a.workers)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
