"""The data benchmark's --work folder: what it finds there that it did not make (a corpus without the record of its
settings, a prepared directory of someone else's) ends the command in one line and is left as it was."""

import json
import os

import pytest
from helpers.common import ROOT

from adaptive_ds.tools import data_benchmark
from adaptive_ds.tools.data_benchmark import main

SETTINGS = ["--files", "1", "--corpus_mb", "1", "--steps", "1"]


def _snapshot(directory) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), directory): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(directory) for f in names}


def _refused(work) -> str:
    """The one line the command ends with on `work`, which it leaves as it was."""
    before = _snapshot(work)
    with pytest.raises(SystemExit) as exited:
        main(["--work", str(work), *SETTINGS])
    message = str(exited.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert _snapshot(work) == before
    return message


def _corpus(work):
    """A corpus as the command records it: c4/ and corpus.json with this test's settings."""
    (work / "c4").mkdir(parents=True)
    (work / "c4" / "c4-train.00000-of-00001.json.gz").write_bytes(b"")
    (work / "corpus.json").write_text(json.dumps({"files": 1, "corpus_mb": 1.0}))


def test_a_corpus_without_its_settings_record_is_refused_in_one_line(tmp_path):
    _corpus(tmp_path)
    os.remove(tmp_path / "corpus.json")  # as an earlier version left --work
    assert "c4/ without the corpus.json" in _refused(tmp_path)
    (tmp_path / "corpus.json").write_text("{")
    assert "corpus.json" in _refused(tmp_path)


def test_a_prepared_directory_it_did_not_make_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped ds_configs, whose needs the command computes
    monkeypatch.setattr(data_benchmark, "prepare", lambda *a, **k: pytest.fail("prepare reached"))
    _corpus(tmp_path)
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "manifest.json").write_text(json.dumps({"the user's": "prepare"}))
    (tmp_path / "prepared" / "train_00000.bin").write_bytes(b"\0" * 64)
    assert "prepared/ that this command did not make" in _refused(tmp_path)
