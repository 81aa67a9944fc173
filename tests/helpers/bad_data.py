"""What the bad-data tests share: a good JSON-lines corpus, writing a file, and the one line the training command
ends with on data it cannot use."""

import json
import signal

import pytest
from helpers.common import ends_within, write_ds_config
from helpers.corpora import DOCS

from adaptive_ds.training.__main__ import main

GOOD = "".join(json.dumps({"text": d}) + "\n" for d in DOCS[:40])


def refused(tmp_path, capfd, data: str, output_dir=None, **block) -> str:
    """The one line the training command ends with on `data` (checked: one line, no traceback, and the output
    directory not created)."""
    config = write_ds_config(tmp_path, data=data, **{"tokenizer": "bpe:300", "max_steps": 2, **block})
    out = output_dir or tmp_path / "run"
    existed = out.exists()
    capfd.readouterr()  # only what the command writes
    sigterm = signal.getsignal(signal.SIGTERM)  # main() installs its own
    try:
        with ends_within(120), pytest.raises(SystemExit) as stopped:
            main(["--ds_config", config, "--output_dir", str(out)])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    err = capfd.readouterr().err
    message = err.splitlines()[-1] if err else ""
    assert stopped.value.code == 1 and message.startswith("error: "), err[-3000:]
    assert "Traceback" not in err
    assert out.exists() == existed
    return message


def write_file(path, content: bytes | str) -> str:
    """`content` written to `path`; returns the path as a string, as --data takes it."""
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return str(path)
