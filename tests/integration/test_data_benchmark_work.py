"""The data benchmark's --work folder: what it made itself it prepares afresh; a prepare the user replaced is
refused in one line and left as it was."""

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


class _Stop(Exception):
    """Ends the measurement after the prepare: what is under test is what the command does to --work."""


def test_its_own_prepare_is_made_afresh_and_one_replaced_by_the_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    prepares = []

    def prepare(args, out):
        assert not os.path.exists(out)  # the command's previous prepare was removed first
        os.makedirs(out)
        manifest = {"n": len(prepares), "train": {"tokens": 1}, "validation": {"tokens": 1}, "seconds": 1.0}
        with open(os.path.join(out, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        prepares.append(out)
        return manifest

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(data_benchmark, "prepare", prepare)
    monkeypatch.setattr(data_benchmark, "build_training_data", stop)
    _corpus(tmp_path)
    for _ in range(2):
        with pytest.raises(_Stop):
            main(["--work", str(tmp_path), *SETTINGS])
    assert len(prepares) == 2
    # killed while preparing: its partial prepare is its own too
    (tmp_path / "prepared" / "manifest.json").unlink()
    with pytest.raises(_Stop):
        main(["--work", str(tmp_path), *SETTINGS])
    # the user put a prepare of their own in its place
    (tmp_path / "prepared" / "manifest.json").write_text(json.dumps({"the user's": "prepare"}))
    assert "prepared/ that this command did not make" in _refused(tmp_path)
    assert len(prepares) == 3
