"""Text data through loader workers and real runs: windows shuffled the same with any number of workers, a resume
that seeks, training on local C4 shards, and token budgets."""

import json

import pytest
from helpers.corpora import streamed_format_docs, write_format

from adaptive_ds.training import train


def _rows(batches, steps):
    return [row.tolist() for _ in range(steps) for row in next(batches)["input_ids"]]


@pytest.mark.parametrize("workers", [1, 2])
def test_windows_are_shuffled_and_the_same_with_any_number_of_workers(tmp_path, workers):
    path = write_format(tmp_path, "c4")
    reference = _rows(streamed_format_docs(path).step_batches(0, 4), 12)
    assert _rows(streamed_format_docs(path, workers=workers).step_batches(0, 4), 12) == reference
    unshuffled = streamed_format_docs(path, window_docs=1)  # one document per window: the source's order
    assert _rows(unshuffled.step_batches(0, 4), 12) != reference


def test_a_resume_seeks_to_the_saved_position_and_continues_exactly(tmp_path):
    path = write_format(tmp_path, "c4")
    reference = _rows(streamed_format_docs(path).step_batches(0, 4), 20)  # past the end of the first epoch
    first = streamed_format_docs(path, workers=1)
    batches = first.step_batches(0, 4)
    assert _rows(batches, 13) == reference[:52]
    state = json.loads(json.dumps(first.state_dict()))  # as saved in the checkpoint
    resumed = streamed_format_docs(path, workers=2)
    resumed.load_state_dict(state)
    assert _rows(resumed.step_batches(13, 4), 7) == reference[52:]
    moved = streamed_format_docs(path)
    moved.load_state_dict(state)
    with pytest.raises(ValueError, match="resumes only on its own number of processes"):
        next(moved.step_batches(13, 4, 0, 2))


def test_training_on_local_c4_shards_writes_the_contract(tmp_path, tiny_ds_config):
    path = write_format(tmp_path, "c4")
    config = tiny_ds_config(data=path, tokenizer="bpe:320", validation_share=0.2, max_steps=3)
    out = tmp_path / "run"
    summary = train(["--ds_config", config, "--output_dir", str(out)])
    assert summary["tokens_seen"] == 3 * 2 * 256 and "entropy_floor" not in summary
    assert (out / "final" / "tokenizer.json").exists()


def test_token_budget_sets_the_steps_and_epochs_need_prepared_data(tmp_path, tiny_ds_config):
    path = write_format(tmp_path, "txt")
    config = tiny_ds_config(data=path, tokenizer="bpe:320", validation_share=0.2, tokens="2000")
    summary = train(["--ds_config", config, "--output_dir", str(tmp_path / "run")])
    assert summary["steps"] == 4  # ceil(2000 / (2 x 256))
    with pytest.raises(ValueError, match="--epochs with a token budget .* needs random access: prepare"):
        train(["--ds_config", config, "--output_dir", str(tmp_path / "run2"), "--epochs", "2"])
