"""The data benchmark's --work folder under test: a corpus recorded as the command records one, and the one line
the command ends with on a folder it refuses, which it leaves as it was."""

import json

import pytest
from helpers.common import snapshot

from adaptive_ds.tools.data_benchmark import main

SETTINGS = ["--files", "1", "--corpus_mb", "1", "--steps", "1"]


def refused(work) -> str:
    """The one line the command ends with on `work`, which it leaves as it was."""
    before = snapshot(work)
    with pytest.raises(SystemExit) as exited:
        main(["--work", str(work), *SETTINGS])
    message = str(exited.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert snapshot(work) == before
    return message


def write_corpus(work):
    """A corpus as the command records it: c4/ and corpus.json with SETTINGS."""
    (work / "c4").mkdir(parents=True)
    (work / "c4" / "c4-train.00000-of-00001.json.gz").write_bytes(b"")
    (work / "corpus.json").write_text(json.dumps({"files": 1, "corpus_mb": 1.0}))
