"""Small text corpora for the data tests: their documents, a C4-format shard of them, a prepared directory, and a
corpus in each format the text reader takes."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq

from adaptive_ds.data.prepare import PrepareArguments, prepare

DOCS = [f"doc{i:03d} " + " ".join(["the river runs", "a cat sleeps", "seven plus two"][i % 3] for _ in range(i % 7 + 1))
        for i in range(240)]
# 60 shorter documents, one corpus file in each format (write_format)
FORMAT_DOCS = [f"doc{i:03d} " + " ".join(["the river runs", "a cat sleeps", "seven plus two"][i % 3]
                                         for _ in range(i % 5 + 1)) for i in range(60)]


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


def write_format(tmp_path, fmt: str) -> str:
    """FORMAT_DOCS as one file of format `fmt` (jsonl with a "content" column, C4's gzipped shard, parquet, or plain
    text, one document a line) in tmp_path; returns its path."""
    if fmt == "jsonl":
        path = tmp_path / "corpus.jsonl"
        path.write_text("".join(json.dumps({"content": d}) + "\n" for d in FORMAT_DOCS))
    elif fmt == "c4":  # C4's own shards: gzipped JSON lines with text, timestamp, url
        path = write_c4(tmp_path / "c4-train.00000-of-01024.json.gz", FORMAT_DOCS)
    elif fmt == "parquet":
        path = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"text": FORMAT_DOCS}), path)
    else:
        path = tmp_path / "corpus.txt"
        path.write_text("\n".join(FORMAT_DOCS) + "\n")
    return str(path)


def streamed_format_docs(path, **kwargs):
    """StreamingData over the FORMAT_DOCS files written under `path` (a BPE tokenizer of 400 tokens trained on them,
    blocks of 16, seed 3, a 20% validation share), in windows of 7 documents read in-process; `kwargs` override."""
    from adaptive_ds.data.streaming import StreamingData
    from adaptive_ds.data.text import train_bpe_tokenizer

    tok = train_bpe_tokenizer(iter(FORMAT_DOCS), vocab_size=400)
    return StreamingData(path, tok, 16, seed=3, text_field="text", hub_config=None, validation_share=0.2,
                         **{"window_docs": 7, "workers": 0, **kwargs})
