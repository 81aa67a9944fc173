"""Real corpus formats through `datasets`, an offline BPE tokenizer, and exact epoch coverage per rank."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_ds_config

from adaptive_ds.data import build_training_data
from adaptive_ds.data.text import documents_for, open_documents, token_blocks, train_bpe_tokenizer
from adaptive_ds.training import train

DOCS = [f"doc{i:03d} " + " ".join(["the river runs", "a cat sleeps", "seven plus two"][i % 3] for _ in range(i % 5 + 1))
        for i in range(60)]


def _write(tmp_path, fmt):
    if fmt == "jsonl":
        path = tmp_path / "corpus.jsonl"
        path.write_text("".join(json.dumps({"content": d}) + "\n" for d in DOCS))
    elif fmt == "c4":  # C4's own shards: gzipped JSON lines with text, timestamp, url
        path = tmp_path / "c4-train.00000-of-01024.json.gz"
        with gzip.open(path, "wt") as f:
            for i, d in enumerate(DOCS):
                f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://e.x/{i}"}) + "\n")
    elif fmt == "parquet":
        path = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"text": DOCS}), path)
    else:
        path = tmp_path / "corpus.txt"
        path.write_text("\n".join(DOCS) + "\n")
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "c4", "parquet", "txt"])
def test_every_format_streams_its_documents(tmp_path, fmt):
    path = _write(tmp_path, fmt)
    texts = list(open_documents(path, text_field="content" if fmt == "jsonl" else "text"))
    assert texts == DOCS


def test_missing_text_field_is_named(tmp_path):
    with pytest.raises(ValueError, match="no field 'text' in its first record"):
        next(open_documents(_write(tmp_path, "jsonl")))


def test_bpe_tokenizer_is_trained_offline_and_round_trips():
    tok = train_bpe_tokenizer(iter(DOCS * 3), vocab_size=300)
    assert len(tok) <= 300 and tok.eos_token == "<|endoftext|>"
    for d in DOCS[:5]:
        assert tok.decode(tok(d).input_ids) == d


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_epoch_reads_every_training_document_exactly_once(world_size):
    val = [i for i, _ in documents_for(iter(DOCS), "validation", seed=3, share=0.2)]
    train_docs = [i for r in range(world_size)
                  for i, _ in documents_for(iter(DOCS), "train", seed=3, share=0.2, rank=r, world_size=world_size)]
    assert 0 < len(val) < 30
    assert sorted(train_docs + val) == list(range(60))  # nothing dropped, nothing repeated, no overlap
    # and at the token level: the blocks of all ranks hold each training document's marker once
    tok = train_bpe_tokenizer(iter(DOCS), vocab_size=400)
    text = ""
    for r in range(world_size):
        docs = documents_for(iter(DOCS), "train", seed=3, share=0.2, rank=r, world_size=world_size)
        text += "".join(tok.decode(b) for b in token_blocks(docs, tok, seq_len=16))
    for i in range(60):
        assert text.count(f"doc{i:03d} ") == (0 if i in val else 1)


def test_epochs_repeat_a_subset(tmp_path):
    data = build_training_data(_write(tmp_path, "txt"), 16, seed=0, tokenizer="bpe:300", validation_share=0.1,
                               epoch_blocks=3)
    blocks = data.train_blocks(0, 1)
    first, second = [next(blocks) for _ in range(3)], [next(blocks) for _ in range(3)]
    assert first == second


def test_training_on_local_c4_shards_writes_the_contract(tmp_path):
    path = _write(tmp_path, "c4")
    config = write_ds_config(tmp_path, data=path, tokenizer="bpe:320", validation_share=0.2, max_steps=3)
    out = tmp_path / "run"
    summary = train(["--ds_config", config, "--output_dir", str(out)])
    assert summary["tokens_seen"] == 3 * 2 * 256 and "entropy_floor" not in summary
    assert (out / "final" / "tokenizer.json").exists()


def test_token_budget_sets_the_steps(tmp_path):
    path = _write(tmp_path, "txt")
    config = write_ds_config(tmp_path, data=path, tokenizer="bpe:320", tokens="2000")
    summary = train(["--ds_config", config, "--output_dir", str(tmp_path / "run"),
                     "--epochs", "2"])
    assert summary["steps"] == 4  # ceil(2000 / (2 x 256))


def test_a_hub_name_goes_to_the_hub_loader_offline(monkeypatch):
    # No network in tests: with the Hub switched off, the Hub branch must fail inside `datasets`' Hub
    # resolution for exactly the name and config given (a local path would never get there).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    calls = []
    real = datasets.load_dataset

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr("adaptive_ds.data.text.load_dataset", recording)
    with pytest.raises(Exception) as error:
        next(open_documents("allenai/c4", hub_config="en"))
    assert calls == [(("allenai/c4", "en"), {"split": "train", "streaming": True})]
    assert "allenai/c4" in str(error.value) or "offline" in str(error.value).lower()
