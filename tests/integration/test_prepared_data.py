"""Prepared token shards: what `prepare` writes (checked against the tokenizer applied document by document),
its no-op and partial cases, block-level global shuffle and exact epochs, the same tokens on any number of
ranks, mixtures, and clear refusals of directories that do not match their manifest."""

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.common import ROOT, logged_losses, run_command, write_ds_config
from helpers.corpora import DOCS, prepared, write_c4
from transformers import AutoTokenizer

from adaptive_ds.data import PreparedData, build_training_data
from adaptive_ds.data.prepare import PrepareArguments, main, prepare
from adaptive_ds.data.prepared import Mixture, PreparedCorpus
from adaptive_ds.data.text import is_validation
from adaptive_ds.training import train


def test_prepare_writes_each_document_tokenized_once_in_order(tmp_path):
    out = prepared(tmp_path)
    manifest = json.loads(open(os.path.join(out, "manifest.json")).read())
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"))
    # the reference: the tokenizer applied to one document at a time, split by the validation rule
    expected = {"train": [], "validation": []}
    for d in DOCS:
        expected["validation" if is_validation(d, 1234, 0.1) else "train"] += tok(d).input_ids + [tok.eos_token_id]
    for split in ("train", "validation"):
        shards = manifest[split]["shards"]
        written = np.concatenate([np.fromfile(os.path.join(out, s["file"]), dtype=np.uint16) for s in shards])
        assert written.tolist() == expected[split]
        assert manifest[split]["tokens"] == len(expected[split])
    assert len(manifest["train"]["shards"]) > 2 and all(s["tokens"] <= 1000 for s in manifest["train"]["shards"])
    assert manifest["train"]["documents"] + manifest["validation"]["documents"] == len(DOCS)
    assert 0 < manifest["validation"]["documents"] < 50 and manifest["dtype"] == "uint16"


def test_prepare_again_is_a_no_op_and_other_arguments_are_refused(tmp_path):
    out = prepared(tmp_path)
    stamps = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    prepared(tmp_path)
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == stamps
    with pytest.raises(SystemExit, match="other arguments: tokenizer 'bpe:320' .now 'bpe:400'"):
        prepared(tmp_path, tokenizer="bpe:400")
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == stamps


def test_a_partial_prepare_is_refused_for_training_and_started_over(tmp_path):
    out = prepared(tmp_path)
    reference = open(os.path.join(out, "train_00000.bin"), "rb").read()
    os.rename(os.path.join(out, "manifest.json"), os.path.join(out, "PREPARING"))  # as if killed before the end
    with pytest.raises(ValueError, match="is a partial prepare"):
        build_training_data(out, 16, seed=0)
    prepared(tmp_path)
    assert open(os.path.join(out, "train_00000.bin"), "rb").read() == reference
    assert not os.path.exists(os.path.join(out, "PREPARING"))


def test_a_directory_that_does_not_match_its_manifest_is_refused(tmp_path):
    out = prepared(tmp_path)
    tokenizer_json = os.path.join(out, "tokenizer", "tokenizer.json")
    original = open(tokenizer_json).read()
    open(tokenizer_json, "w").write(original.replace('"doc', '"dok', 1))
    with pytest.raises(ValueError, match="is not the one its tokens were made with"):
        build_training_data(out, 16, seed=0)
    open(tokenizer_json, "w").write(original)
    shard = os.path.join(out, "train_00001.bin")
    open(shard, "ab").write(b"\0\0")
    with pytest.raises(ValueError, match="train_00001.bin holds 2002 bytes, its manifest says 1000 tokens"):
        build_training_data(out, 16, seed=0)


def test_the_command_line_prepares_and_names_a_bad_source(tmp_path):
    source = write_c4(tmp_path / "c.json.gz")
    main(["--data", source, "--tokenizer", "bpe:300", "--out", str(tmp_path / "p"), "--workers", "1"])
    assert (tmp_path / "p" / "manifest.json").exists()
    with pytest.raises(SystemExit, match="has no field 'content'"):
        main(["--data", source, "--text_field", "content", "--out", str(tmp_path / "q"), "--workers", "1"])


