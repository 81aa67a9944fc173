"""What a --data value holds, by content: the hash that pins a corpus, so that runs compared across seeds, or added
to a report later, are known to have read the same tokens.

    python -m adaptive_ds.data.identity DATA

- a prepared directory (`adaptive_ds.data.prepare`): sha256 of its tokenizer's hash and the bytes of its token
  shards, training then validation, in its manifest's order: the ids a run reads, and what they mean. The files are
  read once, streamed, so a corpus of many GB hashes at disk speed with little memory;
- a mixture of prepared directories: sha256 of each part's weight and hash;
- local text files: sha256 of their bytes, in sorted order (a run on them trains its tokenizer from them as its
  --tokenizer says, which its command records);
- the embedded corpus, a generator rather than files: sha256 of its tier's vocabulary and the tokens of the first
  blocks of a fixed stream, so that a change of the grammar, of its fact table or of Python's `random` changes it;
- a Hub dataset, streamed: none, with the reason (its revision is not pinned; prepare it to pin it).

Each is a dict: `sha256` (hex, or None) and `of` (what was hashed) or `why` (why there is no hash).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

from . import EMBEDDED_SOURCES, parse_mixture
from .embedded import block, vocabulary
from .prepared import MANIFEST, SPLITS, is_prepared, read_manifest
from .text import local_files, looks_like_path

CHUNK_BYTES = 1 << 23  # 8 MiB read at a time
# The embedded generator's fingerprint: the first blocks of a stream no run trains or validates on.
FINGERPRINT_STREAM, FINGERPRINT_BLOCKS, FINGERPRINT_SEQ_LEN = "identity", 64, 256


def _update_with_file(h, path: str) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)


def prepared_hash(directory: str) -> dict:
    """The content hash of a complete prepared directory; ValueError, in one line, for a missing, partial or
    damaged one, or a directory that is not a prepare."""
    if not os.path.isdir(directory):
        raise ValueError(f"prepared data {directory!r} does not exist")
    if not is_prepared(directory):
        raise ValueError(f"{directory!r} is not a prepared directory (no {MANIFEST}); make one with `python -m "
                         "adaptive_ds.data.prepare --data SOURCE --out DIR`")
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        raise ValueError(f"{directory!r} is a partial prepare (no {MANIFEST}); run `python -m "
                         "adaptive_ds.data.prepare` with the same arguments again")
    manifest = read_manifest(directory)
    h = hashlib.sha256(f"tokenizer {manifest['tokenizer_sha256']} dtype {manifest['dtype']}\n".encode())
    shards = [shard for split in SPLITS for shard in manifest[split]["shards"]]
    for shard in shards:
        h.update(f"\n{shard['file']} {shard['tokens']}\n".encode())
        try:
            _update_with_file(h, os.path.join(directory, shard["file"]))
        except OSError as e:
            raise ValueError(f"prepared data {directory!r}: {shard['file']} cannot be read ({e.strerror}); prepare "
                             "it again") from None
    tokens = sum(manifest[split]["tokens"] for split in SPLITS)
    return {"sha256": h.hexdigest(),
            "of": f"prepared directory: its {len(shards)} token shards ({tokens:,} tokens) and its tokenizer"}


def embedded_hash(tier: str) -> dict:
    """The embedded generator's identity: its vocabulary and the tokens it generates for a fixed stream."""
    h = hashlib.sha256(json.dumps(vocabulary(tier)).encode())
    for index in range(FINGERPRINT_BLOCKS):
        h.update(("\n" + " ".join(block(FINGERPRINT_STREAM, index, FINGERPRINT_SEQ_LEN, tier).tokens)).encode())
    return {"sha256": h.hexdigest(),
            "of": f"the embedded generator ({tier} tier): its vocabulary and the tokens of its first "
                  f"{FINGERPRINT_BLOCKS} blocks of a fixed stream (no files: the same code and Python version "
                  "generate the same corpus)"}


def data_identity(source: str) -> dict:
    """The content hash of what `--data source` reads (see the module docstring); ValueError for a prepared
    directory that is partial or damaged, or a local source that names no file."""
    if source in EMBEDDED_SOURCES:
        return embedded_hash(EMBEDDED_SOURCES[source])
    mixture = parse_mixture(source)
    if mixture:
        parts = [(weight, prepared_hash(path)["sha256"]) for weight, path in mixture]
        h = hashlib.sha256("\n".join(f"{weight!r} {digest}" for weight, digest in parts).encode())
        return {"sha256": h.hexdigest(), "of": f"a mixture of {len(parts)} prepared directories: each one's hash "
                                              "and weight"}
    if is_prepared(source):
        return prepared_hash(source)
    if not looks_like_path(source):
        return {"sha256": None, "why": f"{source!r} is a Hub dataset, streamed: its revision is not pinned; prepare "
                                       "it (python -m adaptive_ds.data.prepare) to pin the corpus"}
    files = local_files(source)
    if not files:
        raise ValueError(f"data {source!r} names no file")
    h = hashlib.sha256()
    for path in files:
        h.update(f"\n{os.path.basename(path)}\n".encode())
        _update_with_file(h, path)
    return {"sha256": h.hexdigest(), "of": f"{len(files)} local file(s), their bytes (the tokenizer is trained from "
                                          "them as the command's --tokenizer says)"}


def describe(identity: dict | None) -> str:
    """One phrase for a report: the hash and what it covers, why there is none, or that none was recorded."""
    if identity is None:
        return "data hash not recorded"
    if identity["sha256"] is None:
        return f"no data hash: {identity['why']}"
    return f"data sha256 `{identity['sha256']}` ({identity['of']})"


def check(args: argparse.Namespace) -> None:
    """A local source of --data that does not exist, in one line (SystemExit), before anything is read."""
    if args.data in EMBEDDED_SOURCES:
        return
    try:
        parts = [path for _, path in parse_mixture(args.data) or [(1.0, args.data)]]
    except ValueError as e:
        sys.exit(f"error: {e}")
    missing = [path for path in parts if looks_like_path(path) and not (os.path.exists(path) or local_files(path))]
    if missing:
        sys.exit(f"error: data {missing[0]!r} names no file")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Print the content hash of a --data value.")
    p.add_argument("data", help="a prepared directory, a mixture of them, local files, embedded or embedded:hard")
    args = p.parse_args(argv)
    check(args)
    try:
        print(json.dumps(data_identity(args.data), indent=2))
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
