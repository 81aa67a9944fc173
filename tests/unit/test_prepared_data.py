"""Prepared data refused in one line: a mixture of unprepared sources, and a prepare of a source without documents
(nothing written)."""


import pytest
from helpers.corpora import write_c4

from adaptive_ds.data import build_training_data
from adaptive_ds.data.prepare import main


def test_a_mixture_of_unprepared_sources_is_refused(tmp_path):
    source = write_c4(tmp_path / "c.json.gz")
    with pytest.raises(ValueError, match="are not prepared directories"):
        build_training_data(f"0.5:{source},0.5:{source}", 16, 0)
    with pytest.raises(ValueError, match="not WEIGHT:SOURCE with a positive weight"):
        build_training_data(f"x:{source},0.5:{source}", 16, 0)


def test_prepare_refuses_a_source_without_documents_and_writes_nothing(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "\xff\xfe"}\n{"text": 3}\n')
    with pytest.raises(SystemExit, match=f"^error: data {str(empty)!r} holds no records; pass a source with "
                                         "documents$"):
        main(["--data", str(empty), "--out", str(tmp_path / "p"), "--workers", "1"])
    with pytest.raises(SystemExit, match=r"holds no usable document \(2 records skipped: invalid_utf8 1, not_text 1\)"):
        main(["--data", str(bad), "--out", str(tmp_path / "p"), "--workers", "1"])
    assert not (tmp_path / "p").exists()

