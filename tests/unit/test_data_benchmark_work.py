"""The data benchmark's --work folder: what it finds there that it did not make (a corpus without the record of its
settings, a prepared directory of someone else's) ends the command in one line and is left as it was."""

import json
import os

import pytest
from helpers.common import ROOT
from helpers.data_benchmark_work import refused, write_corpus

from adaptive_ds.tools import data_benchmark


def test_a_corpus_without_its_settings_record_is_refused_in_one_line(tmp_path):
    write_corpus(tmp_path)
    os.remove(tmp_path / "corpus.json")  # as an earlier version left --work
    assert "c4/ without the corpus.json" in refused(tmp_path)
    (tmp_path / "corpus.json").write_text("{")
    assert "corpus.json" in refused(tmp_path)


def test_a_prepared_directory_it_did_not_make_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped ds_configs, whose needs the command computes
    monkeypatch.setattr(data_benchmark, "prepare", lambda *a, **k: pytest.fail("prepare reached"))
    write_corpus(tmp_path)
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "manifest.json").write_text(json.dumps({"the user's": "prepare"}))
    (tmp_path / "prepared" / "train_00000.bin").write_bytes(b"\0" * 64)
    assert "prepared/ that this command did not make" in refused(tmp_path)
