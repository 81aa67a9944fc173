"""A small text corpus for the data tests: its documents, a C4-format shard of them, and a prepared directory."""

import gzip
import json

from adaptive_ds.data.prepare import PrepareArguments, prepare

DOCS = [f"doc{i:03d} " + " ".join(["the river runs", "a cat sleeps", "seven plus two"][i % 3] for _ in range(i % 7 + 1))
        for i in range(240)]


def write_c4(path, docs=DOCS):
    """A C4-format shard: gzipped JSON lines with text, timestamp and url."""
    with gzip.open(path, "wt") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://e.x/{i}"}) + "\n")
    return str(path)


def prepared(tmp_path, name="prep", docs=DOCS, **arguments):
    """`docs` prepared (two worker processes) into tmp_path/name; returns its path."""
    source = write_c4(tmp_path / f"{name}.json.gz", docs)
    out = str(tmp_path / name)
    args = PrepareArguments(source, **{"tokenizer": "bpe:320", "validation_share": 0.1, **arguments})
    prepare(args, out, workers=2, batch_docs=16, shard_tokens=1000)
    return out
