"""Real corpus formats through `datasets`, an offline BPE tokenizer, and exact epoch coverage per rank."""

import itertools
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.corpora import FORMAT_DOCS, streamed_format_docs, write_format

from adaptive_ds.data.text import is_validation, open_documents, train_bpe_tokenizer


@pytest.mark.parametrize("fmt", ["jsonl", "c4", "parquet", "txt"])
def test_every_format_streams_its_documents(tmp_path, fmt):
    path = write_format(tmp_path, fmt)
    texts = list(open_documents(path, text_field="content" if fmt == "jsonl" else "text"))
    assert texts == FORMAT_DOCS


def test_missing_text_field_is_named(tmp_path):
    with pytest.raises(ValueError, match="no field 'text' in its first record"):
        next(open_documents(write_format(tmp_path, "jsonl")))


def test_a_text_field_that_is_not_a_string_skips_the_record_not_the_source(tmp_path):
    path = tmp_path / "corpus.jsonl"
    bad = [{"text": 7}, {"text": None}, {"text": ["a", "list"]}, {"text": {"a": 1}}, {"url": "no text"}, ["a list"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*bad, *({"text": d} for d in FORMAT_DOCS)]))
    skipped = Counter()
    assert list(open_documents(str(path), skipped=skipped)) == FORMAT_DOCS
    assert skipped == {"not_text": 4, "missing_field": 2}
    nulls = tmp_path / "nulls.parquet"  # a parquet column's nulls are not text either
    pq.write_table(pa.table({"text": [None, *FORMAT_DOCS[:3], None]}), nulls)
    skipped = Counter()
    assert list(open_documents(str(nulls), skipped=skipped)) == FORMAT_DOCS[:3]
    assert skipped == {"not_text": 2}


def test_bpe_tokenizer_is_trained_offline_and_round_trips():
    tok = train_bpe_tokenizer(iter(FORMAT_DOCS * 3), vocab_size=300)
    assert len(tok) <= 300 and tok.eos_token == "<|endoftext|>"
    for d in FORMAT_DOCS[:5]:
        assert tok.decode(tok(d).input_ids) == d


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_epoch_reads_every_training_document_exactly_once(tmp_path, world_size):
    from adaptive_ds.data.streaming import _Windows

    # Four files: dealt whole to the ranks by split_dataset_by_node, so each rank reads only its own files.
    for part in range(4):
        _write_part(tmp_path / f"part{part}.jsonl", FORMAT_DOCS[part::4])
    data = streamed_format_docs(str(tmp_path))
    start = {"epoch": 0, "window": 0, "stream_state": None}
    texts = []
    for rank in range(world_size):
        windows = itertools.takewhile(lambda item: item["epoch"] == 0, iter(_Windows(data, rank, world_size, start)))
        texts.append("".join(data.tokenizer.decode(b) for item in windows for b in item["blocks"]))
    val = "".join(data.tokenizer.decode(b) for b in data.validation_blocks())
    owners = {}  # file -> the ranks that read its documents
    for i, doc in enumerate(FORMAT_DOCS):
        held_out = is_validation(doc, 3, 0.2)
        assert val.count(f"doc{i:03d} ") == held_out
        seen = [text.count(f"doc{i:03d} ") for text in texts]
        assert sum(seen) == (0 if held_out else 1), (i, seen)  # nothing dropped, nothing repeated, no overlap
        if not held_out:
            owners.setdefault(i % 4, set()).add(seen.index(1))
    assert all(len(ranks) == 1 for ranks in owners.values())  # whole files dealt to ranks
    assert {r for ranks in owners.values() for r in ranks} == set(range(world_size))


def _write_part(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def test_a_hub_name_goes_to_the_hub_loader_offline(monkeypatch):
    # No network in tests: with the Hub switched off, the Hub branch must fail inside `datasets`' Hub
    # resolution for exactly the name and config given (a local path would never get there).
    import datasets
    import huggingface_hub.constants

    for module in (datasets.config, huggingface_hub.constants):  # read at import: the variable is too late
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    calls = []
    real = datasets.load_dataset

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recording)  # data.text imports it where it reads text
    with pytest.raises(ValueError, match="'allenai/c4' is not a local path, and as a Hub dataset it cannot be "
                                         "opened") as error:
        next(open_documents("allenai/c4", hub_config="en"))
    assert calls == [(("allenai/c4", "en"), {"split": "train", "streaming": True})]
    # what `datasets` raises offline, kept as the cause
    assert type(error.value.__cause__) is ConnectionError
    assert str(error.value.__cause__) == "Couldn't reach 'allenai/c4' on the Hub (OfflineModeIsEnabled)"
