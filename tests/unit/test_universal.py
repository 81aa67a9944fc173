"""Only the number of processes and the expert-parallel size may differ between a checkpoint and the run that
resumes it."""


import pytest

from adaptive_ds.training.checkpoint import (
    LAYOUT_KEYS,
    CheckpointError,
    changes_layout,
    check_compatible,
)


def test_only_the_number_of_processes_and_ep_size_may_differ_on_resume():
    saved = {"world_size": 2, "arch": "moe", "model": {"moe_ep_size": 2, "hidden_size": 32}}
    relaid = {"world_size": 2, "arch": "moe", "model": {"moe_ep_size": 1, "hidden_size": 32}}
    check_compatible(saved, {**relaid, "world_size": 1}, "ckpt", allowed=LAYOUT_KEYS)
    assert changes_layout(saved, relaid) and changes_layout(saved, {**saved, "world_size": 1})
    assert not changes_layout(saved, saved)
    with pytest.raises(CheckpointError, match=r"model.hidden_size 32 \(this run: 64\)"):
        check_compatible(saved, {**relaid, "model": {"moe_ep_size": 1, "hidden_size": 64}}, "ckpt",
                         allowed=LAYOUT_KEYS)
    with pytest.raises(CheckpointError, match=r"model.moe_ep_size 2 \(this run: 1\)"):
        check_compatible(saved, relaid, "ckpt")