def test_an_epoch_reads_every_block_once_in_a_seeded_order(tmp_path):
    data = build_training_data(prepared(tmp_path), 16, seed=3, workers=0)
    blocks = data.blocks[0]
    corpus = data.corpora[0]
    every = sorted(corpus.block("train", b, 16).tobytes() for b in range(blocks))
    first = [data.sample(g).tobytes() for g in range(blocks)]
    second = [data.sample(g).tobytes() for g in range(blocks, 2 * blocks)]
    assert sorted(first) == sorted(second) == every and blocks == corpus.tokens("train") // 16
    assert first != second  # a new order each epoch
    assert first != [corpus.block("train", b, 16).tobytes() for b in range(blocks)]  # shuffled
    assert first == [build_training_data(prepared(tmp_path), 16, seed=3).sample(g).tobytes() for g in range(blocks)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_step_holds_the_same_rows_whatever_the_ranks_and_a_resume_is_a_seek(tmp_path, workers):
    data = build_training_data(prepared(tmp_path), 16, seed=1, workers=workers)
    one = data.step_batches(0, 8)
    steps = [next(one) for _ in range(12)]  # several epochs of this small corpus
    for world in (2, 4):
        ranks = [data.step_batches(0, 8, rank, world) for rank in range(world)]
        for step in steps:
            assert torch.cat([next(r)["input_ids"] for r in ranks]).equal(step["input_ids"])
    assert next(data.step_batches(9, 8, 1, 2))["input_ids"].equal(steps[9]["input_ids"][4:])
    assert (steps[0]["labels"] == steps[0]["input_ids"]).all()  # prepared blocks are full: no padding


def test_a_mixture_follows_its_weights_exactly_and_logs_the_shares(tmp_path):
    mixture = Mixture([0.7, 0.2, 0.1])
    located = [mixture.locate(g) for g in range(5000)]
    for source, weight in enumerate([0.7, 0.2, 0.1]):
        own = [o for s, o in located if s == source]
        assert own == list(range(len(own)))  # each source read in its own order, nothing skipped
        assert abs(len(own) - weight * 5000) <= 1
        assert sum(1 for s, _ in located[:100] if s == source) == pytest.approx(weight * 100, abs=1)  # interleaved
    assert mixture.samples_per_source(4321) == [sum(1 for s, _ in located[:4321] if s == i) for i in range(3)]

    a = prepared(tmp_path, "a")
    b = prepared(tmp_path, "b", docs=[d.upper() for d in DOCS], tokenizer=os.path.join(a, "tokenizer"))
    data = build_training_data(f"0.75:{a},0.25:{b}", 16, seed=0, workers=0)
    batches = data.step_batches(0, 8)
    rows = torch.cat([next(batches)["input_ids"] for _ in range(5)])
    from_b = {data.corpora[1].block("train", i, 16).tobytes() for i in range(data.blocks[1])}
    assert sum(r.numpy().tobytes() in from_b for r in rows) == 10  # a quarter of 40 rows
    assert data.summary()["data_shares"] == {a: 0.75, b: 0.25}


def test_training_from_prepared_shards_writes_the_contract(tmp_path, tiny_ds_config):
    out = prepared(tmp_path, seq_len=256)
    config = tiny_ds_config(data=out, max_steps=3)
    summary = train(["--ds_config", config, "--output_dir", str(tmp_path / "run")])
    assert summary["tokens_seen"] == 3 * 2 * 256 and summary["data_shares"] == {out: 1.0}
    assert summary["data_skipped"] == {}
    with pytest.raises(ValueError, match="prepared for seq_len 256, this run's preset has 128"):
        PreparedData([(1.0, out)], 128, 0)


_FAILING_PREPARE = """
import pathlib, signal, sys
sys.path.insert(0, "tests")
from helpers.corpora import prepared
from adaptive_ds.data import prepare

def disk_full(self, *args):
    raise OSError(28, "No space left on device")

prepare._ShardWriter.write = disk_full
if sys.argv[2] == "late":  # the second worker reaches its start after the pool is already being terminated
    import multiprocessing, time
    init = prepare._init_worker

    def late_init(*args):
        if multiprocessing.current_process()._identity[0] > 1:
            time.sleep(3)
        init(*args)

    prepare._init_worker = late_init
signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as the training command has one
try:
    prepared(pathlib.Path(sys.argv[1]))
except OSError as error:
    sys.exit(f"failed as it should: {error}")
"""


@pytest.mark.parametrize("worker_start", ["prompt", "late"])
def test_a_prepare_that_fails_ends_in_a_process_that_handles_sigterm_itself(worker_start, tmp_path):
    """The training command installs a Python SIGTERM handler before it prepares a corpus. When the prepare fails
    (here: the disk is full at the first write), the pool is terminated while its workers wait on their queue: with
    the inherited handler they outlived SIGTERM and the pool waited on them forever. "late": a worker that has not
    reached its own start when the terminate comes (a loaded machine starts workers slowly) held the inherited
    handler there too. Run in a process group of its own, so that a hang is killed whole."""
    proc = subprocess.Popen([sys.executable, "-c", _FAILING_PREPARE, str(tmp_path), worker_start], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the failed prepare never ended: its pool waited on workers that outlived SIGTERM")
    assert proc.returncode == 1 and "failed as it should: [Errno 28] No space left on device" in err, err[-2000:]


def test_bad_records_are_skipped_and_counted_and_a_truncated_file_ends_early(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = [d for d in DOCS[:40]]
    with gzip.open(corpus / "c4-train.00000-of-00002.json.gz", "wb") as f:
        f.write(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in good[:20]))
        f.write(b'{"text": ""}\n{"text": "bad \xff\xfe bytes"}\n{"url": "no text"}\n{not json\n')
    whole = gzip.compress(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in good[20:]))
    (corpus / "c4-train.00001-of-00002.json.gz").write_bytes(whole[: len(whole) // 2])  # cut mid-stream
    out = str(tmp_path / "prep")
    manifest = prepare(PrepareArguments(str(corpus), "bpe:300", validation_share=0.1), out, workers=1)
    assert manifest["skipped"] == {"empty": 1, "invalid_utf8": 1, "missing_field": 1, "not_json": 1,
                                   "truncated_file": 1}
    documents = manifest["train"]["documents"] + manifest["validation"]["documents"]
    assert 20 < documents < 40  # the first file whole, the truncated one up to where it breaks
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tokenizer"))
    text = tok.decode(np.fromfile(os.path.join(out, "train_00000.bin"), dtype=np.uint16).tolist())
    assert [d for d in good if d in text] == [d for d in good[:documents] if not is_validation(d, 1234, 0.1)]
    assert build_training_data(out, 4, 0).summary()["data_skipped"] == manifest["skipped"]


def test_resuming_deep_reads_as_few_blocks_as_resuming_early(tmp_path, monkeypatch):
    data = build_training_data(prepared(tmp_path), 16, seed=0, workers=0)  # workers 0: the reads happen here
    reads = []
    real = PreparedCorpus.block

    def counted(corpus, split, index, seq_len):
        reads.append((split, index))
        return real(corpus, split, index, seq_len)

    monkeypatch.setattr(PreparedCorpus, "block", counted)
    read = {}
    for step in (10, 10**7):
        reads.clear()
        rows = next(data.step_batches(step, 8))["input_ids"]
        read[step] = list(reads)
        # the seek lands where an uninterrupted run would be: the step's own 8 samples
        expected = np.stack([data.sample(g) for g in range(step * 8, step * 8 + 8)])
        assert rows.numpy().tolist() == expected.tolist()
    assert len(read[10]) == len(read[10**7]) == 8  # the step's rows, nothing before them
    assert all(split == "train" and 0 <= index < data.blocks[0] for split, index in read[10**7])


def _continued_losses(tmp_path, name, data, command=(), **block):
    """Step losses of an 8-step run, then of the same run resumed from its step-4 checkpoint (the step-8 one
    removed, as if the run had been killed before it)."""
    out = tmp_path / name
    config = write_ds_config(tmp_path, data=data, max_steps=8, save_steps=4, log_steps=1, warmup_steps=2, **block)
    args = ["--ds_config", config, "--output_dir", str(out)]
    losses = {}
    for run in ("whole", "resumed"):
        if command:
            result = run_command([*command, "launchers/train.py", *args])
            assert result.returncode == 0, result.stderr[-3000:]
        else:
            train(args)
        losses[run] = logged_losses(out)
        shutil.rmtree(out / "checkpoints" / "step00000008")
        (out / "checkpoints" / "latest").write_text("step00000004")
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("source", ["prepared", "streamed", "embedded"])
def test_a_resumed_run_logs_the_same_losses_as_an_uninterrupted_one(tmp_path, source):
    data = {"prepared": lambda: prepared(tmp_path, seq_len=256), "embedded": lambda: "embedded",
            "streamed": lambda: write_c4(tmp_path / "c.json.gz", DOCS * 5)}[source]()
    losses = _continued_losses(tmp_path, source, data, tokenizer="bpe:320")
    assert json.loads((tmp_path / source / "summary.json").read_text())["resumed_from_step"] == 4
    assert [losses["resumed"][s] for s in range(5, 9)] == pytest.approx(
        [losses["whole"][s] for s in range(5, 9)], rel=1e-6, abs=0)


# Prepared data on 2 processes against 1 process, and a 2-process run resumed on 1 process: in
# tests/integration/test_universal.py (its dense case trains on prepared data), one set of runs for both checks.
