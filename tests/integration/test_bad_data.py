"""Data a run cannot train on ends the training command with one line and a non-zero exit, before anything is
written (a damaged prepared directory, prepares with different tokenizers, a rank without records, data that fails
on one rank); a streamed source that yields no training block ends the run too (never an endless loop of empty
epochs)."""

import json
import os
import re
import shutil
import signal
import sys

import pytest
from helpers.bad_data import GOOD, refused, write_file
from helpers.common import ends_within
from helpers.corpora import DOCS, prepared

from adaptive_ds.data.text import is_validation, train_bpe_tokenizer
from adaptive_ds.ds_config import ConfigError
from adaptive_ds.training import train
from adaptive_ds.training.__main__ import main


@pytest.mark.slow
def test_a_source_whose_only_record_is_unreadable_ends_at_once(tmp_path, run_command, tiny_ds_config):
    # Once an endless loop: every epoch skipped the record and started the next one, and SIGTERM did not stop it.
    source = write_file(tmp_path / "corpus.jsonl", b'{"text": "bad \xff\xfe bytes"}\n')
    config = tiny_ds_config(data=source, tokenizer="bpe:300", max_steps=3)
    out = tmp_path / "run"
    result = run_command([sys.executable, "launchers/train.py", "--ds_config", config, "--output_dir", str(out)],
                         timeout=300)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last == (f"error: data {source!r} holds no usable document (1 record skipped: invalid_utf8 1); each "
                    "record needs non-empty text in its 'text' field")
    assert not out.exists()


def test_records_whose_text_is_not_a_string_are_skipped_and_counted(tmp_path, tiny_ds_config):
    # A first record holding a number used to refuse the whole source as if the field were missing.
    bad = '{"text": 7}\n{"text": null}\n{"text": ["a list"]}\n{"url": "no text field"}\n'
    source = write_file(tmp_path / "corpus.jsonl", bad + GOOD)
    config = tiny_ds_config(data=source, tokenizer="bpe:300", validation_share=0.2, max_steps=1)
    summary = train(["--ds_config", config, "--output_dir", str(tmp_path / "run")])
    assert summary["data_skipped"] == {"not_text": 3, "missing_field": 1}


def test_a_mixture_of_prepares_with_different_tokenizers_is_refused(tmp_path, capfd):
    a, b = prepared(tmp_path, "a"), prepared(tmp_path, "b", docs=[d.upper() for d in DOCS])
    assert refused(tmp_path, capfd, f"0.5:{a},0.5:{b}") == (
        f"error: the mixed prepared directories {a}, {b} were made with different tokenizers; prepare them with one "
        "--tokenizer")


@pytest.mark.parametrize("damage", ["truncated shard", "broken manifest", "manifest without its index",
                                    "no tokenizer"])
