"""A prepared-data checkpoint whose identity names the tokenizer by --tokenizer, from before identities recorded
the prepared tokenizer's hash, resumes with one warning."""

import json
import logging

from helpers.corpora import prepared

from adaptive_ds.training import checkpoint, train


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_prepared_data_checkpoint_from_before_the_tokenizer_hash_resumes_with_one_warning(tmp_path, tiny_ds_config):
    # Before run identities recorded prepared data's tokenizer by its hash, they held the --tokenizer string, which
    # prepared data ignores: such a checkpoint cannot say which tokenizer it trained on, so it resumes unchecked.
    source = prepared(tmp_path, seq_len=256)
    out = tmp_path / "run"
    train(["--ds_config", tiny_ds_config(data=source, tokenizer="bpe:300", max_steps=1),
           "--output_dir", str(out)])
    run_json = out / "checkpoints" / "step00000001" / "run.json"
    state = json.loads(run_json.read_text())
    assert state["identity"]["tokenizer"].startswith("sha256:")
    state["identity"]["tokenizer"] = "bpe:300"  # as the earlier version wrote it
    run_json.write_text(json.dumps(state))

    records = _Records()
    logging.getLogger(checkpoint.__name__).addHandler(records)
    try:
        summary = train(["--ds_config", tiny_ds_config(data=source, tokenizer="bpe:300", max_steps=2),
                         "--output_dir", str(out)])
    finally:
        logging.getLogger(checkpoint.__name__).removeHandler(records)
    assert summary["resumed_from_step"] == 1
    unchecked = [m for m in records.messages if "tokenizer" in m]
    assert len(unchecked) == 1 and "'bpe:300'" in unchecked[0] and "not checked" in unchecked[0], records.messages
    # the run's own checkpoint records the hash again
    saved = json.loads((out / "checkpoints" / "step00000002" / "run.json").read_text())
    with open(f"{source}/manifest.json") as f:
        assert saved["identity"]["tokenizer"] == f"sha256:{json.load(f)['tokenizer_sha256']}"
