"""The data benchmark's --work folder: what it made itself it prepares afresh; a prepare the user replaced is
refused in one line and left as it was."""

import json
import os

import pytest
from helpers.common import ROOT
from helpers.data_benchmark_work import SETTINGS, refused, write_corpus

from adaptive_ds.tools import data_benchmark
from adaptive_ds.tools.data_benchmark import main


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
    write_corpus(tmp_path)
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
    assert "prepared/ that this command did not make" in refused(tmp_path)
    assert len(prepares) == 3
