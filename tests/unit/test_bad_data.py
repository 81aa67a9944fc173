"""Data a run cannot use is refused in one line before training: a source without a usable document, a mixture
weight that is not positive and finite, a stream without a held-out document; a gzip file cut short is read up to
the cut."""

import gzip
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.bad_data import GOOD, refused, write_file
from helpers.corpora import DOCS

from adaptive_ds.data.text import is_validation, open_documents


def _parquet(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


@pytest.mark.parametrize("case", ["empty jsonl", "parquet without the field", "empty directory", "missing file",
                                  "glob of nothing", "gz that is not gzip", "unsupported extension",
                                  "only non-text records", "Hub name that cannot be reached"])
def test_a_source_without_a_usable_document_is_refused_before_training(tmp_path, capfd, monkeypatch, case):
    if case == "empty jsonl":
        source = write_file(tmp_path / "corpus.jsonl", "")
        expected = f"data {source!r} holds no records; pass a source with documents"
    elif case == "parquet without the field":
        source = _parquet(tmp_path / "corpus.parquet", content=DOCS[:20])
        expected = (f"data {source!r} has no field 'text' in its first record; pass the field that holds the text "
                    "(--text_field)")
    elif case == "empty directory":
        (tmp_path / "corpus").mkdir()
        source = str(tmp_path / "corpus")
        expected = f"data directory {source!r} holds no data files; valid endings: .jsonl, .json, "
    elif case == "missing file":
        source = str(tmp_path / "nowhere.jsonl")
        expected = f"data path {source!r} does not exist; valid choices: 'embedded', "
    elif case == "glob of nothing":
        write_file(tmp_path / "corpus.jsonl", GOOD)
        source = str(tmp_path / "c4-*.json.gz")
        expected = f"data glob {source!r} matches no file; "
    elif case == "gz that is not gzip":
        source = write_file(tmp_path / "corpus.jsonl.gz", GOOD)
        expected = f"data file {source!r} ends in .gz but is not gzip-compressed; "
    elif case == "unsupported extension":
        source = write_file(tmp_path / "corpus.csv", "text\nhello\n")
        expected = f"data file {source!r}: unknown format; valid endings: .jsonl, "
    elif case == "only non-text records":
        source = write_file(tmp_path / "corpus.jsonl", '{"text": 7}\n{"text": null}\n{"text": ["a"]}\n{"text": " "}\n')
        expected = (f"data {source!r} holds no usable document (4 records skipped: not_text 3, empty 1); each "
                    "record needs non-empty text in its 'text' field")
    else:
        import datasets.config
        import huggingface_hub.constants

        for module in (datasets.config, huggingface_hub.constants):  # read at import: the variable is too late
            monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
        source = "no-such-owner/no-such-corpus"
        expected = (f"data {source!r} is not a local path, and as a Hub dataset it cannot be opened (Couldn't reach "
                    f"'{source}' on the Hub")
    assert refused(tmp_path, capfd, source).startswith(f"error: {expected}")


@pytest.mark.parametrize("weight", ["0", "-1", "nan", "inf"])
def test_a_mixture_weight_that_is_not_positive_and_finite_is_refused(tmp_path, capfd, weight):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")  # refused before the directories are looked at
    message = refused(tmp_path, capfd, f"{weight}:{a},1:{b}")
    assert message == (f"error: data mixture part '{weight}:{a}' is not WEIGHT:SOURCE with a positive weight; e.g. "
                       "0.7:DIR_A,0.3:DIR_B")


def test_a_gzip_file_cut_short_is_read_up_to_the_cut(tmp_path):
    # The .gz check looks at the magic bytes only: a truncated download is read up to where it breaks, not refused.
    whole = gzip.compress(GOOD.encode())
    source = write_file(tmp_path / "c4-train.00000-of-00001.json.gz", whole[: len(whole) // 2])
    skipped = Counter()
    texts = list(open_documents(source, skipped=skipped))
    assert 0 < len(texts) < 40 and texts == DOCS[: len(texts)]
    assert skipped == {"truncated_file": 1}


def test_a_stream_without_a_held_out_document_is_refused_not_validated_as_nan(tmp_path, capfd):
    docs = [d for d in DOCS[:40] if not is_validation(d, 1234, 0.01)]  # 1234: the run's seed; 0.01 its share
    source = write_file(tmp_path / "corpus.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in docs))
    # refused before the output directory is made: the held-out batches are read at setup
    assert refused(tmp_path, capfd, source, max_steps=1) == (
        f"error: data {source!r} holds no document held out for validation (--validation_share 0.01 of {len(docs)} "
        "usable records); pass a larger --validation_share or more documents")
