"""The content hash of a --data value: the same tokens hash the same wherever they lie, one changed token, a
changed tokenizer or another embedded grammar hash otherwise, and what cannot be pinned says why."""

import hashlib
import os
import shutil

import numpy as np
import pytest
from helpers.pilots import prepared_dir

from adaptive_ds.data import embedded
from adaptive_ds.data.identity import data_identity, describe, main


def test_a_prepared_directory_hashes_its_tokens_and_tokenizer_wherever_it_lies(tmp_path):
    corpus = prepared_dir(tmp_path / "a")
    first = data_identity(corpus)
    assert len(first["sha256"]) == 64 and first["of"] == ("prepared directory: its 3 token shards (43 tokens) and "
                                                          "its tokenizer")
    copy = shutil.copytree(corpus, tmp_path / "elsewhere" / "b")
    os.utime(copy / "train_00000.bin", (0, 0))  # another place and time: the same content
    assert data_identity(str(copy)) == first
    # one token changed in place (the manifest still matches the file's size)
    tokens = np.fromfile(copy / "train_00001.bin", dtype=np.uint16)
    tokens[3] += 1
    tokens.tofile(copy / "train_00001.bin")
    assert data_identity(str(copy))["sha256"] != first["sha256"]
    # the same token ids under another tokenizer mean other text
    retokenized = prepared_dir(tmp_path / "c", tokenizer_text="bpe v2")
    assert data_identity(retokenized)["sha256"] != first["sha256"]
    # the ids split between training and validation otherwise
    moved = prepared_dir(tmp_path / "d", train=tuple(range(39)), validation=(39, 7, 8, 9))
    assert data_identity(moved)["sha256"] != first["sha256"]


def test_a_mixture_hashes_its_parts_and_their_weights(tmp_path):
    a, b = prepared_dir(tmp_path / "a"), prepared_dir(tmp_path / "b", tokenizer_text="bpe v2")
    mixture = data_identity(f"0.7:{a},0.3:{b}")
    assert mixture["of"] == "a mixture of 2 prepared directories: each one's hash and weight"
    assert mixture != data_identity(f"0.5:{a},0.5:{b}") and mixture == data_identity(f"0.7:{a},0.3:{b}")


def test_local_files_hash_their_bytes_and_a_hub_dataset_says_why_it_has_none(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"text": "a cat sleeps"}\n')
    local = data_identity(str(tmp_path / "docs.jsonl"))
    # one file: sha256 of its name line and bytes, worked out here by hashlib directly
    assert local["sha256"] == hashlib.sha256(b'\ndocs.jsonl\n{"text": "a cat sleeps"}\n').hexdigest()
    (tmp_path / "docs.jsonl").write_text('{"text": "a dog sleeps"}\n')
    assert data_identity(str(tmp_path / "docs.jsonl"))["sha256"] != local["sha256"]
    hub = data_identity("allenai/c4")
    assert hub["sha256"] is None and "not pinned" in hub["why"] and "adaptive_ds.data.prepare" in hub["why"]
    assert describe(None) == "data hash not recorded" and describe(hub).startswith("no data hash: 'allenai/c4'")


def test_the_embedded_generator_is_identified_by_what_it_generates(monkeypatch):
    base, hard = data_identity("embedded"), data_identity("embedded:hard")
    assert base["sha256"] != hard["sha256"] and data_identity("embedded") == base
    assert "the embedded generator (hard tier)" in hard["of"]
    # another weight in the grammar: another corpus, another identity
    monkeypatch.setitem(embedded.DOMAIN_WEIGHTS, "[prose]", 0.5)
    assert data_identity("embedded")["sha256"] != base["sha256"]


@pytest.mark.parametrize(("make", "message"), [
    (lambda tmp: str(tmp / "nowhere.jsonl"), r"^data '.*nowhere.jsonl' names no file$"),
    (lambda tmp: f"1:{tmp / 'nowhere'},1:{tmp / 'nowhere'}", r"^prepared data '.*nowhere' does not exist$"),
    (lambda tmp: (tmp / "PREPARING").write_text("{}") and f"1:{tmp},1:{tmp}", r"is a partial prepare \(no manifest"),
])
def test_what_cannot_be_hashed_is_refused_in_one_line(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        data_identity(make(tmp_path))


def test_the_command_prints_the_identity_and_refuses_in_one_line(tmp_path, capsys):
    corpus = prepared_dir(tmp_path / "a")
    main([corpus])
    assert data_identity(corpus)["sha256"] in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"^error: data '.*' names no file$"):
        main([str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit) as usage:
        main([])
    assert usage.value.code == 2 and "the following arguments are required: data" in capsys.readouterr().err
