"""The embedded corpus through the data loader's workers: a step holds the same rows whatever the number of ranks,
and a resume is a seek."""

import torch

from adaptive_ds.data import build_training_data


def test_a_step_holds_the_same_rows_whatever_the_ranks_and_a_resume_is_a_seek():
    data = build_training_data("embedded", 64, seed=5)
    one = data.step_batches(0, 8)
    steps = [next(one) for _ in range(3)]
    for world in (2, 4):
        ranks = [data.step_batches(0, 8, rank, world) for rank in range(world)]
        for step in steps:
            parts = [next(r) for r in ranks]
            assert torch.cat([p["input_ids"] for p in parts]).equal(step["input_ids"])
    assert next(data.step_batches(2, 8))["input_ids"].equal(steps[2]["input_ids"])  # no replay
    assert not steps[0]["input_ids"].equal(steps[1]["input_ids"])
    val = data.validation_batches(8, 1)[0]["input_ids"]
    assert not any((val[:, None] == s["input_ids"][None]).all(-1).any() for s in steps)
    pads = steps[0]["input_ids"] == data.tokenizer.pad_token_id
    assert pads.any() and (steps[0]["labels"][pads] == -100).all()
