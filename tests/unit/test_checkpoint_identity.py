"""A checkpoint's run identity written by an earlier version: only what it could not record then is relaxed (the
prepared tokenizer's hash); every other tokenizer difference is still refused."""


import pytest

from adaptive_ds.training import checkpoint


@pytest.mark.parametrize(("saved", "current"), [
    ("bpe:300", "bpe:320"),  # streamed text on another tokenizer
    ("sha256:aa", "sha256:bb"),  # prepared data prepared again with another tokenizer
    ("embedded", "sha256:bb"),  # another corpus altogether
])
def test_any_other_tokenizer_difference_is_still_refused(saved, current):
    base = {"preset": "debug", "arch": "dense", "data": "d", "seed": 1, "world_size": 1, "rows_per_step": 2}
    with pytest.raises(checkpoint.CheckpointError, match="does not match this run: tokenizer"):
        checkpoint.check_compatible({**base, "tokenizer": saved}, {**base, "tokenizer": current}, "ckpt")