def test_a_damaged_prepared_directory_is_refused(tmp_path, capfd, damage):
    out = prepared(tmp_path, seq_len=256)
    if damage == "truncated shard":
        shard = os.path.join(out, "train_00001.bin")
        with open(shard, "r+b") as f:
            f.truncate(1200)  # mid-file: 600 of its 1000 tokens
        expected = (f"prepared data {out!r}: train_00001.bin holds 1200 bytes, its manifest says 1000 tokens of "
                    "uint16; prepare it again")
    elif damage == "broken manifest":
        manifest = os.path.join(out, "manifest.json")
        with open(manifest) as f:
            text = f.read()
        with open(manifest, "w") as f:
            f.write(text[: len(text) // 2])
        expected = f"prepared data {out!r}: its manifest.json is not valid JSON ("
    elif damage == "manifest without its index":
        manifest = os.path.join(out, "manifest.json")
        with open(manifest) as f:
            content = json.load(f)
        del content["train"]
        with open(manifest, "w") as f:
            json.dump(content, f)
        expected = f"prepared data {out!r}: its manifest.json has no 'train'; prepare it again"
    else:
        shutil.rmtree(os.path.join(out, "tokenizer"))
        expected = f"prepared data {out!r} has no tokenizer/ directory; prepare it again"
    assert refused(tmp_path, capfd, out).startswith(f"error: {expected}")


def test_resuming_on_data_prepared_again_with_another_tokenizer_is_refused(tmp_path, capfd, tiny_ds_config):
    # Same vocabulary size, other merges: the model would load and silently train on ids that mean other tokens.
    source = prepared(tmp_path, seq_len=256)
    config = tiny_ds_config(data=source, tokenizer="bpe:300", max_steps=1)  # as `refused` runs it
    out = tmp_path / "run"
    train(["--ds_config", config, "--output_dir", str(out)])
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    vocab_size = json.loads((tmp_path / "prep" / "manifest.json").read_text())["vocab_size"]
    shutil.rmtree(source)
    prepared(tmp_path, seq_len=256, docs=[d.upper() for d in DOCS])
    assert json.loads((tmp_path / "prep" / "manifest.json").read_text())["vocab_size"] == vocab_size
    message = refused(tmp_path, capfd, source, output_dir=out, max_steps=2)
    assert "does not match this run: tokenizer 'sha256:" in message
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def _held_out_only(tmp_path, seed: int, share: float) -> tuple[str, list[str]]:
    """A source whose every document is held out for validation at (seed, share): no training block at all."""
    held_out = [d for d in DOCS if is_validation(d, seed, share)]
    assert len(held_out) > 20
    return write_file(tmp_path / "held_out.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in held_out)), held_out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_without_a_training_block_is_refused_not_read_forever(tmp_path, workers):
    from adaptive_ds.data.streaming import StreamingData

    source, held_out = _held_out_only(tmp_path, 3, 0.5)
    tok = train_bpe_tokenizer(iter(DOCS), vocab_size=300)
    data = StreamingData(source, tok, 16, seed=3, text_field="text", hub_config=None, validation_share=0.5,
                         window_docs=7, workers=workers)
    with ends_within(60), pytest.raises(ConfigError, match=re.escape(
            f"data {source!r} gave rank 0 of 1 no training block in a whole epoch of {len(held_out)} records: each was "
            "skipped or held out for validation; pass more documents or a smaller --validation_share")):
        next(data.step_batches(0, 4))


def test_a_rank_without_records_is_refused_in_one_line(tmp_path):
    from adaptive_ds.data.streaming import StreamingData

    source = write_file(tmp_path / "one.jsonl", json.dumps({"text": DOCS[0]}) + "\n")  # two ranks, one record
    tok = train_bpe_tokenizer(iter(DOCS), vocab_size=300)
    data = StreamingData(source, tok, 16, seed=3, text_field="text", hub_config=None, validation_share=0.01,
                         window_docs=7, workers=1)
    with ends_within(60), pytest.raises(ConfigError) as error:
        next(data.step_batches(0, 4, rank=1, world_size=2))
    assert str(error.value) == (f"data {source!r} has no records for rank 1 of 2; pass a source with at least as "
                                "many records as processes")


def test_a_run_on_held_out_documents_only_ends_with_one_line(tmp_path, capfd, tiny_ds_config):
    source, _ = _held_out_only(tmp_path, 1234, 0.5)  # 1234: the run's seed
    config = tiny_ds_config(data=source, tokenizer="bpe:300", validation_share=0.5, max_steps=2)
    capfd.readouterr()
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        with ends_within(120), pytest.raises(SystemExit) as stopped:
            main(["--ds_config", config, "--output_dir", str(tmp_path / "run")])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    err = capfd.readouterr().err
    assert stopped.value.code == 1 and err.splitlines()[-1].startswith(
        f"error: data {source!r} gave rank 0 of 1 no training block in a whole epoch"), err[-3000:]
    assert "Traceback" not in err


@pytest.mark.slow
def test_data_that_fails_on_one_rank_stops_every_rank_with_its_line(tmp_path, run_command, tiny_ds_config):
    """Two processes stream one file, each keeping every other record: the odd ones are all unreadable, so rank 1
    has no training block while rank 0 has. Both end with rank 1's line, not rank 0 with a lost contact."""
    lines = []
    for doc in DOCS[:60]:
        lines += [json.dumps({"text": doc}) + "\n", "{not json\n"]
    source = write_file(tmp_path / "corpus.jsonl", "".join(lines))
    config = tiny_ds_config(data=source, tokenizer="bpe:300", validation_share=0.2, max_steps=2)
    done = run_command(["torchrun", "--nproc_per_node", "2", "launchers/train.py", "--ds_config", config,
                        "--output_dir", str(tmp_path / "run")], timeout=300)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]  # each rank's one line
    # every rank that got to say anything says rank 1's problem (the launcher may stop the other first)
    assert ours and all(line.startswith(f"error: data {source!r} gave rank 1 of 2 no training block in a whole "
                                        "epoch") for line in ours), done.stderr[-3000:]
